"""Which tree a benchmark measured: ``TKCC_COMMIT`` when it is set, else git's HEAD of this checkout.

A device machine runs a copy of the working tree whose ``.git`` may be older than the tree: on 2026-12-03 the
H200's copies reported f706d50 for trees that were 7940d6b and 131c76d. The command sent there names the tree
with ``TKCC_COMMIT=<sha>``.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit(short: bool = True) -> str:
    named = os.environ.get("TKCC_COMMIT", "").strip()
    if named:
        return named
    try:
        args = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
        return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_result(res: dict, out: str, started: float) -> None:
    """Stamp ``res`` with the tree, torch and the command that measured it and its wall time, then write it as JSON to
    ``out`` (a probe's one raw file)."""
    import json
    import sys
    import time

    import torch

    res["measured_on"] = {"commit": commit(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    res["wall_s"] = round(time.time() - started, 1)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
