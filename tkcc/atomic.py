"""Atomic placement of outputs: a result directory appears whole or not at all (invariant: nothing
partial is left behind as if it were valid)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from tkcc.errors import TkccError


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move the finished ``tmp`` to ``dest``, replacing an older ``dest`` without a moment where a
    half-written one is visible (the old one is renamed aside first, then removed)."""
    tmp, dest = Path(tmp), Path(dest)
    if dest.exists():
        if not dest.is_dir():
            raise TkccError(f"{dest}: exists and is not a directory")
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)
