"""Trial processes: every candidate runs in a clean process of its own, forked from the engine's worker.

Nothing a candidate does reaches the next one: patching torch or the clock, flipping backend flags or the
default dtype, leaking memory or threads, corrupting its own heap. Each candidate starts in a fresh fork of
the worker, and the worker never runs candidate code. The fork shares the resident weights, the captured
Programs and every imported module copy-on-write, so nothing is rebuilt or reloaded: a trial costs one
``fork`` (milliseconds) and its own compile of the candidate.

::

    worker (trusted: model, reference forwards, inputs, the clock, every comparison)
      ├─ trial "baseline"  the captured forwards, run the same way as any candidate's (so timings compare)
      └─ trial <cid>       one per loaded candidate: builds it per tier and runs its forwards, nothing else

The worker drives a trial over a socket pair, one message at a time:

* ``build`` compiles or loads the candidate for a tier (the plan's passes, user pass modules, codegen,
  a source file's ``build(program)``: all of it runs in the trial);
* ``call`` runs one forward; the inputs go over by value and the outputs come back by value, where the
  worker compares them with its own reference;
* ``bench`` is the timed loop: the inputs live in a shared memory arena that the worker fills with fresh
  values before each call, the trial copies each call's outputs into the arena before it answers, and one
  byte each way starts and ends a call. The worker's clock times that round trip: the candidate cannot
  reach the clock, and whichever calls the worker samples, their outputs are already there to check.

The KV cache a trial's forwards read and write is a shared twin (``memfd``) of the worker's; the worker
copies its own cache in before a call and back after it, so its reference never runs on memory a
candidate's process can write. A trial that raises, hangs, exits, segfaults or passes its memory limit is
killed (with its process group) and costs that candidate only; orphans it leaves behind are re-parented to
the worker (a subreaper) and killed.

Fork safety: a process forked from one whose OpenMP pool has run hangs in its first parallel region, so
the worker computes with one thread (``torch.set_num_threads(1)``) and each trial sets the engine's
``--threads``. A CUDA context does not survive ``fork`` at all: on a GPU the engine runs candidates in the
worker and audits its global state instead (``tkcc.runtime.global_state``).
"""
from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import struct
import threading
import time
import traceback
from multiprocessing import reduction
from multiprocessing.connection import Connection

import torch

from tkcc.errors import EngineError, TkccError
from tkcc.runtime import procs

WATCH_S = 0.1  # how often the worker's watchdog reads each trial's memory
READY_TIMEOUT_S = 60.0
_RUN, _PING, _END = 0, -1, -2  # bench frames: >= 0 run that input set; -1 answer at once; -2 stop


class TrialFailed(Exception):
    """A trial process died, hung or passed its memory limit; ``kind``: crashed | timeout | memory."""

    def __init__(self, kind: str, message: str, pid: int | None = None):
        super().__init__(message)
        self.kind, self.pid = kind, pid


class CandidateRaised(Exception):
    """The candidate's code raised in its trial; ``type_name`` and the trial's traceback come with it."""

    def __init__(self, type_name: str, message: str, tb: str, memory: bool):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.tb, self.kind = type_name, tb, "memory" if memory else "raised"


class CandidateRefused(EngineError):
    """The candidate is bad input (a plan that does not resolve, an artifact that does not open): refused."""


# ------------------------------------------------------------------------------------ tensors by value
class _T:
    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: str, shape: tuple, data: bytes):
        self.dtype, self.shape, self.data = dtype, shape, data


def _enc(x):
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return _T(str(t.dtype).replace("torch.", ""), tuple(t.shape), data)
    if isinstance(x, (list, tuple)):
        return type(x)(_enc(v) for v in x)
    if isinstance(x, dict):
        return {k: _enc(v) for k, v in x.items()}
    return x


