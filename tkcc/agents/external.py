"""External coding-agent proposer: give an agent the raw material and one goal.

tkcc prepares a workspace holding the generated forward source and kernels of
the starting candidate for each tier the engine measures on (``artifact/fast/``,
``artifact/slow/``), where the engine source lives, the measurements so far
(``measurements.json``: every outcome of the campaign and the engine's recent
experiment records), and ``GOAL.md`` with one sentence. It runs the configured
command there with a time limit, then takes back either a ``plan.json`` (a
pass plan) or the edited ``artifact/`` source. Edited artifacts are sealed
again (every file's SHA-256 and the artifact hash recomputed, ``edited_from``
naming the artifact it started from), so the engine opens, binds, validates
and measures them like any other artifact, each tier its own. By default the
agent gets the goal alone; an optional notes file adds guidance, so the two
styles can be compared (curated strategy measurably narrows what agents find).
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

# the tkcc package folder, which the agent is pointed at (CONTEXT.json) to read the engine's source
_TKCC_SOURCE = Path(__file__).parent.parent

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
                 base_artifact: Path | None = None, measurements: list[dict] | None = None,
                 base_artifacts: dict[str, Path] | None = None, engine_records=None):
        if not command or not command.strip():
            raise TkccError("external proposer: the agent command is empty")
        exe = shlex.split(command)[0]
        if shutil.which(exe) is None and not Path(exe).exists():
            raise TkccError(f"external proposer: command {exe!r} not found on PATH")
        if notes is not None and not Path(notes).is_file():
            raise TkccError(f"external proposer: notes file {notes} does not exist")
        self.command, self.workdir, self.time_limit_s = command, Path(workdir), time_limit_s
        self.notes, self.base_artifact, self.measurements = notes, base_artifact, measurements or []
        # per tier: the artifact the agent starts from (artifact/<tier>/); base_artifact alone: one, at artifact/
        self.base_artifacts = {t: Path(p) for t, p in (base_artifacts or {}).items()}
        self.engine_records = engine_records  # () -> the engine's recent experiment records, or None
        self.history: list = []
        self.rounds = 0

    def prepare(self) -> Path:
        """Lay out a fresh workspace; returns its path."""
        ws = self.workdir / f"round-{self.rounds:03d}"
        if ws.exists():
            shutil.rmtree(ws)
        ws.mkdir(parents=True)
        if self.base_artifacts:
            for tier, path in self.base_artifacts.items():
                shutil.copytree(path, ws / "artifact" / tier, ignore=shutil.ignore_patterns("__pycache__"))
        elif self.base_artifact is not None:
            shutil.copytree(self.base_artifact, ws / "artifact", ignore=shutil.ignore_patterns("__pycache__"))
        goal = GOAL + "\n"
        if self.notes is not None:
            goal += "\n" + Path(self.notes).read_text()
        (ws / "GOAL.md").write_text(goal)
        outcomes = [{"plan": o.plan.to_json(), "tier": o.tier, "objective": o.objective} for o in self.history]
        records = []
        if self.engine_records is not None:
            try:
                records = self.engine_records()
            except TkccError as e:
                records = [{"error": f"the engine's records could not be read: {e}"}]
        (ws / "measurements.json").write_text(json.dumps({"outcomes": outcomes, "given": self.measurements[-50:],
                                                          "engine_experiments": records}, indent=1, default=str))
        tiers = sorted(self.base_artifacts)
        (ws / "CONTEXT.json").write_text(json.dumps({
            "engine_source": str(_TKCC_SOURCE / "runtime"),
            "tkcc_source": str(_TKCC_SOURCE),
            "artifact": {t: f"artifact/{t}/" for t in tiers} if tiers else ("artifact/" if self.base_artifact else None),
            "return": "edit the files under artifact/ in place, or write plan.json (a JSON list of {name, params})",
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
        """Take back plan.json or the edited artifact; anything else is an error naming what was found."""
        plan_file = ws / "plan.json"
        if plan_file.exists():
            try:
                plan = PassPlan.from_json(plan_file.read_text())
            except PlanError as e:
                raise TkccError(f"external proposer returned a bad {plan_file}: {e}") from e
            return [Candidate(self.name, plan, note=f"agent round {self.rounds}")]
        art = ws / "artifact"
        if self.base_artifacts and art.is_dir():
            edited = [t for t, base in self.base_artifacts.items()
                      if not (art / t).is_dir() or source_hash(art / t) != source_hash(base)]
            if not edited:
                raise TkccError(f"external proposer changed nothing in {art} and wrote no plan.json")
            sealed = ws / "sealed"
            for tier, base in self.base_artifacts.items():
                if not (art / tier).is_dir():
                    raise TkccError(f"external proposer removed {art / tier}; edit the files in it instead")
                reseal(art / tier, sealed / tier, edited_from=_manifest(base).get("artifact_hash"))
            return [Candidate(self.name, artifact_dir=sealed,
                              note=f"agent round {self.rounds}: edited {', '.join(sorted(edited))}")]
        if self.base_artifact is not None and art.is_dir():
            if source_hash(art) == source_hash(self.base_artifact):
                raise TkccError(f"external proposer changed nothing in {art} and wrote no plan.json")
            return [Candidate(self.name, artifact_dir=art, note=f"agent round {self.rounds}")]
        raise TkccError(f"external proposer left neither {plan_file.name} nor a modified artifact/ in {ws}")

    def propose(self, n: int, history: list[Outcome]) -> list[Candidate]:
        self.history = [h for h in history if not getattr(h, "pending", False)]  # measured ones only
        ws = self.prepare()
        self.rounds += 1
        self.run(ws)
        return self.collect(ws)[:n]


def _manifest(directory: Path) -> dict:
    from tkcc.codegen.artifact import MANIFEST

    path = Path(directory) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TkccError(f"{path}: not a readable artifact manifest ({e})") from None


def reseal(src: Path, out: Path, edited_from: str | None = None) -> Path:
    """Write ``src`` (an artifact folder whose files were edited) to ``out`` with a manifest that matches them.

    Every file's SHA-256 and the artifact hash are recomputed, and ``edited_from`` records the artifact it
    started from; ``Artifact.open`` then verifies the edited bytes like any build's. The rest of the
    manifest (fingerprint, tier, phases, bindings) is kept: the engine still checks it against its model.
    """
    from tkcc.codegen.artifact import MANIFEST, artifact_hash

    src, out = Path(src), Path(out)
    manifest = _manifest(src)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("phases"), dict):
        raise TkccError(f"{src / MANIFEST}: the manifest has no phases; it must stay as the build wrote it")
    files = {}
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src).as_posix()
        if p.is_file() and rel != MANIFEST and "__pycache__" not in p.parts:
            files[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    missing = [m["module"] for m in manifest["phases"].values() if m.get("module") not in files]
    if missing:
        raise TkccError(f"{src}: the forward module(s) {missing} named by the manifest are gone")
    manifest["files"] = files
    if edited_from:
        manifest["edited_from"] = edited_from
    manifest["artifact_hash"] = artifact_hash(manifest)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", MANIFEST))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return out


def agent_for_engine(client, command: str, workdir: Path, *, notes=None, time_limit_s: float = 1800,
                     plan=None) -> ExternalAgent:
    """An ExternalAgent starting from ``plan`` (default: tkcc compile's default plan) as the engine builds it on
    every tier, with the engine's own experiment records as its measurements."""
    if plan is None:
        from tkcc.passes.default_plan import default_plan

        plan = default_plan()
    built = client.load({"plan": plan.to_json()}, tiers="both")
    workdir = Path(workdir)
    arts = {}
    for tier, rec in sorted(built.items()):
        info = (rec or {}).get("info") or {}
        if not info.get("artifact"):
            raise TkccError(f"external proposer: the engine built the starting plan for the {tier} tier without "
                            f"an artifact to edit ({info.get('codegen') or 'no generated source'})")
        base = workdir / "base" / tier  # a copy: the engine's build folder is its own to replace
        if base.exists():
            shutil.rmtree(base)
        shutil.copytree(info["artifact"], base, ignore=shutil.ignore_patterns("__pycache__"))
        arts[tier] = base
    cid = next(iter(built.values()))["candidate"]
    try:
        client.call("unload", candidate=cid)
    except TkccError:
        pass  # still serving somewhere: it stays loaded, nothing else changes
    return ExternalAgent(command, workdir, time_limit_s=time_limit_s, notes=Path(notes) if notes else None,
                         base_artifacts=arts,
                         engine_records=lambda: client.call("results", kind="experiment", limit=50)["records"])
