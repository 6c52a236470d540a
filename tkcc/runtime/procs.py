"""Process plumbing the engine relies on (Linux): parent-death signals, a subreaper, and memory readings.

The supervisor imports this module, so it must not import torch.
"""
from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36

_libc = None


def _prctl(option: int, arg) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(option, arg, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):
        return False  # not Linux: the callers' polling fallbacks still apply


def set_parent_death_signal(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when the thread that created it exits.

    If ``parent`` (the pid that should be the parent) is given and is already gone, exit at once: the
    signal would never come.
    """
    ok = _prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)))
    if parent is not None and os.getppid() != parent:
        os._exit(0)
    return ok


def set_child_subreaper() -> bool:
    """Orphaned descendants (a candidate's double fork) are re-parented to this process, not to init."""
    return _prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1))


def set_name(name: str) -> None:
    """The process's short name (``comm``, 15 bytes): what ps and /proc/PID/comm show."""
    _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def status_fields(pid: int) -> dict[str, int]:
    """Sizes in bytes from /proc/PID/status (VmRSS, RssAnon, RssFile, RssShmem, VmHWM); {} if it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def rss(pid: int) -> int:
    return status_fields(pid).get("VmRSS", 0)


def private_bytes(pid: int) -> int | None:
    """Memory this process wrote itself: private dirty pages plus swap (/proc/PID/smaps_rollup).

    A forked child's RSS counts every page it shares with its parent; its private dirty pages are what it
    allocated or changed since the fork, so they are what a candidate is charged for. None if unreadable.
    """
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Private_Dirty", "Swap"):
                    total += int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    return total


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/PID/task/*/children)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out += [int(x) for x in f.read().split()]
            except OSError:
                continue
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first."""
    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            if c not in out:
                out.append(c)
                todo.append(c)
    return out


def memory_total() -> int:
    """MemTotal of this machine in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
