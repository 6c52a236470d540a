"""External coding-agent proposer: give an agent the raw material and one goal.

tkcc prepares a workspace holding the generated forward source and kernels of
the current best candidate (``artifact/``), where the engine source lives,
the recent measurements, and ``GOAL.md`` with one sentence. It runs the
configured command there with a time limit, then takes back either a
``plan.json`` (a pass plan) or the modified ``artifact/`` source, which goes
through validation like any other candidate. By default the agent gets the
goal alone; an optional notes file adds guidance, so the two styles can be
compared (curated strategy measurably narrows what agents find).
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tkcc.agents.proposer import Candidate, Outcome
from tkcc.errors import PlanError, TkccError
from tkcc.passes.plan import PassPlan

GOAL = "Make the forward pass as fast as possible without changing its outputs."


def source_hash(directory: Path) -> str:
    """Hash of every file's path and bytes under a directory (the manifest excluded)."""
    h = hashlib.sha256()
    for p in sorted(Path(directory).rglob("*")):
        if p.is_file() and p.name != "manifest.json" and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(directory)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


class ExternalAgent:
    """Proposer that runs ``command`` (a shell command line) in a prepared workspace."""

    name = "agent"

    def __init__(self, command: str, workdir: Path, *, time_limit_s: float = 1800, notes: Path | None = None,
                 base_artifact: Path | None = None, measurements: list[dict] | None = None):
        if not command or not command.strip():
            raise TkccError("external proposer: the agent command is empty")
        exe = shlex.split(command)[0]
        if shutil.which(exe) is None and not Path(exe).exists():
            raise TkccError(f"external proposer: command {exe!r} not found on PATH")
        if notes is not None and not Path(notes).is_file():
            raise TkccError(f"external proposer: notes file {notes} does not exist")
        self.command, self.workdir, self.time_limit_s = command, Path(workdir), time_limit_s
        self.notes, self.base_artifact, self.measurements = notes, base_artifact, measurements or []
        self.rounds = 0

    def prepare(self) -> Path:
        """Lay out a fresh workspace; returns its path."""
        import tkcc

        ws = self.workdir / f"round-{self.rounds:03d}"
        if ws.exists():
            shutil.rmtree(ws)
        ws.mkdir(parents=True)
        if self.base_artifact is not None:
            shutil.copytree(self.base_artifact, ws / "artifact")
        goal = GOAL + "\n"
        if self.notes is not None:
            goal += "\n" + Path(self.notes).read_text()
        (ws / "GOAL.md").write_text(goal)
        (ws / "measurements.json").write_text(json.dumps(self.measurements[-50:], indent=1, default=str))
        (ws / "CONTEXT.json").write_text(json.dumps({
            "engine_source": str(Path(tkcc.__file__).parent / "runtime"),
            "tkcc_source": str(Path(tkcc.__file__).parent),
            "artifact": "artifact/" if self.base_artifact else None,
            "return": "edit artifact/ in place, or write plan.json (a JSON list of {name, params})",
        }, indent=1))
        return ws

    def run(self, ws: Path) -> subprocess.CompletedProcess:
        """Run the agent command in its own process group; kill the group at the time limit."""
        start = time.monotonic()
        with open(ws / "agent.log", "wb") as log:
            proc = subprocess.Popen(self.command, shell=True, cwd=ws, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={**os.environ, "TKCC_GOAL": GOAL})
            try:
                proc.wait(timeout=self.time_limit_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise TkccError(f"external proposer: {self.command!r} ran past its {self.time_limit_s:.0f} s limit "
                                f"(log: {ws / 'agent.log'})") from None
        if proc.returncode != 0:
            tail = (ws / "agent.log").read_text(errors="replace")[-2000:]
            raise TkccError(f"external proposer: {self.command!r} exited with {proc.returncode} after "
                            f"{time.monotonic() - start:.1f} s; log tail:\n{tail}")
        return proc

    def collect(self, ws: Path) -> list[Candidate]:
        """Take back plan.json or the modified artifact; anything else is an error naming what was found."""
        plan_file = ws / "plan.json"
        if plan_file.exists():
            try:
                plan = PassPlan.from_json(plan_file.read_text())
            except PlanError as e:
                raise TkccError(f"external proposer returned a bad {plan_file}: {e}") from e
            return [Candidate(self.name, plan, note=f"agent round {self.rounds}")]
        art = ws / "artifact"
        if self.base_artifact is not None and art.is_dir():
            if source_hash(art) == source_hash(self.base_artifact):
                raise TkccError(f"external proposer changed nothing in {art} and wrote no plan.json")
            return [Candidate(self.name, artifact_dir=art, note=f"agent round {self.rounds}")]
        raise TkccError(f"external proposer left neither {plan_file.name} nor a modified artifact/ in {ws}")

    def propose(self, n: int, history: list[Outcome]) -> list[Candidate]:
        ws = self.prepare()
        self.rounds += 1
        self.run(ws)
        return self.collect(ws)[:n]