def _dec(x):
    if isinstance(x, _T):
        dtype = getattr(torch, x.dtype)
        if not x.data:
            return torch.empty(x.shape, dtype=dtype)
        return torch.frombuffer(bytearray(x.data), dtype=torch.uint8).view(dtype).reshape(x.shape)
    if isinstance(x, (list, tuple)):
        return type(x)(_dec(v) for v in x)
    if isinstance(x, dict):
        return {k: _dec(v) for k, v in x.items()}
    return x


def _send(conn: Connection, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=5))


def _recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


# ------------------------------------------------------------------------------------ shared memory
class Arena:
    """Anonymous shared memory (memfd): tensors laid out in it are the same bytes in the worker and a trial."""

    def __init__(self, nbytes: int, name: str = "tkcc-arena"):
        self.size = max(mmap.PAGESIZE, -(-int(nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.fd = os.memfd_create(name, 0)
        os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(self.fd, self.size)
        self._next = 0

    @classmethod
    def attach(cls, fd: int, size: int) -> "Arena":
        a = cls.__new__(cls)
        a.fd, a.size, a.mm, a._next = fd, size, mmap.mmap(fd, size), size
        return a

    def take(self, nbytes: int, align: int = 64) -> int:
        off = -(-self._next // align) * align
        if off + nbytes > self.size:
            raise EngineError(f"shared arena of {self.size} bytes cannot hold {nbytes} more at {off}")
        self._next = off + nbytes
        return off

    def tensor(self, off: int, shape, dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=off).view(dtype).reshape(
            tuple(shape))

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _layout(tensors: list[torch.Tensor]) -> tuple[int, list]:
    size, out = 0, []
    for t in tensors:
        size = -(-size // 64) * 64
        out.append((size, tuple(t.shape), str(t.dtype).replace("torch.", "")))
        size += t.numel() * t.element_size()
    return size, out


def _storages(programs: dict) -> list[torch.Tensor]:
    """Every distinct KV-cache storage of every tier, as a uint8 view of the whole storage."""
    seen, out = set(), []
    for prog in programs.values():
        for b in (prog.state.buffers() if prog.state is not None else ()):
            st = b.untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                continue
            seen.add(st.data_ptr())
            out.append(torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)))
    return out


def _tensors_on(obj_roots, ptrs: set) -> list[torch.Tensor]:
    """Every tensor held as a buffer or attribute of the modules under ``obj_roots`` whose storage is in ``ptrs``."""
    found, seen = [], set()
    for root in obj_roots:
        if root is None:
            continue
        mods = root.modules() if isinstance(root, torch.nn.Module) else ()
        for m in mods:
            for t in list(m._buffers.values()) + [v for v in vars(m).values() if isinstance(v, torch.Tensor)]:
                if isinstance(t, torch.Tensor) and id(t) not in seen and t.untyped_storage().data_ptr() in ptrs:
                    seen.add(id(t))
                    found.append(t)
    return found


# ------------------------------------------------------------------------------------ the worker's side
class TrialHost:
    """The worker's trials: forks them, talks to them, watches their memory, kills what misbehaves."""

    def __init__(self, core):
        self.core = core
        self.parent = os.getpid()
        self.threads = int(core.threads)  # --threads, or torch's default (the worker itself computes with one)
        self.timeout_s = float(core.cfg.get("timeout_s") or 600.0)
        self.trials: dict[str, "Trial"] = {}
        self.killed: dict[int, str] = {}  # pid -> why the watchdog killed it
        self.forked: set[int] = set()     # every trial pid not yet reaped (not an orphan)
        self.lock = threading.Lock()
        self.events: list[dict] = []      # for the supervisor: trials lost while idle, orphans killed
        self.deadline: float | None = None  # the current operation's deadline (set by the worker loop)
        self.op_timeout_s = self.timeout_s  # ... and its whole timeout, for the messages
        self.limit = int(core.cfg.get("trial_max_bytes") or 0) or default_trial_limit(core)
        self.forks: list[float] = []
        self._state = _storages(core.programs)  # the worker's own KV cache: each trial gets a twin of it
        procs.set_child_subreaper()
        threading.Thread(target=self._watch, name="tkcc-trial-watchdog", daemon=True).start()

    # -- lifecycle ---------------------------------------------------------------------
    def trial(self, cid: str) -> "Trial":
        t = self.trials.get(cid)
        if t is None or not t.alive():
            if t is not None:
                t.reap()
            t = Trial(self, cid)
            self.trials[cid] = t
        return t

    def discard(self, cid: str) -> None:
        t = self.trials.pop(cid, None)
        if t is not None:
            t.kill()

    def pids(self) -> dict:
        return {t.pid: cid for cid, t in self.trials.items() if t.pid}

    def close(self) -> None:
        for cid in list(self.trials):
            self.discard(cid)

    def timeout(self) -> float:
        if self.deadline is None:
            return self.timeout_s
        return max(0.0, self.deadline - time.monotonic())

    # -- the KV-cache twins -----------------------------------------------------------------
    def twin(self) -> tuple[Arena, list[torch.Tensor]]:
        """A fresh shared twin of the worker's KV cache, for one trial (each has its own: one trial cannot
        write the cache another computes on)."""
        arena = Arena(sum(s.numel() for s in self._state) + 64 * (len(self._state) + 1), "tkcc-kv-twin")
        return arena, [arena.tensor(arena.take(s.numel()), (s.numel(),), torch.uint8) for s in self._state]

    def state_in(self, trial: "Trial") -> None:
        """The worker's cache into the trial's twin, before the trial runs a forward."""
        with torch.no_grad():
            for s, tw in zip(self._state, trial.twins):
                tw.copy_(s)

    def state_out(self, trial: "Trial") -> None:
        """What the trial's forward left in its twin, back into the worker's cache (where checks read it)."""
        with torch.no_grad():
            for s, tw in zip(self._state, trial.twins):
                s.copy_(tw)

    # -- the watchdog ---------------------------------------------------------------------
    def _watch(self) -> None:
        """Kill a trial past its memory limit (idle or not) and any orphan re-parented to the worker."""
        while True:
            time.sleep(WATCH_S)
            live = {t.pid: (cid, t) for cid, t in list(self.trials.items()) if t.pid and not t.dead}  # list(): atomic
            for pid, (cid, t) in live.items():
                used = procs.private_bytes(pid)
                if used is not None and used > self.limit:
                    why = (f"the candidate's process used {used / 2**20:.0f} MiB of its own memory, over the limit "
                           f"of {self.limit / 2**20:.0f} MiB (--trial-max-rss)")
                    with self.lock:
                        self.killed[pid] = why
                    _killpg(pid)
            with self.lock:  # held across a fork and its registration: a new trial is never taken for an orphan
                orphans = [p for p in procs.children(self.parent) if p not in self.forked and _is_trial_orphan(p)]
                for pid in orphans:
                    _killpg(pid)
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
                    self.events.append({"kind": "orphan_killed", "pid": pid,
                                        "reason": "a process a candidate left behind (re-parented to the worker)"})

    def drain_events(self) -> list[dict]:
        with self.lock:
            out, self.events = self.events, []
        return out


def default_trial_limit(core) -> int:
    """Memory a candidate's process may write itself: 1 GiB, or 4x the model and its cache, whichever is more,
    never more than half the machine."""
    mem = core.memory()
    derived = max(1 << 30, 4 * (mem["model_bytes"] + mem["cache_bytes"]))
    total = procs.memory_total()
    return min(derived, total // 2) if total else derived


def _killpg(pid: int) -> None:
    for fn in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            fn()
        except (ProcessLookupError, PermissionError):
            pass


def _is_trial_orphan(pid: int) -> bool:
    """A child of the worker it did not fork as a trial: a trial's own child, re-parented when the trial died."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip().startswith("tkcc-trial")
    except OSError:
        return False


class Trial:
    """One candidate's process, as the worker sees it."""

    def __init__(self, host: TrialHost, cid: str):
        self.host, self.cid = host, cid
        self.dead: str | None = None
        t0 = time.perf_counter()
        self.arena, self.twins = host.twin()
        a, b = socket.socketpair()
        with host.lock:
            pid = os.fork()
            if pid:
                host.forked.add(pid)
        if pid == 0:  # ---- the trial
            code = 0
            try:
                a.close()
                _child(host, self, b)
            except BaseException:  # noqa: BLE001 - report and exit; the worker sees the exit
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        b.close()
        self.pid = pid
        self.conn = Connection(a.detach())
        self.exit_code: int | None = None
        self._reply(READY_TIMEOUT_S, "start-up")
        self.start_s = time.perf_counter() - t0
        host.forks.append(self.start_s)

    # -- liveness --------------------------------------------------------------------------
    def alive(self) -> bool:
        if self.dead is not None:
            return False
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.dead = "gone"
            return False
        if pid == 0:
            return True
        self.exit_code = status
        self.dead = _describe(status)
        return False

    def exited(self, wait_s: float = 2.0) -> bool:
        """After the socket closed: wait briefly for the exit status, so the failure can say how it died."""
        end = time.monotonic() + wait_s
        while self.alive():
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)
        return True

    def reap(self) -> None:
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        with self.host.lock:
            self.host.forked.discard(self.pid)

    def kill(self) -> None:
        if self.dead is None:
            try:
                _send(self.conn, {"op": "exit"})
            except OSError:
                pass
        _killpg(self.pid)
        self.reap()
        self.dead = self.dead or "killed"
        try:
            self.conn.close()
        except OSError:
            pass
        self.arena.close()

    def _fail(self, kind: str, message: str) -> TrialFailed:
        why = self.host.killed.pop(self.pid, None)
        if why:
            kind, message = "memory", why
        self.host.core.trial_lost(self.cid, message)
        self.kill()
        return TrialFailed(kind, message, self.pid)

    def _wait(self, timeout: float, what: str) -> None:
        """Return once the trial has answered; TrialFailed (after killing it) if it died or ran out of time."""
        deadline = time.monotonic() + timeout
        while True:
            step = min(0.05, max(0.0, deadline - time.monotonic()))
            try:
                if self.conn.poll(step):
                    return
            except (EOFError, OSError):
                pass
            if not self.alive():
                raise self._fail("crashed", f"the candidate's process died during {what} ({self.dead})")
            if time.monotonic() >= deadline:
                limit = self.host.op_timeout_s if self.host.deadline is not None else timeout
                raise self._fail("timeout", f"{what} did not finish within {limit:g} s")

    def _reply(self, timeout: float, what: str):
        self._wait(timeout, what)
        try:
            msg = _recv(self.conn)
        except (EOFError, OSError, pickle.UnpicklingError):
            self.exited()
            raise self._fail("crashed", f"the candidate's process died during {what} ({self.dead or 'no reply'})") \
                from None
        if msg.get("ok"):
            return msg.get("result")
        err = msg.get("error") or {}
        if err.get("refused"):
            raise CandidateRefused(err.get("message", "refused"))
        raise CandidateRaised(err.get("type", "Exception"), err.get("message", ""), err.get("traceback", ""),
                              bool(err.get("memory")))

    def send(self, op: str, **params) -> None:
        if self.dead is not None:
            raise EngineError(f"candidate {self.cid!r}: its process is gone ({self.dead}); load it again")
        try:
            _send(self.conn, {"op": op, **params})
        except OSError:
            self.exited()
            raise self._fail("crashed", f"the candidate's process is gone ({self.dead or 'broken pipe'})") from None

    def request(self, op: str, what: str | None = None, **params):
        self.send(op, **params)
        try:
            return self._reply(self.host.timeout(), what or op)
        except (CandidateRaised, CandidateRefused) as e:
            # whatever the candidate left behind goes with its process
            self.host.core.trial_lost(self.cid, f"the candidate {'was refused' if isinstance(e, TkccError) else 'raised'}")
            self.kill()
            raise

    # -- operations ------------------------------------------------------------------------
    def build(self, spec: dict, kind: str, tier: str) -> dict:
        return self.request("build", f"load for the {tier} tier", spec=spec, kind=kind, tier=tier)

    def call(self, tier: str, phase: str, args: tuple):
        self.host.state_in(self)
        res = self.request("call", f"a {phase} call on the {tier} tier", tier=tier, phase=phase, args=_enc(args))
        self.host.state_out(self)
        outs, back = _dec(res["outputs"]), _dec(res["args"])
        with torch.no_grad():  # what the forward did to its inputs, so the caller's checks see it
            for a, b in zip(args, back):
                if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
                    a.copy_(b)
        return outs


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit code {os.WEXITSTATUS(status)}"


class RemoteForward:
    """One phase of a candidate's forward on one tier, running in the candidate's trial process."""

    def __init__(self, trial: Trial, tier: str, phase: str):
        self.trial, self.tier, self.phase = trial, tier, phase

    def __call__(self, *args):
        return self.trial.call(self.tier, self.phase, args)

    def bench(self, sets: list[tuple], outputs: list[torch.Tensor]) -> "RemoteBench":
        return RemoteBench(self, sets, outputs)


class RemoteBench:
    """The timed loop of one bucket across the trial boundary (see the module docstring).

    ``sets`` (the rotated input sets) are copied into a shared arena; ``self.sets`` are the worker's views of
    them, which the timing loop refreshes in place before every call. ``outputs`` gives the shapes and
    dtypes of the output slots (the reference's outputs): a trial whose outputs differ is a failed check.
    Calling the bench with one of ``self.sets`` runs it and returns the slots holding that call's outputs.
    """

    def __init__(self, fwd: RemoteForward, sets: list[tuple], outputs: list[torch.Tensor]):
        self.trial, self.host, self.closed = fwd.trial, fwd.trial.host, True
        size_in, lay_in = _layout([x for s in sets for x in s if isinstance(x, torch.Tensor)])
        size_out, lay_out = _layout(list(outputs))
        out_base = -(-size_in // 64) * 64
        lay_out = [(out_base + off, shape, dt) for off, shape, dt in lay_out]
        self.arena = Arena(out_base + size_out + 64, "tkcc-bench")
        views = iter([self.arena.tensor(off, shape, getattr(torch, dt)) for off, shape, dt in lay_in])
        self.slots = [self.arena.tensor(off, shape, getattr(torch, dt)) for off, shape, dt in lay_out]
        self.sets, rows = [], []
        for s in sets:
            row, spec = [], []
            for x in s:
                if isinstance(x, torch.Tensor):
                    v = next(views)
                    v.copy_(x)
                    row.append(v)
                    spec.append("t")
                else:
                    row.append(x)
                    spec.append(("v", x))
            self.sets.append(tuple(row))
            rows.append(spec)
        self.index = {tuple(map(id, s)): j for j, s in enumerate(self.sets)}
        what = f"timing set-up on the {fwd.tier} tier"
        self.host.state_in(self.trial)
        self.trial.send("bench_open", tier=fwd.tier, phase=fwd.phase, size=self.arena.size, inputs=lay_in,
                        outputs=lay_out, sets=rows)
        reduction.send_handle(self.trial.conn, self.arena.fd, self.trial.pid)
        self._answer(what)
        self.closed = False

    def _answer(self, what: str) -> None:
        tr = self.trial
        tr._wait(self.host.timeout(), what)
        try:
            r = tr.conn.recv_bytes()
        except (EOFError, OSError):
            tr.exited()
            raise tr._fail("crashed", f"the candidate's process died during {what} ({tr.dead or 'no reply'})") \
                from None
        if r != b"K":
            err = pickle.loads(r[1:]) if r[:1] == b"E" else {"type": "ProtocolError", "message": repr(r[:40])}
            self.closed = True
            tr.host.core.trial_lost(tr.cid, "the candidate raised during timing")
            tr.kill()
            if err.get("check"):
                raise BenchCheckFailed(err["message"])
            raise CandidateRaised(err.get("type", "Exception"), err.get("message", ""), err.get("traceback", ""),
                                  bool(err.get("memory")))

    def __call__(self, *args):
        j = self.index.get(tuple(map(id, args)))
        if j is None:
            raise EngineError("bench: called with inputs it was not opened with")
        self.trial.conn.send_bytes(struct.pack("<i", j))
        self._answer("a timed call")
        return self.slots

    def ping(self) -> None:
        self.trial.conn.send_bytes(struct.pack("<i", _PING))
        self._answer("a timing round trip")

    def state_out(self) -> None:
        """The trial's cache writes of the last call, into the worker's cache (for a sampled check)."""
        self.host.state_out(self.trial)

    def close(self) -> None:
        if not self.closed and self.trial.dead is None:
            self.closed = True
            self.trial.conn.send_bytes(struct.pack("<i", _END))
            self._answer("the end of timing")
        self.arena.close()


class BenchCheckFailed(Exception):
    """The trial's outputs in the timed loop do not have the reference's shapes."""


# ------------------------------------------------------------------------------------ the trial's side
def _child(host: TrialHost, trial: Trial, sock: socket.socket) -> None:
    cid = trial.cid
    procs.set_parent_death_signal(signal.SIGKILL, parent=host.parent)
    os.setpgid(0, 0)
    procs.set_name(f"tkcc-trial-{cid}"[:15])
    os.dup2(2, 1)  # a candidate's prints go to the engine's log, never to its stdout protocol
    keep = {0, 1, 2, sock.fileno()}
    for fd in _open_fds():
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    for other in host.trials.values():  # their sockets were closed above: never let a finalizer close a reused fd
        other.conn._handle = None
    conn = Connection(sock.detach())
    torch.set_num_threads(host.threads)
    core = host.core
    # re-point every KV-cache tensor of every tier at the shared twin (the worker keeps its own)
    with torch.no_grad():
        ptrs = {s.untyped_storage().data_ptr(): tw for s, tw in zip(host._state, trial.twins)}
        roots = []
        for p in core.programs.values():
            roots += [p.state, p.eager, *p.graphs.values()]
        for t in _tensors_on(roots, set(ptrs)):
            tw = ptrs[t.untyped_storage().data_ptr()]
            t.set_(tw.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    bank = getattr(core, "refbank", None)
    if bank is not None:
        bank.wipe()  # the worker's kept reference results: not for a candidate's process to find
    _send(conn, {"ok": True, "result": {"pid": os.getpid(), "private_bytes": procs.private_bytes(os.getpid())}})
    _serve(core, cid, conn)


def _open_fds() -> list[int]:
    try:
        return [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))


def _error(e: BaseException, refused: bool = False) -> dict:
    text = f"{type(e).__name__} {e}".lower()
    memory = isinstance(e, MemoryError) or "outofmemory" in text or "out of memory" in text \
        or "can't allocate memory" in text
    return {"type": type(e).__name__, "message": str(e) or type(e).__name__, "refused": refused,
            "memory": memory, "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]}


def _serve(core, cid: str, conn: Connection) -> None:
    from tkcc.runtime import candidates as cands

    state = {"cand": None, "last": {}}
    while True:
        try:
            msg = _recv(conn)
        except (EOFError, OSError):
            os._exit(0)
        _handle(core, cid, conn, msg, state)


def _handle(core, cid: str, conn: Connection, msg: dict, state: dict) -> None:
    """One operation of the worker's (see the module docstring); the answer goes back on ``conn``."""
    from tkcc.runtime import candidates as cands
    from tkcc.runtime.validation import poison, tensors_of

    op = msg.get("op")
    try:
        if op == "exit":
            os._exit(0)
        cand = state["cand"]
        if op == "build":
            if cand is None:
                cand = state["cand"] = cands.Candidate(cid, msg["kind"], msg["spec"])
            tier = msg["tier"]
            if tier not in cand.forwards:
                cands.build_for_tier(cand, tier, core.programs, core.work_dir, core.max_bytes)
            res = {"exact": cand.exact, "compile_s": cand.compile_s.get(tier, 0.0), "info": cand.info.get(tier, {}),
                   "phases": sorted(cand.forwards[tier])}
        elif op == "call":
            fwd = cand.forwards[msg["tier"]][msg["phase"]]
            key = (msg["tier"], msg["phase"])
            prev = state["last"].pop(key, [])
            poison(prev, torch.device("cpu"), sum(t.numel() * t.element_size() for t in prev))
            del prev
            args = _dec(msg["args"])
            with torch.no_grad():
                out = fwd(*args)
            state["last"][key] = tensors_of(out)
            res = {"outputs": _enc(out), "args": _enc(args)}  # the forward's own structure, by value
        elif op == "bench_open":
            fd = reduction.recv_handle(conn)
            _bench(cand.forwards[msg["tier"]][msg["phase"]], msg, fd, conn, core, cid, state)
            return
        else:
            raise EngineError(f"unknown trial operation {op!r}")
        _send(conn, {"ok": True, "result": res})
    except TkccError as e:
        _send(conn, {"ok": False, "error": _error(e, refused=True)})
    except BaseException as e:  # noqa: BLE001 - the candidate's failure, reported; the worker ends us
        _send(conn, {"ok": False, "error": _error(e)})


def _bench(fn, msg: dict, fd: int, conn: Connection, core, cid: str, state: dict) -> None:
    """The timed loop (trial side): run the named input set, copy the outputs into the arena, answer. A frame
    that is not a 4-byte index is an ordinary operation (the baseline's trial is also the reference: the
    worker's sampled checks call it while it is being timed)."""
    from tkcc.runtime.validation import tensors_of

    arena = Arena.attach(fd, msg["size"])
    views = iter([arena.tensor(off, shape, getattr(torch, dt)) for off, shape, dt in msg["inputs"]])
    sets = [tuple(next(views) if k == "t" else k[1] for k in row) for row in msg["sets"]]
    slots = [arena.tensor(off, shape, getattr(torch, dt)) for off, shape, dt in msg["outputs"]]
    conn.send_bytes(b"K")
    with torch.no_grad():
        while True:
            try:
                frame = conn.recv_bytes()
            except (EOFError, OSError):
                os._exit(0)
            if len(frame) != 4:
                _handle(core, cid, conn, pickle.loads(frame), state)
                continue
            (j,) = struct.unpack("<i", frame)
            if j == _END:
                break
            if j == _PING:
                conn.send_bytes(b"K")
                continue
            try:
                outs = tensors_of(fn(*sets[j]))
                if len(outs) != len(slots):
                    raise _Mismatch(f"{len(outs)} output tensors, the reference has {len(slots)}")
                for i, (s, o) in enumerate(zip(slots, outs)):
                    if s.shape != o.shape or s.dtype != o.dtype:
                        raise _Mismatch(f"output {i}: shape/dtype {tuple(o.shape)}/{o.dtype}, reference "
                                        f"{tuple(s.shape)}/{s.dtype}")
                    s.copy_(o)
            except _Mismatch as e:
                conn.send_bytes(b"E" + pickle.dumps({"check": True, "message": str(e)}))
                continue
            except BaseException as e:  # noqa: BLE001
                conn.send_bytes(b"E" + pickle.dumps(_error(e)))
                continue
            conn.send_bytes(b"K")
    del sets, slots, views
    try:
        arena.mm.close()
    except BufferError:
        pass  # views still alive: the mapping goes with the process
    os.close(fd)
    conn.send_bytes(b"K")


class _Mismatch(Exception):
    pass


