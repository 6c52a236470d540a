"""The ops each rewrite's pattern traces to, remembered on disk, so that a rewrite whose ops a graph lacks is
skipped without tracing its pattern.

A pattern matches only where every op of its trace stands in the graph (``SubgraphMatcher`` maps each of its
calls to a call of the same target), so a graph without one of those ops holds no match. Tracing a pattern is
a ``torch.export`` on meta tensors, tens of milliseconds each; lowering traces every registered pattern once
per dtype in each process, and on a tiny model that was most of a fresh process's lowering (gpt-oss-tiny,
fp32: 109 of 134 patterns' ops were not all in the graph). Test subprocesses, engine workers that build a
lowered candidate and a user's first ``tkcc.compile`` each paid it again.

The op set of a pattern depends on its code, its example and torch, so its key holds the rewrite's name, the
dtype, torch's version and a digest of the files that define the pattern, its example and the tracing (this
package and ``tkcc.frontend.export``). A pattern whose source cannot be read is traced every time, never
looked up. Kept in ``$TKCC_CACHE_DIR/pattern_ops.json`` (``tkcc.disk_cache``).

What a process traces is written once, when its lowering ends (``flush``), not at each trace: a write rewrites
the whole store, and a store grown over many versions of the code (every edit of this package changes every key)
made each of a lowering's ~140 writes cost half a second. A store past ``MAX_ENTRIES`` keeps only the keys this
process used, so the op sets of code no longer run are dropped.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import threading
from pathlib import Path

import torch

from tkcc import disk_cache

FILE = "pattern_ops.json"
MAX_ENTRIES = 4096
_LOCK = threading.Lock()
_MEMO: dict[str, list] = {}
_PENDING: dict[str, list] = {}
_USED: set[str] = set()
_LOADED: set[str] = set()
_DIGESTS: dict[str, str] = {}
_KEYS: dict[tuple, str | None] = {}


def op_name(target) -> str:
    """A call's target as text: ``aten.mm.default``, ``tkcc.gemv.default``, ``_operator.getitem``."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def graph_ops(graph: torch.fx.Graph) -> set[str]:
    return {op_name(n.target) for n in graph.nodes if n.op == "call_function"}


def _file_digest(path: str) -> str:
    hit = _DIGESTS.get(path)
    if hit is None:
        hit = _DIGESTS[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return hit


@functools.cache
def _tracing_files() -> tuple[str, ...]:
    from tkcc.frontend import export

    here = Path(__file__).resolve().parent
    return tuple(str(p) for p in sorted(here.glob("*.py"))) + (str(Path(export.__file__).resolve()),)


def key(rewrite, dtype: torch.dtype) -> str | None:
    """The rewrite's key in the store, or None when the source of its pattern or example cannot be read."""
    memo = (id(rewrite), rewrite.name, dtype)
    if memo not in _KEYS:
        _KEYS[memo] = _key(rewrite, dtype)
    return _KEYS[memo]


def _key(rewrite, dtype: torch.dtype) -> str | None:
    files = set(_tracing_files())
    for fn in (rewrite.pattern, rewrite.example):
        try:
            files.add(str(Path(inspect.getsourcefile(inspect.unwrap(fn))).resolve()))
        except (TypeError, OSError):
            return None
    h = hashlib.sha256(f"{rewrite.name}|{dtype}|{torch.__version__}".encode())
    try:
        for f in sorted(files):
            h.update(f"{f}:{_file_digest(f)}".encode())
    except OSError:
        return None
    return h.hexdigest()[:24]


def ops(rewrite, dtype: torch.dtype) -> set[str]:
    """The ops ``rewrite``'s pattern traces to at ``dtype``: from memory, the disk store, or its trace."""
    path = disk_cache.path(FILE)
    k = key(rewrite, dtype)
    if k is not None:
        with _LOCK:
            if path not in _LOADED:
                _MEMO.update({n: v for n, v in disk_cache.read(path).items() if isinstance(v, list)})
                _LOADED.add(path)
            hit = _MEMO.get(k)
            _USED.add(k)
        if hit is not None:
            return set(hit)
    found = graph_ops(rewrite.pattern_graph(dtype)[0].graph)
    if k is not None:
        with _LOCK:
            _MEMO[k] = _PENDING[k] = sorted(found)
    return found


def flush() -> None:
    """Write the op sets traced since the last flush to the store, in one write (the lowering calls this when it
    ends; until then they serve this process from memory)."""
    with _LOCK:
        pending = dict(_PENDING)
        _PENDING.clear()
        used = set(_USED)
    if pending:
        disk_cache.merge(disk_cache.path(FILE), pending,
                         prune=lambda d: d if len(d) <= MAX_ENTRIES else {k: v for k, v in d.items() if k in used})
