"""The engine's worker process: holds the model and runs candidates, one operation at a time.

It is a child of the supervisor (``tkcc.runtime.supervisor``), started with
the ``spawn`` method (CUDA-safe), talking over a pipe. A candidate that
raises costs that request only; one that leaves the device unusable (an
illegal memory access corrupts the CUDA context) or changes the resident
weights makes the worker answer with ``fatal`` and exit, and the supervisor
starts a fresh one. The worker dies with its supervisor (PR_SET_PDEATHSIG).
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
    return {"type": type(e).__name__, "message": str(e) or type(e).__name__,
            "traceback": "".join(tb[-6:])[-4000:], "candidate_failure": candidate_failure}


def worker_main(conn, cfg: dict) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the worker stops
    from tkcc.errors import TkccError

    try:
        from tkcc.runtime.engine import EngineCore

        core = EngineCore(cfg)
        conn.send({"ok": True, "result": core.op_status()})
    except BaseException as e:  # noqa: BLE001 - report why the worker could not start, then exit
        conn.send({"ok": False, "error": _error(e, False), "fatal": True})
        conn.close()
        os._exit(3)

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        op, params = msg.get("op"), msg.get("params") or {}
        if op == "exit":
            conn.send({"ok": True, "result": {}})
            os._exit(0)
        fn = getattr(core, f"op_{op}", None)
        if fn is None:
            conn.send({"ok": False, "error": {"type": "EngineError", "message": f"unknown operation {op!r}",
                                              "candidate_failure": False}})
            continue
        try:
            result = fn(**params)
            fatal = bool(isinstance(result, dict) and result.get("fatal"))
            conn.send({"ok": True, "result": result, "fatal": fatal})
            if fatal:
                os._exit(71)
        except TkccError as e:
            conn.send({"ok": False, "error": _error(e, False), "fatal": False})
        except BaseException as e:  # noqa: BLE001 - a candidate's failure, of any kind
            err = _error(e, True)
            fatal = _unhealthy(core, e)
            if fatal:
                err["message"] += f" (device/weights unusable afterwards: {fatal}; the worker restarts)"
            try:
                conn.send({"ok": False, "error": err, "fatal": bool(fatal)})
            finally:
                if fatal:
                    sys.stdout.flush()
                    os._exit(70)


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
