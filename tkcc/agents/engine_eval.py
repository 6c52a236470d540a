"""The campaign's Evaluator backed by the persistent engine (``tkcc serve``), over its RPC.

Each measurement is one engine ``experiment`` on one tier: load (compile the
plan for that tier), validate against the engine's own reference, swap in,
re-capture graphs, measure on the workload, swap back. Shipping is the same
on the slow tier with ``keep=True`` and no measurement (the confirmation just
measured it there), so a candidate is validated again right before it serves.
The key a result is stored under names everything that
determines the built artifact: the candidate spec, the versions of the passes
in its plan, the tier, and the engine's model fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
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
    """``keep_artifacts``: a folder where each measured candidate's pass-log summary and generated source are
    kept (``<hash>/passes.json``, ``<hash>/artifact/``), so a report can link them after the engine is gone."""

    def __init__(self, client, workload, *, pass_modules: list[str] = (), reps: int = 30, timeout_s: float = 600,
                 keep_artifacts: str | Path | None = None):
        self.client, self.workload = client, workload
        self.pass_modules, self.reps, self.timeout_s = [str(Path(p).resolve()) for p in pass_modules], reps, timeout_s
        self.keep_artifacts = Path(keep_artifacts) if keep_artifacts else None
        status = client.status()
        worker = status.get("worker") or {}
        eng = status.get("engine") or {}
        self.model = eng.get("model")
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
        self.build_info: dict[str, dict] = {}  # artifact hash -> what the engine said it built (pass summaries)
        # what else decides a measurement: results are reused only from the same engine session and settings
        started = time.time() - float(eng.get("uptime_s") or 0)
        self._conditions = {"engine": f"pid {eng.get('pid')} started "
                                      f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}",
                            "reps": reps, "device": self.device, "threads": env.get("threads")}
        # relative cost of measuring each tier, for the budget before a tier has been measured
        self.tier_scale = {t: float(v.get("blocks") or 1) for t, v in (worker.get("tiers") or {}).items()}
        # compiling ahead: the engine lists a candidate's kernel compiles and its pool runs them meanwhile
        self.compiles_ahead = bool(((eng.get("compile") or {}).get("workers"))) and callable(
            getattr(client, "prepare", None))
        self._loads: dict[str, dict] = {}      # artifact key -> the load that built it (its compile wait, JIT)
        self._prepared: dict[tuple, dict] = {}  # (candidate key, tier) -> what prepare said of it
        self._key_of: dict[str, str] = {}       # artifact key -> candidate key
        self._listed: set[tuple] = set()        # (candidate key, tier) prepared once

    def workload_fingerprint(self) -> str:
        return self.workload.fingerprint()

    def conditions(self) -> dict:
        return dict(self._conditions)

    def _spec(self, cand: Candidate) -> dict:
        if cand.eager:
            return {"eager": True}
        if cand.compare:
            return {"compare": cand.compare}
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

    def prepare(self, cand: Candidate, tier: str) -> dict | None:
        """Have the engine list the candidate's kernel compiles on ``tier`` and queue them in its compile pool
        (returns at once; None when the engine does not compile ahead or the candidate is not a plan)."""
        if not self.compiles_ahead or cand.eager or cand.compare or cand.artifact_dir is not None:
            return None
        spec = self._spec(cand)
        if "plan" not in spec:
            return None
        try:
            res = (self.client.prepare(spec, tiers=tier) or {}).get(tier) or {}
        except EngineError as e:  # the build itself fails: its load says so, as a failed candidate
            res = {"note": f"prepare failed: {e}"}
        self._prepared[(cand.key, tier)] = res
        self._listed.add((cand.key, tier))  # its kernels are compiled (or compiling) from now on: once is enough
        return res

    def cancel(self, cand: Candidate) -> None:
        """Drop a prepared candidate's compiles that have not started (it will not be measured)."""
        if not self.compiles_ahead:
            return
        try:
            self.client.cancel(self._spec(cand))
        except (EngineError, TkccError):
            pass

    def build(self, cand: Candidate, tier: str) -> str:
        """Compile the candidate for a tier in the engine; returns the built artifact's hash. A candidate not
        prepared yet is prepared first, so even then its kernels compile in the pool, in parallel."""
        if self.compiles_ahead and (cand.key, tier) not in self._prepared and (cand.key, tier) not in self._listed:
            self.prepare(cand, tier)
        spec = self._spec(cand)
        try:
            res = self.client.load(spec, tiers=tier, serving=cand.serving)
        except EngineError as e:
            err = TkccError(f"the engine could not build {cand.key} for the {tier} tier: {e}")
            err.timing = {"critical": {"render": round(float((self._prepared.get((cand.key, tier)) or {})
                                                             .get("render_s") or 0.0), 4)}, "parallel": {}}
            raise err from None
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
        self.build_info[key] = info
        self._loads[key] = (res or {}).get(tier) or {}
        self._key_of[key] = cand.key
        return key

    def spec_of(self, key: str) -> dict:
        """The candidate spec an artifact hash from ``build`` was built from (what a live server rebuilds)."""
        return dict(self._specs[key])

    def _run(self, key: str, tier: str, keep: bool) -> dict:
        try:
            return self.client.experiment(self._specs[key], tiers=tier, workload=self.workload, keep=keep,
                                          reps=self.reps, timeout_s=self.timeout_s,
                                          **({"measure": False} if keep else {}))
        except EngineError as e:
            return {"ok": False, "reason": str(e), "tiers": {tier: {"failure": "refused", "reason": str(e)}}}

    def timing(self, key: str, tier: str, rec: dict) -> dict:
        """Seconds per phase of one experiment (``tkcc.agents.throughput``); the build and prepare once only."""
        from tkcc.agents.throughput import phases_of

        return phases_of(rec, self._loads.pop(key, None), self._prepared.pop((self._key_of.get(key), tier), None))

    def measure(self, key: str, tier: str) -> EvalResult:
        res = self._run(key, tier, keep=False)
        rec = res.get("tiers", {}).get(tier, {})
        timing = self.timing(key, tier, rec)
        if not res.get("ok"):
            verdict = {"invalid": "invalid", "timeout": "timeout"}.get(rec.get("failure"), "crashed")
            if rec.get("failure") in ("refused", "compile"):  # a kernel that does not compile: the candidate's
                verdict = "invalid"
            return EvalResult(verdict, reason=rec.get("reason") or res.get("reason"), timing=timing)
        m = rec["measurement"]
        if m.get("objective") is None:
            return EvalResult("invalid", reason=f"the engine measured no objective: {m.get('note', 'no reason given')}")
        m = {**m, "device": self.device, "seconds": rec.get("seconds"),
             "validation": {k: v for k, v in (rec.get("validation") or {}).items()
                            if k in ("ok", "mode", "shapes", "tolerance", "greedy", "policy", "seconds")}}
        info = self.build_info.get(key) or {}
        if info.get("passes"):
            m["passes"] = info["passes"]
        kept = self._keep(key, tier)
        if kept:
            m["logs_dir"] = kept
        return EvalResult("measured", float(m["objective"]), m, timing=timing)

    def _keep(self, key: str, tier: str) -> str | None:
        """Copy a built candidate's pass-log summary and generated source out of the engine's work folder."""
        info = self.build_info.get(key) or {}
        if self.keep_artifacts is None or not (info.get("passes") or info.get("artifact")):
            return None
        dest = self.keep_artifacts / key
        if (dest / "passes.json").exists():
            return str(dest)
        dest.mkdir(parents=True, exist_ok=True)
        src = info.get("artifact")
        if src and os.path.isdir(src):
            for f in Path(src).rglob("*"):
                if f.is_file() and f.stat().st_size <= _KEEP_FILE_BYTES:
                    out = dest / "artifact" / f.relative_to(src)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, out)
        keep = {k: info.get(k) for k in ("kind", "plan", "plan_hash", "passes", "numerics", "codegen", "phases_s",
                                         "artifact_hash")}
        (dest / "passes.json").write_text(json.dumps({**keep, "tier": tier}, indent=1, default=str) + "\n")
        return str(dest)

    def ship(self, key: str) -> None:
        res = self._run(key, "slow", keep=True)
        if not res.get("ok"):
            raise TkccError(f"shipping {key} failed re-validation: {res.get('reason')}")


