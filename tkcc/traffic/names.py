"""A trace as a user names it: a file, or the name of a trace tkcc bundles (``azure-conv``, ...).

Every command that takes a trace goes through ``trace_path`` so that a
bundled name works everywhere, and a path that does not exist is answered
with the bundled names a user may have meant.
"""
from __future__ import annotations

import os
from pathlib import Path

from tkcc.errors import TraceFormatError
from tkcc.traffic.loaders import BUNDLED, bundled_trace, load_trace


def trace_path(name_or_path) -> Path:
    """The file a trace argument names; TraceFormatError listing the bundled names if there is none."""
    text = str(name_or_path)
    if text in BUNDLED and not os.path.exists(text):
        return bundled_trace(text)
    if not os.path.exists(text):
        raise TraceFormatError(f"no such file (and not a bundled trace name; bundled: {', '.join(sorted(BUNDLED))})",
                               path=text)
    return Path(text)


def load_named_trace(name_or_path, **kwargs):
    """``load_trace`` of what ``trace_path`` resolves (keyword arguments as for ``load_trace``)."""
    return load_trace(trace_path(name_or_path), **kwargs)
