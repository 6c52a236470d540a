"""Launching engines for the tests: a module of its own (not conftest), so test files can import it by a
name no other test folder uses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCKS_MODEL = os.path.join(HERE, "blocks_model.py") + ":make_program"


# a source candidate whose forward is one statement block ``body`` over the baseline graph ``base`` and input x
WRAP = """
import torch
def build(program):
    base = program.graphs["forward"]
    def forward(x):
        {body}
    return {{"forward": forward}}
"""


class RunningEngine:
    def __init__(self, proc, ready: dict, socket_path: str, tmp):
        self.proc, self.ready, self.socket, self.tmp = proc, ready, socket_path, tmp

    def client(self, **kw):
        from tkcc.runtime import EngineClient

        return EngineClient(socket_path=self.socket, **kw)

    def source(self, name: str, body: str) -> str:
        """Write a source candidate (a file defining build(program)) and return its path."""
        path = os.path.join(str(self.tmp), f"{name}.py")
        with open(path, "w") as f:
            f.write(textwrap.dedent(body))
        return path

    def forward_source(self, name: str, body: str) -> str:
        """A source candidate whose forward(x) is ``body`` (see WRAP)."""
        return self.source(name, WRAP.format(body=body))


def launch_engine(tmp, model: str, *extra: str):
    """Start ``tkcc serve`` in the background; ``ready_engine`` waits for it."""
    sock = os.path.join(str(tmp), "engine.sock")
    cmd = [sys.executable, "-m", "tkcc.cli", "serve", "--model", model, "--device", "cpu", "--socket", sock,
           "--json", *extra]
    err = open(os.path.join(str(tmp), "engine.stderr"), "w")  # a file, not a pipe nobody drains
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                            cwd=os.path.dirname(os.path.dirname(HERE)))
    err.close()
    return proc, sock, tmp


def ready_engine(launched, timeout: float = 600) -> RunningEngine:
    proc, sock, tmp = launched
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout)
        with open(os.path.join(str(tmp), "engine.stderr")) as f:
            raise RuntimeError(f"engine did not start: {f.read()[-3000:]}")
    return RunningEngine(proc, json.loads(line), sock, tmp)


def start_engine(tmp, model: str, *extra: str) -> RunningEngine:
    return ready_engine(launch_engine(tmp, model, *extra))


def stop_engine(eng: RunningEngine) -> None:
    try:
        with eng.client() as c:
            c.shutdown()
        eng.proc.wait(60)
    except Exception:  # noqa: BLE001 - the engine may already be gone; never leave it running
        eng.proc.kill()
        eng.proc.wait(30)


BLOCKS_ARGS = ("--timeout", "60", "--worker-max-rss", "1.5", "--threads", "1", "--max-artifact-bytes", str(1 << 20))
LLM_ARGS = ("--max-cache-len", "128", "--threads", "1", "--timeout", "120")
