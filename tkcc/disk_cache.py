"""Facts remembered per machine in ``$TKCC_CACHE_DIR`` (default ``~/.cache/tkcc``): small JSON files of
computed values keyed by everything they depend on, so that no process pays twice for what another already
found. A file that cannot be read counts as empty and is rewritten, never trusted in part; a write is atomic
(a reader sees the old file or the new one) and merges what other processes wrote meanwhile."""
from __future__ import annotations

import json
import os
import tempfile


def root() -> str:
    return os.environ.get("TKCC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tkcc")


def path(name: str) -> str:
    return os.path.join(root(), name)


def read(file: str) -> dict:
    """The JSON object in ``file``, or {} when it is missing or unreadable."""
    try:
        with open(file) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def merge(file: str, entries: dict, prune=None) -> None:
    """Add ``entries`` to the object in ``file`` (atomically; a read-only home loses them, nothing else).
    ``prune(merged) -> kept``: what of the merged object to write (``entries`` are always kept)."""
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        merged = {**read(file), **entries}
        if prune is not None:
            merged = {**prune(merged), **entries}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), prefix=f".{os.path.basename(file)}-")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, sort_keys=True)
        os.replace(tmp, file)
    except OSError:
        pass  # recomputed next time, nothing is wrong
