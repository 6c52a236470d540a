"""The campaign's Evaluator backed by the persistent engine (``tkcc serve``), over its RPC.

Each measurement is one engine ``experiment`` on one tier: load (compile the
plan for that tier), validate against the engine's own reference, swap in,
re-capture graphs, measure on the workload, swap back. Shipping is the same
on the slow tier with ``keep=True``, so a candidate is validated again right
before it serves. The key a result is stored under names everything that
determines the built artifact: the candidate spec, the versions of the passes
in its plan, the tier, and the engine's model fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from tkcc.agents.campaign import EvalResult
from tkcc.agents.proposer import Candidate
from tkcc.errors import EngineError, TkccError


class EngineEvaluator:
    def __init__(self, client, workload, *, pass_modules: list[str] = (), reps: int = 30, timeout_s: float = 600):
        self.client, self.workload = client, workload
        self.pass_modules, self.reps, self.timeout_s = [str(Path(p).resolve()) for p in pass_modules], reps, timeout_s
        status = client.status()
        worker = status.get("worker") or {}
        self.model = (status.get("engine") or {}).get("model")
        env = worker.get("env") or {}
        self.device = env.get("device_name") or env.get("device") or worker.get("device")
        self.device_type = str(worker.get("device") or (status.get("engine") or {}).get("device") or "cpu")
        self.model_fp = json.dumps({"model": self.model,
                                    "fingerprint": {t: v.get("fingerprint") for t, v in (worker.get("tiers") or {}).items()},
                                    "dtype": worker.get("dtype"), "device": self.device}, sort_keys=True, default=str)
        # per tier: how the engine validates (exact, or tolerance because the model's reference is not bitwise
        # reproducible there, with the measured self-disagreement and the bound); recorded with every result
        self.validation = {t: v.get("validation") for t, v in (worker.get("tiers") or {}).items()
                           if v.get("validation")}
        self._specs: dict[str, dict] = {}
        self.artifacts: dict[str, str | None] = {}  # artifact hash -> its folder on the engine's machine

    def workload_fingerprint(self) -> str:
        return self.workload.fingerprint()

    def _spec(self, cand: Candidate) -> dict:
        if cand.artifact_dir is not None:
            folder = Path(cand.artifact_dir)
            tiers = {p.parent.name: str(p.parent.resolve()) for p in sorted(folder.glob("*/manifest.json"))}
            if tiers:  # an artifact per tier (an agent's edited, resealed forwards)
                return {"artifacts": tiers}
            if (folder / "manifest.json").exists():
                return {"artifact": str(folder.resolve())}
            src = folder / "candidate.py"
            if not src.exists():
                raise TkccError(f"agent candidate {folder}: neither artifacts (<tier>/manifest.json) nor a "
                                "candidate.py defining build(program)")
            return {"source": str(src)}
        if not cand.plan.steps:
            return {"baseline": True}
        spec = {"plan": cand.plan.to_json()}
        if self.pass_modules:
            spec["pass_modules"] = self.pass_modules
        return spec

    def build(self, cand: Candidate, tier: str) -> str:
        """Compile the candidate for a tier in the engine; returns the built artifact's hash."""
        spec = self._spec(cand)
        try:
            res = self.client.load(spec, tiers=tier)
        except EngineError as e:
            raise TkccError(f"the engine could not build {cand.key} for the {tier} tier: {e}") from None
        info = ((res or {}).get(tier) or {}).get("info") or {}
        key = info.get("artifact_hash") or info.get("hash")
        if not key and info.get("tree_sha256"):  # a source candidate: every file it can import
            key = f"{tier}-src-{info['tree_sha256'][:16]}"
        if not key:  # baseline and source candidates: no artifact; name what determines the build
            blob = json.dumps({"spec": spec, "tier": tier, "model": self.model_fp,
                               "source": hashlib.sha256(Path(spec["source"]).read_bytes()).hexdigest()
                               if "source" in spec else None}, sort_keys=True)
            key = f"{tier}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
        self._specs[key] = spec
        self.artifacts[key] = info.get("artifact")
        return key

    def _run(self, key: str, tier: str, keep: bool) -> dict:
        try:
            return self.client.experiment(self._specs[key], tiers=tier, workload=self.workload, keep=keep,
                                          reps=self.reps, timeout_s=self.timeout_s)
        except EngineError as e:
            return {"ok": False, "reason": str(e), "tiers": {tier: {"failure": "refused", "reason": str(e)}}}

    def measure(self, key: str, tier: str) -> EvalResult:
        res = self._run(key, tier, keep=False)
        rec = res.get("tiers", {}).get(tier, {})
        if not res.get("ok"):
            verdict = {"invalid": "invalid", "timeout": "timeout"}.get(rec.get("failure"), "crashed")
            if rec.get("failure") == "refused":
                verdict = "invalid"
            return EvalResult(verdict, reason=rec.get("reason") or res.get("reason"))
        m = rec["measurement"]
        if m.get("objective") is None:
            return EvalResult("invalid", reason=f"the engine measured no objective: {m.get('note', 'no reason given')}")
        m = {**m, "device": self.device, "seconds": rec.get("seconds"),
             "validation": {k: v for k, v in (rec.get("validation") or {}).items()
                            if k in ("ok", "mode", "shapes", "tolerance", "greedy", "policy")}}
        return EvalResult("measured", float(m["objective"]), m)

    def ship(self, key: str) -> None:
        res = self._run(key, "slow", keep=True)
        if not res.get("ok"):
            raise TkccError(f"shipping {key} failed re-validation: {res.get('reason')}")


def die_with_parent(parent: int | None = None):
    """A ``preexec_fn``: in the child, between fork and exec, have the kernel SIGKILL it when this process
    (``parent``, default the caller) dies; if that already happened, the child exits at once."""
    from tkcc.runtime.procs import set_parent_death_signal

    parent = os.getpid() if parent is None else parent
    return lambda: set_parent_death_signal(parent=parent)


@contextmanager
def spawned_engine(model: str, device: str = "cpu", state_dir: str | None = None, extra: tuple[str, ...] = (),
                   start_timeout_s: float = 900, env: dict | None = None):
    """Start ``tkcc serve`` for this campaign and stop it afterwards; yields a connected EngineClient.
    ``env``: variables set for the engine process only (e.g. its own TRITON_CACHE_DIR)."""
    from tkcc.runtime import EngineClient

    tmp = Path(state_dir or tempfile.mkdtemp(prefix="tkcc-campaign-engine-"))
    tmp.mkdir(parents=True, exist_ok=True)
    sock = str(tmp / "engine.sock")
    cmd = [sys.executable, "-m", "tkcc.cli", "serve", "--model", model, "--device", device, "--socket", sock,
           "--state-dir", str(tmp / "state"), "--json", *extra]
    with open(tmp / "engine.stderr", "w") as err:
        # the engine dies with this process, on SIGKILL too (the kernel's parent-death signal; the engine's
        # worker and candidate processes follow it the same way)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, **env} if env else None, preexec_fn=die_with_parent())
    try:
        deadline = time.monotonic() + start_timeout_s
        line = proc.stdout.readline()
        try:
            ready = json.loads(line) if line else {}
        except json.JSONDecodeError:
            ready = {"error": line.strip()}
        if not ready.get("ready") or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            raise TkccError(f"engine for {model} on {device} did not start: {ready.get('error', '')} "
                            f"{(tmp / 'engine.stderr').read_text()[-3000:]}")
        with EngineClient(socket_path=sock) as client:
            yield client
            try:
                client.shutdown()
            except EngineError:
                pass
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if proc.stdout:
            proc.stdout.close()
