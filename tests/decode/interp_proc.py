"""A test module's Triton-interpreter subprocess: started with the module, read by the module's tests.

The interpreter must be on before triton is imported, so its cases run in a child process. One per module: each
process pays its imports and the lowering's pattern traces (about ten seconds) once. Started when the module
starts, so that it runs beside the module's in-process tests (the tests that read it come last in the module).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def interp_env(**extra: str) -> dict:
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


class InterpRun:
    def __init__(self, args: list[str], **env: str):
        self.proc = subprocess.Popen([sys.executable, *args], env=interp_env(**env), cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._done = None

    def lines(self, timeout: float = 600) -> list[dict]:
        """Its JSON lines, once it exited 0 (else its stderr's tail is the failure)."""
        if self._done is None:
            try:
                out, err = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, err = self.proc.communicate()
            self._done = out, err
        out, err = self._done
        assert self.proc.returncode == 0, err[-3000:]
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def module_run(request, tests: tuple[str, ...], args: list[str], **env: str):
    """The module's run (a fixture's body), or None when none of ``tests`` is selected."""
    wanted = any(getattr(item, "module", None) is request.module and item.originalname in tests
                 for item in request.session.items)
    run = InterpRun(args, **env) if wanted else None
    yield run
    if run is not None:
        run.close()
