"""Scratch folders: where an in-process compile keeps the artifact it loaded, removed when the process exits.

The loaded forward is imported from files in the folder, so it stays while the
process runs; at exit it goes (set ``TKCC_KEEP_TEMP=1`` to keep it, e.g. to
read the generated source after a crash). A compile given ``out_dir`` writes
there instead and leaves no scratch folder.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path


def keep_temp() -> bool:
    return os.environ.get("TKCC_KEEP_TEMP", "") not in ("", "0")


def scratch_dir(prefix: str) -> Path:
    """A new temporary folder, removed at interpreter exit unless ``TKCC_KEEP_TEMP`` is set."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if not keep_temp():
        atexit.register(shutil.rmtree, path, True)
    return path
