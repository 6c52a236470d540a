"""What Triton's JIT compiled in this process, and for how long: the compile time on the engine's critical path.

A listener on Triton's compiler (``knobs.compilation.listener``, chained to
any listener already there) counts every compile the JIT ran here and every
kernel it only loaded from the cache. ``snapshot()`` before an operation and
``since(snapshot)`` after it say what that operation cost in compiles.
"""
from __future__ import annotations

import threading

_LOCK = threading.Lock()
_TOTALS = {"compiled": 0, "compile_s": 0.0, "loaded": 0, "load_s": 0.0}
_INSTALLED = False


def _seconds(times) -> float:
    if times is None:
        return 0.0
    us = getattr(times, "ir_initialization", 0) + getattr(times, "total_lowering", 0) + getattr(times,
                                                                                                "store_results", 0)
    return us / 1e6


def install() -> None:
    """Start counting (once per process)."""
    global _INSTALLED
    from triton import knobs

    with _LOCK:
        if _INSTALLED:
            return
        previous = knobs.compilation.listener

        def listener(**kw):
            with _LOCK:
                if kw.get("cache_hit"):
                    _TOTALS["loaded"] += 1
                    _TOTALS["load_s"] += _seconds(kw.get("times"))
                else:
                    _TOTALS["compiled"] += 1
                    _TOTALS["compile_s"] += _seconds(kw.get("times"))
            if previous is not None:
                previous(**kw)

        knobs.compilation.listener = listener
        _INSTALLED = True


def snapshot() -> dict:
    with _LOCK:
        return dict(_TOTALS)


def since(before: dict) -> dict:
    now = snapshot()
    return {k: (round(now[k] - before[k], 4) if isinstance(now[k], float) else now[k] - before[k]) for k in now}
