"""The engine's worker process: holds the model and runs candidates, one operation at a time.

It is a child of the supervisor (``tkcc.runtime.supervisor``), started with
the ``spawn`` method (CUDA-safe), talking over a pipe. A candidate that
raises costs that request only; one that leaves the device unusable (an
illegal memory access corrupts the CUDA context) or changes the resident
weights makes the worker answer with ``fatal`` and exit, and the supervisor
starts a fresh one. The worker dies with its supervisor (see _die_with_parent).

With ``tkcc serve --tp N`` (``cfg["tp"] > 1``) the worker is rank 0 of a
``RankGroup``: ranks 1..N-1 are its children, each with its own
``TPEngineCore`` (``tkcc.runtime.tp``), and every operation runs on all
ranks at once (``_Ranks``). A rank that dies, hangs or ends up in another
state than rank 0 costs the whole group: the worker exits and the
supervisor starts a fresh one, as after any fatal failure.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback


def _die_with_parent() -> None:
    """Exit when the supervisor is gone (re-parented), even mid-operation.

    Not PR_SET_PDEATHSIG: that fires when the *thread* that started the worker
    exits, and the supervisor starts replacements from short-lived RPC threads.
    """
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="tkcc-parent-watch", daemon=True).start()


def _error(e: BaseException, candidate_failure: bool) -> dict:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    out = {"type": type(e).__name__, "message": str(e) or type(e).__name__,
           "traceback": "".join(tb[-6:])[-4000:], "candidate_failure": candidate_failure}
    kind = getattr(e, "kind", None)  # a trial process that died, hung or passed its memory limit, or raised
    if isinstance(kind, str):
        out["kind"] = kind
    if isinstance(getattr(e, "pid", None), int):  # the trial process that failed
        out["pid"] = e.pid
    if getattr(e, "tb", None):  # raised in the candidate's trial process: its own traceback
        out["traceback"] = str(e.tb)[-4000:]
        out["type"] = getattr(e, "type_name", out["type"])
        out["message"] = str(e).split(": ", 1)[-1] if ": " in str(e) else out["message"]
    if getattr(e, "invalid", False):  # a sampled check of the timed calls failed
        out["invalid"] = True
    return out


def _events(runner) -> list:
    drain = getattr(runner.core, "drain_events", None)
    try:
        return drain() if drain is not None else []
    except Exception as e:  # noqa: BLE001 - never lose the reply over the events
        return [{"kind": "events_error", "reason": f"{type(e).__name__}: {e}"}]


def _set_deadline(runner, timeout_s) -> None:
    trials = getattr(runner.core, "trials", None)
    if trials is not None:
        trials.deadline = time.monotonic() + float(timeout_s) if timeout_s else None
        trials.op_timeout_s = float(timeout_s) if timeout_s else trials.timeout_s


def worker_main(conn, cfg: dict) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the worker stops
    from tkcc.errors import TkccError

    runner = None
    try:
        runner = _Ranks(cfg) if int(cfg.get("tp") or 1) > 1 else _Single(cfg)
        conn.send({"ok": True, "result": runner.run("status", {})})
    except BaseException as e:  # noqa: BLE001 - report why the worker could not start, then exit
        conn.send({"ok": False, "error": _error(e, False), "fatal": True})
        conn.close()
        if runner is not None:
            runner.close()
        os._exit(3)

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            runner.close()
            os._exit(0)
        op, params = msg.get("op"), msg.get("params") or {}
        if op == "exit":
            runner.close()
            conn.send({"ok": True, "result": {}})
            os._exit(0)
        if getattr(runner.core, f"op_{op}", None) is None:
            conn.send({"ok": False, "error": {"type": "EngineError", "message": f"unknown operation {op!r}",
                                              "candidate_failure": False}})
            continue
        _set_deadline(runner, msg.get("timeout_s"))
        try:
            result = runner.run(op, params)
            fatal = bool(isinstance(result, dict) and result.get("fatal"))
            conn.send({"ok": True, "result": result, "fatal": fatal, "events": _events(runner)})
            if fatal:
                runner.close(graceful=False)
                os._exit(71)
        except GroupLost as e:  # a rank died, hung or diverged: the group is gone, the supervisor starts another
            err = _error(e, True)
            err["kind"] = e.kind
            try:
                conn.send({"ok": False, "error": err, "fatal": True})
            finally:
                runner.close(graceful=False)
                sys.stdout.flush()
                os._exit(RANK_LOST)
        except TkccError as e:
            conn.send({"ok": False, "error": _error(e, False), "fatal": False, "events": _events(runner)})
        except BaseException as e:  # noqa: BLE001 - a candidate's failure, of any kind
            err = _error(e, True)
            note = getattr(runner, "memory_note", None)
            err["message"] += note(e) if note is not None else ""
            if isinstance(e, Tampered):
                fatal = "global state the audit cannot put back"
            elif isinstance(e, Leaked) and not e.charge.restored:
                fatal = "memory the candidate left behind cannot be freed"
            else:
                fatal = runner.unhealthy(e)
            if fatal:
                err["message"] += f" (device/weights unusable afterwards: {fatal}; the worker restarts)"
            try:
                conn.send({"ok": False, "error": err, "fatal": bool(fatal), "events": _events(runner)})
            finally:
                if fatal:
                    runner.close(graceful=False)
                    sys.stdout.flush()
                    os._exit(70)


RANK_LOST = 72  # exit status of a worker whose rank group lost a rank (the supervisor names it)


class Leaked(Exception):
    """A candidate refused before it was registered left memory behind (``tkcc.runtime.memory_ledger``)."""

    kind = "memory"

    def __init__(self, charge, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}; and candidate {charge.candidate} left memory behind: "
                         f"{charge.reason}")
        self.charge = charge


class Tampered(Exception):
    """A candidate op raised and left global state the audit cannot put back: the worker must restart."""

    kind = "tampered"

    def __init__(self, audit, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}; and the candidate changed the worker's global state: "
                         f"{'; '.join(audit.unproven + audit.restored)[:2000]}")
        self.audit = audit
SEEDED = ("validate", "swap", "revert", "measure")  # ops that draw random inputs: one seed for every rank


class GroupLost(Exception):
    """The rank group cannot go on (a rank died, timed out, or the ranks' states diverged); ``kind``: crashed|..."""

    def __init__(self, message: str, kind: str = "crashed"):
        super().__init__(message)
        self.kind = kind


# ops that run candidate code (and unload's leak check)
AUDITED = ("load", "discover", "validate", "measure", "generate", "unload")
AUDITED_CUDA = AUDITED + ("swap", "revert")  # ... and, on a GPU, the CUDA-graph capture of a swapped-in forward


class _Single:
    """One process, one EngineCore: ``run`` calls the op directly.

    In-process isolation: after every op that may have run candidate code, the worker's global state is
    audited against its start-up snapshot (``tkcc.runtime.global_state``). A change the candidate made is put
    back where it can be, and the op's result is refused (``tampered``: timed or checked under the change);
    a change that cannot be put back ends the worker (``fatal``). Memory a candidate leaves behind, host or
    device, is charged to it when it is gone (``tkcc.runtime.memory_ledger``): refused as ``memory``, and the
    worker restarts unless dropping the candidate's modules gave the memory back. A candidate loaded with
    ``serving`` (what a server serves already: a watcher's reference) opens no account: the caches its first
    load warms (compiled kernels, lazily loaded CUDA modules; an H200 watcher's lowered reference left 369 MiB
    on its first load and nothing on later ones) are the worker's, as if it had started with it."""

    def __init__(self, cfg: dict):
        from tkcc.runtime.engine import EngineCore

        self.core = EngineCore(cfg)
        self.base = None
        if self.core.isolation == "inprocess" and cfg.get("audit", True):
            from tkcc.runtime import candidates as cands
            from tkcc.runtime import global_state
            from tkcc.runtime.memory_ledger import Ledger

            _preload()  # what any candidate's build imports, imported before the snapshot
            self.base = global_state.take()
            import gc

            gc.collect()
            gc.freeze()  # start-up's objects leave the collector: the ledger's collections walk only what came since
            self.ledger = Ledger(self._measure, self._compare, cands.user_modules, cands.drop_user_modules)
            self.found = None          # what the audits of the current op found
            self.core.before_canary = self._audit  # restore first: the canary then sees only what could not be

    def _measure(self) -> dict:
        from tkcc.runtime import global_state

        budget = self.core.device_memory
        return {"host": global_state.memory_now(), "device": budget.held() if budget is not None else None}

    def _compare(self, before: dict, after: dict) -> str:
        from tkcc.runtime import global_state

        budget = self.core.device_memory
        why = [global_state.leaked(before["host"], after["host"])]
        if budget is not None and before["device"] is not None:
            why.append(budget.leak(before["device"], after["device"]))
        return "; ".join(w for w in why if w)

    def _audit(self):
        from tkcc.runtime import global_state

        a = global_state.audit(self.base)
        budget = self.core.device_memory
        if budget is not None:  # the cap against the one the engine last set (it raises it itself, mid-op)
            why = budget.restore_cap()
            if why:
                a.restored.append(why)
        if self.found is None:
            self.found = a
        else:
            self.found.restored += a.restored
            self.found.unproven += a.unproven
        return self.found

    def run(self, op: str, params: dict):
        if op == "ping":
            return self._ping()
        audited = AUDITED_CUDA if self.core.device.type == "cuda" else AUDITED
        if self.base is None or op not in audited:
            return getattr(self.core, f"op_{op}")(**params)
        cid = None
        if op in ("load", "discover"):
            from tkcc.runtime import candidates as cands

            try:
                cid = cands.candidate_id(params.get("spec"), self.core.max_bytes)
            except Exception:  # noqa: BLE001 - the op itself reports a bad spec
                cid = None
            if cid and params.get("serving"):  # it serves already: what its first load warms stays the worker's
                self.ledger.forget(cid)  # ... even when its compiles were discovered (an account opened) before
                cid = None
            elif cid and cid not in self.core.candidates:
                self.ledger.opened(cid)  # a fresh measurement: nothing before this candidate is charged to it
            else:
                cid = None
        self.found = None
        try:
            result = getattr(self.core, f"op_{op}")(**params)
        except BaseException as e:
            a = self._audit()
            if not a.clean:
                raise Tampered(a, e) from e
            if cid and cid not in self.core.candidates:  # refused before it was registered: gone already
                charge = self.ledger.charge(cid)
                if charge is not None:
                    raise Leaked(charge, e) from e
            raise
        if op == "unload":  # unloading runs no candidate code: what is left is the memory it held
            cand = params.get("candidate")
            if isinstance(result, dict) and result.get("unloaded"):
                charge = self.ledger.charge(cand)
                if charge is not None:
                    out = {**result, "leaked": f"candidate {cand}: {charge.reason}", "restored": charge.restored}
                    if not charge.restored:
                        out.update(fatal=True, reason=f"{out['leaked']} (it cannot be freed: the worker restarts)")
                    return out
            return result
        a = self._audit()
        if a.restored or a.unproven:
            why = "; ".join(a.unproven + a.restored)
            out = result if isinstance(result, dict) else {"result": result}
            out = {**out, "audit": a.to_json(), "tampered": f"the candidate changed the worker's global state: {why}"}
            if not a.clean:
                out.update(fatal=True, reason=out["tampered"] + " (not all of it can be put back: the worker restarts)")
            return out
        return result

    def _ping(self) -> dict:
        """The supervisor's idle check: the device-memory cap holds; an allocator past the limit ends the worker,
        charged to the candidates loaded (the only code that ran in it)."""
        out = self.core.op_ping()
        why = out.get("device_memory")
        if why:
            out["leaked"] = why
            if out.get("device_memory_fatal"):
                out.update(fatal=True, reason=f"{why} (the worker restarts)")
        return out

    def memory_note(self, exc: BaseException) -> str:
        """What an out-of-memory error's message should say about the engine's limit."""
        budget = self.core.device_memory
        text = f"{type(exc).__name__} {exc}".lower()
        return budget.explain_oom() if budget is not None and "out of memory" in text else ""

    def unhealthy(self, exc: BaseException) -> str:
        return _unhealthy(self.core, exc)

    def close(self, graceful: bool = True) -> None:
        if getattr(self.core, "trials", None) is not None:
            self.core.trials.close()


def _preload() -> None:
    """Import what building any candidate imports (passes, codegen, kernels, Triton), so that its first
    candidate's build finds them loaded and the audit's snapshot already holds them."""
    import importlib

    from tkcc.passes.base import all_passes

    all_passes()
    for name in ("tkcc.passes.manager", "tkcc.passes.plan", "tkcc.codegen.artifact", "tkcc.codegen.forward_source",
                 "tkcc.kernels.ops", "triton", "triton.language"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not in this build


def make_core(cfg: dict, rank: int, world: int):
    """Rank ``rank``'s engine core (module level: ``spawn`` pickles it by name for the follower ranks)."""
    from tkcc.runtime.tp import TPEngineCore

    return TPEngineCore(cfg, rank, world)


class _Ranks:
    """``tkcc serve --tp N``: this process is rank 0 of a RankGroup; every op runs on every rank.

    Outcomes are merged (``_merge``). Every rank refusing or failing alike is
    handled as one process would; ranks that disagree (one loaded a
    candidate, another did not), a dead rank or a silent one end the worker
    (``GroupLost``), and the supervisor starts a fresh group.
    """

    def __init__(self, cfg: dict):
        import functools
        import multiprocessing as mp

        from tkcc.errors import EngineError
        from tkcc.parallel.group import RankGroup

        # The supervisor starts this worker as a daemon (so it never waits for it); multiprocessing forbids a
        # daemon children, but the ranks are this worker's to reap (RankGroup.close) and die with it (PDEATHSIG).
        mp.current_process().daemon = False
        self.tp = int(cfg["tp"])
        backend = "nccl" if str(cfg["device"]).startswith("cuda") else "gloo"
        timeout = max(60.0, float(cfg.get("timeout_s") or 600.0))
        self.group = RankGroup(self.tp, functools.partial(make_core, cfg), backend=backend, timeout_s=timeout)
        self.core = self.group.worker
        self._closing = False
        try:
            outs = self.group.call_all("weights_digest")
            for r, o in enumerate(outs):
                if not o["ok"]:
                    raise EngineError(f"rank {r} of {self.tp} could not start: {o['error']['message']}")
            digests = [o["result"] for o in outs]
            if len(set(digests)) != 1:
                odd = [r for r, d in enumerate(digests) if d != digests[0]]
                raise EngineError(f"ranks {odd} built different weights than rank 0; every rank must build the same "
                                  f"model (a model factory must not draw unseeded random weights)")
            self._all("startup", {})
        except BaseException:
            self.close(graceful=False)
            raise
        threading.Thread(target=self._watch, name="tkcc-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        """A follower that exits on its own means the group is lost; end this worker so it is replaced.

        Grace first: the main thread may be about to report it itself (and
        an idle worker is ended here, so the supervisor can restart it before
        the next request).
        """
        from multiprocessing.connection import wait

        wait([p.sentinel for p in self.group.procs])
        time.sleep(2.0)
        if self._closing or self.group.closed:
            return
        dead = [r for r, p in enumerate(self.group.procs, start=1) if p.exitcode is not None]
        print(f"tkcc worker: rank(s) {dead} of the tensor-parallel group died; the worker exits to be replaced",
              file=sys.stderr, flush=True)
        os._exit(RANK_LOST)

    def _all(self, op: str, params: dict) -> list:
        from tkcc.parallel.launch import RankError

        try:
            outs = self.group.call_all(op, **params)
        except RankError as e:
            raise GroupLost(f"{e}", "timeout" if e.kind == "timeout" else "crashed") from None
        failed = [r for r, o in enumerate(outs) if not o["ok"]]
        if failed and len(failed) < len(outs):
            r = failed[0]
            err = outs[r]["error"]
            ok = [i for i in range(len(outs)) if i not in failed]
            raise GroupLost(f"the ranks disagree on {op!r}: rank {r} failed ({err['type']}: "
                            f"{err['message'].splitlines()[0]}) while rank(s) {ok} succeeded; the worker restarts so "
                            "that every rank holds the same state")
        if failed:
            raise outs[0]["error"]["exception"]  # every rank failed: as one process would
        return [o["result"] for o in outs]

    def run(self, op: str, params: dict):
        import secrets

        if op in SEEDED and params.get("seed") is None:
            params = {**params, "seed": secrets.randbits(62)}  # drawn here, after the candidate loaded
        return _merge(op, self._all(op, params))

    def unhealthy(self, exc: BaseException) -> str:
        try:
            self._all("check_health", {})
        except BaseException as e:  # noqa: BLE001 - GroupLost included: restart either way
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return ""

    def close(self, graceful: bool = True) -> None:
        self._closing = True
        self.group.close(graceful=graceful)


def _merge(op: str, results: list):
    """Rank 0's result, with what the other ranks add to it."""
    first = results[0]
    if not isinstance(first, dict):
        return first
    first = dict(first)
    if op == "status":
        first["ranks"] = [{"rank": r, "pid": res.get("pid"), "device": res.get("device"),
                           "memory": res.get("memory")} for r, res in enumerate(results)]
    elif op == "measure":  # a Measurement's fields are fixed: the other ranks' numbers go with its provenance
        first["env"] = dict(first.get("env") or {})
        first["env"]["tp_ranks"] = [{"rank": r, "objective": res.get("objective"),
                                     "median_s": {b["key"]: b.get("median_s") for b in res.get("buckets", [])}}
                                    for r, res in enumerate(results)]
        why = f"tensor parallel x{len(results)}: rank 0's clock (every rank's medians in env.tp_ranks)"
        first["note"] = "; ".join(x for x in (first.get("note"), why) if x)
    elif op == "generate":
        toks = [res.get("tokens") for res in results]
        first["ranks_agree"] = all(t == toks[0] for t in toks)
    return first


def _unhealthy(core, exc: BaseException) -> str:
    """'' if the worker can go on after ``exc``; else why not."""
    import torch

    if core.device.type == "cuda" and isinstance(exc, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
    try:
        core.op_check_health()
    except BaseException as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return ""
