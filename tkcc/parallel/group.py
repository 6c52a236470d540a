"""A persistent group of ranks that run the same operations in lockstep; rank 0 answers for the group.

``tkcc serve --tp N`` needs N engine workers that live as long as the engine
and execute every operation together (a sharded candidate's graph calls
collectives, so all ranks must run it at once). ``RankGroup`` gives that:

- the calling process is rank 0 (the engine worker that owns the RPC side);
- ranks 1..N-1 are child processes (``spawn``) that build their own worker
  object with ``make_worker(rank, world)`` and then follow rank 0;
- ``group.call(op, **params)`` broadcasts (op, params) to the followers over
  a gloo control group, runs ``worker.op_<op>(**params)`` locally, gathers
  every follower's outcome and returns rank 0's result. Any follower that
  raised is reported as ``RankError`` naming the rank.
- ``group.call_all(op, **params)`` does the same but returns every rank's
  outcome (result or error), so the caller can merge per-rank verdicts and
  tell "every rank refused" from "the ranks disagree" (the engine does).

Failure handling: before each call the followers' processes are checked; a
dead follower, or a control message not answered within ``timeout_s``
(a hung rank), raises ``RankError``, after which the group is closed: every
follower is terminated and killed by its own pid, the process groups are
destroyed. Followers also exit when rank 0 dies (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback

from tkcc.parallel.launch import NO_MULTICAST_ENV, RankError, check_world, default_backend, init_rank, teardown


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def _follower_main(rank, world, store_path, backend, make_worker, timeout_s):
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(NO_MULTICAST_ENV)
    import torch.distributed as dist

    init_rank(rank, world, store_path, backend, timeout_s)
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        worker, err = make_worker(rank, world), None
    except BaseException as e:  # noqa: BLE001 - reported to rank 0 on the first call
        worker, err = None, _describe(e)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        op, params, full = (*box[0], False)[:3]
        if op == "__exit__":
            break
        result, info = None, None
        if err is None:
            try:
                result = getattr(worker, f"op_{op}")(**params)
                status = None
            except BaseException as e:  # noqa: BLE001
                status, info = _describe(e), _error_info(e)
        else:
            status = f"worker did not start: {err}"
            info = {"type": "RankStartError", "message": status.splitlines()[0], "tkcc": False,
                    "traceback": status, "start": True}
        if full:  # call_all: the whole outcome (the result must pickle)
            reply = {"ok": True, "result": result} if status is None else {"ok": False, "error": info}
        else:
            reply = status
        dist.gather_object(reply, None, dst=0, group=ctrl)
    dist.destroy_process_group()
    os._exit(0)


def _describe(e: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-4:])
    return f"{type(e).__name__}: {e}\n{tb}"[-4000:]


def _error_info(e: BaseException) -> dict:
    from tkcc.errors import TkccError

    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])[-4000:]
    return {"type": type(e).__name__, "message": str(e) or type(e).__name__, "tkcc": isinstance(e, TkccError),
            "traceback": tb}


class RankGroup:
    """Rank 0 here, ranks 1..world-1 in child processes; see the module docstring."""

    def __init__(self, world: int, make_worker, backend: str | None = None, timeout_s: float = 300.0):
        import torch.distributed as dist

        self.world, self.backend, self.timeout_s = world, backend or default_backend(), timeout_s
        check_world(world, self.backend)
        self._tmp = tempfile.mkdtemp(prefix="tkcc-group-")
        store = os.path.join(self._tmp, "store")
        ctx = mp.get_context("spawn")
        self.procs = []
        os.environ.update(NO_MULTICAST_ENV)
        for r in range(1, world):
            p = ctx.Process(target=_follower_main, args=(r, world, store, self.backend, make_worker, timeout_s),
                            name=f"tkcc-rank{r}", daemon=True)
            p.start()
            self.procs.append(p)
        self.closed = False
        try:
            init_rank(0, world, store, self.backend, timeout_s)
            self.ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            self.worker = make_worker(0, world)
        except BaseException:
            self.close(graceful=False)
            raise

    @property
    def pids(self) -> list[int]:
        return [os.getpid()] + [p.pid for p in self.procs]

    def _check_alive(self, grace_s: float = 0.0) -> None:
        """RankError if a follower has exited. ``grace_s``: after a transport error, give a rank that is dying
        (killed, its sockets already closed) that long to be reaped, so the error names the death."""
        deadline = time.monotonic() + grace_s
        while grace_s and all(p.exitcode is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                from tkcc.parallel.launch import _exit_name

                self.close(graceful=False)
                raise RankError(f"rank {r} of {self.world} died ({_exit_name(p.exitcode)}); the group was torn down",
                                r, "died")

    def call(self, op: str, **params):
        """Run ``op_<op>(**params)`` on every rank; rank 0's result, or RankError."""
        local_err, result, statuses = self._exchange(op, params, False)
        for r, st in enumerate(statuses[1:], start=1):
            if st is not None:
                raise RankError(f"rank {r} of {self.world} failed in {op!r}: {st.splitlines()[0]}", r, "error", st)
        if local_err is not None:
            raise local_err
        return result

    def call_all(self, op: str, **params) -> list[dict]:
        """Run ``op_<op>(**params)`` on every rank; every rank's outcome, by rank.

        Each outcome is ``{"ok": True, "result": ...}`` or ``{"ok": False,
        "error": {...}}``; rank 0's error also carries the exception itself
        (``"exception"``), the followers' carry type, message, ``tkcc`` (a
        TkccError: bad input, not a candidate's failure) and traceback. A dead
        or silent rank is still a RankError, after which the group is closed.
        """
        local_err, result, replies = self._exchange(op, params, True)
        if local_err is None:
            first = {"ok": True, "result": result}
        else:
            first = {"ok": False, "error": {**_error_info(local_err), "exception": local_err}}
        return [first] + list(replies[1:])

    def _exchange(self, op: str, params: dict, full: bool):
        import torch.distributed as dist

        if self.closed:
            raise RankError(f"the rank group is closed; cannot run {op!r}", None, "closed")
        self._check_alive()
        try:
            dist.broadcast_object_list([(op, params, full)], src=0, group=self.ctrl)
        except Exception as e:
            self._check_alive(3.0)  # a rank that died just now: say so, rather than what the transport saw
            self.close(graceful=False)
            raise RankError(f"could not send {op!r} to the ranks ({type(e).__name__}: {e}); group torn down",
                            None, "error") from e
        local_err = None
        try:
            result = getattr(self.worker, f"op_{op}")(**params)
        except BaseException as e:  # noqa: BLE001
            local_err, result = e, None
        replies = [None] * self.world
        try:
            dist.gather_object(None, replies, dst=0, group=self.ctrl)
        except Exception as e:
            self._check_alive(3.0)
            self.close(graceful=False)
            raise RankError(f"ranks did not answer {op!r} within {self.timeout_s:.0f} s ({type(e).__name__}); "
                            "group torn down", None, "timeout") from e
        return local_err, result, replies

    def close(self, graceful: bool = True) -> None:
        """Stop every follower (asking first when ``graceful``), destroy the groups, reap the processes."""
        if self.closed:
            return
        self.closed = True
        import torch.distributed as dist

        if graceful and all(p.exitcode is None for p in self.procs):
            try:
                dist.broadcast_object_list([("__exit__", {})], src=0, group=self.ctrl)
                for p in self.procs:
                    p.join(timeout=10)
            except Exception:  # noqa: BLE001 - fall through to terminate
                pass
        teardown(self.procs)
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        import shutil

        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(graceful=exc[0] is None)
