"""Facts a kernel's compile tells (the shared memory one program needs), remembered on disk, found in parallel.

Whether a tile fits a device is known only by compiling the kernel for that
architecture (software pipelining decides the shared memory), and each compile
costs about a second: a search space pruned over 7 tiles x 2 head shapes spent
most of a 120 s ``tkcc.compile`` budget's start-up on an H200 doing them one by
one. A fact depends only on the kernel's source, the compiler's version and the
key, so it is computed once per machine: missing ones compile in parallel in
spawned processes (one per fact, up to the machine's cores), and every fact is
kept in ``$TKCC_CACHE_DIR/compile_facts.json`` (default ``~/.cache/tkcc``),
keyed by all three. A file that cannot be read is ignored and rewritten, never
trusted in part.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import tempfile
import threading

_LOCK = threading.Lock()
_MEMO: dict[str, int] = {}
_LOADED: set[str] = set()


def store_path() -> str:
    root = os.environ.get("TKCC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tkcc")
    return os.path.join(root, "compile_facts.json")


def source_key(*texts: str) -> str:
    """A kernel source's identity in a fact's key: its text and the compiler's version."""
    import triton

    h = hashlib.sha256(triton.__version__.encode())
    for t in texts:
        h.update(t.encode())
    return h.hexdigest()[:16]


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return {k: int(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def _save(path: str, facts: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        merged = {**_load(path), **facts}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".facts-")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the facts are recomputed next time, nothing is wrong


def facts(kind: str, source: str, keys: list[tuple], compute, parallel: bool = True) -> dict[tuple, int]:
    """{key: compute(key)} for every key, from memory, the disk store, or computed (missing ones in parallel
    processes when there are several; ``compute`` must be a module-level function)."""
    path = store_path()
    name = lambda key: f"{kind}|{source}|{json.dumps(list(key))}"  # noqa: E731
    with _LOCK:
        if path not in _LOADED:
            _MEMO.update(_load(path))
            _LOADED.add(path)
        missing = [k for k in dict.fromkeys(keys) if name(k) not in _MEMO]
    found: dict[str, int] = {}
    workers = min(len(missing), os.cpu_count() or 1)
    if parallel and workers > 1:
        ctx = multiprocessing.get_context("spawn")  # no forked CUDA context, no inherited locks
        with cf.ProcessPoolExecutor(workers, mp_context=ctx) as ex:
            for k, v in zip(missing, ex.map(compute, missing)):
                found[name(k)] = int(v)
    else:
        for k in missing:
            found[name(k)] = int(compute(k))
    with _LOCK:
        _MEMO.update(found)
    if found:
        _save(path, found)
    return {k: _MEMO[name(k)] for k in keys}