_KEEP_FILE_BYTES = 1 << 20  # a kept artifact's files above this (binaries) are left out


def die_with_parent(parent: int | None = None):
    """A ``preexec_fn``: in the child, between fork and exec, have the kernel SIGKILL it when this process
    (``parent``, default the caller) dies; if that already happened, the child exits at once."""
    from tkcc.runtime.procs import set_parent_death_signal

    parent = os.getpid() if parent is None else parent
    return lambda: set_parent_death_signal(parent=parent)


@contextmanager
def spawned_engine(model: str, device: str = "cpu", state_dir: str | None = None, extra: tuple[str, ...] = (),
                   start_timeout_s: float = 900, env: dict | None = None, keep_temp: bool = False,
                   stop_timeout_s: float = 30, on_start=None, stop_by: float | None = None):
    """Start ``tkcc serve`` for this campaign and stop it afterwards; yields a connected EngineClient.

    ``env``: variables set for the engine process only (e.g. its own TRITON_CACHE_DIR). Without
    ``state_dir`` the engine works in a temporary folder, removed when it stops (kept with ``keep_temp``).
    Stopping never raises: the engine is asked to shut down, then terminated, then killed.
    ``on_start(proc)``: called with the engine's Popen once it runs (an owner in another thread can end it).
    ``stop_by``: a ``time.monotonic()`` reading the stop must end by (a campaign's budget ends there, and its
    rows are in its own store already): the engine is killed then if its shutdown has not ended it."""
    from tkcc.runtime import EngineClient

    own = state_dir is None
    tmp = Path(state_dir or tempfile.mkdtemp(prefix="tkcc-campaign-engine-"))
    tmp.mkdir(parents=True, exist_ok=True)
    sock = str(tmp / "engine.sock")
    cmd = [sys.executable, "-m", "tkcc.cli", "serve", "--model", model, "--device", device, "--socket", sock,
           "--state-dir", str(tmp / "state"), "--json", *extra]
    proc = None
    try:
        with open(tmp / "engine.stderr", "w") as err:
            # the engine dies with this process, on SIGKILL too (the kernel's parent-death signal; the engine's
            # worker and candidate processes follow it the same way)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env={**os.environ, **env} if env else None, preexec_fn=die_with_parent())
        if on_start is not None:
            on_start(proc)
        line = _ready_line(proc, start_timeout_s)
        try:
            ready = json.loads(line) if line else {}
        except json.JSONDecodeError:
            ready = {"error": line.strip()}
        if not ready.get("ready"):
            why = ready.get("error") or (f"not ready within {start_timeout_s:.0f} s" if line is None else "")
            _stop(proc, 0)
            raise TkccError(f"engine for {model} on {device} did not start: {why} "
                            f"{(tmp / 'engine.stderr').read_text()[-3000:]}")
        with EngineClient(socket_path=sock) as client:
            try:
                yield client
            finally:
                try:
                    client.shutdown()
                except Exception:  # noqa: BLE001 - stopping: the process is ended below either way
                    pass
    finally:
        if proc is not None:
            if stop_by is None:
                _stop(proc, stop_timeout_s)
            else:  # SIGTERM would only ask for the shutdown already under way: kill at the deadline
                _stop(proc, min(stop_timeout_s, max(0.0, stop_by - time.monotonic())), term_s=0.0)
            if proc.stdout:
                proc.stdout.close()
        if own and not keep_temp:
            shutil.rmtree(tmp, ignore_errors=True)


def _ready_line(proc, timeout_s: float) -> str | None:
    """The engine's first stdout line, or None if it printed none within ``timeout_s`` (or exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        r, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if r:
            return proc.stdout.readline()
        if proc.poll() is not None:
            return proc.stdout.readline() or ""


def _stop(proc, grace_s: float, term_s: float = 10.0, kill_s: float = 10.0) -> None:
    """Wait ``grace_s`` for the engine to exit after its shutdown; then SIGTERM (``term_s``; none with 0), then
    SIGKILL. Never raises: a slow stop must not lose what the command did."""
    steps = ((None, grace_s),) + (((proc.terminate, term_s),) if term_s > 0 else ()) + ((proc.kill, kill_s),)
    for step, wait in steps:
        if step is not None:
            try:
                step()
            except ProcessLookupError:
                return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
