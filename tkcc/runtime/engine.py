"""EngineCore: the model, its tiers, the loaded candidates and the forward pointer of each tier.

It lives in the engine's worker process (``tkcc.runtime.worker``): the
supervisor sends it one operation at a time. Every tier has a *slot*: the
candidate now serving (initially the captured baseline), the history of
earlier ones (for revert) and, on a GPU, the CUDA graphs captured for the
current forward on the workload's shapes. A candidate is swapped into a
slot only after it passed validation on that tier in this process.

Isolation (``cfg["isolation"]``): ``process`` runs every candidate, and the
reference, in trial processes forked from this one (``tkcc.runtime.trial``);
this process never runs candidate code, and the clock and every comparison
stay here. ``inprocess`` (a GPU, ``--tp``, or a direct user of EngineCore
such as an in-process evaluator of trusted plans) runs them here. ``auto``
picks ``process`` where a fork is safe (CPU, one rank). Without the key
EngineCore runs in-process, as it always has.

With ``tkcc serve --tp N`` every rank's worker holds a ``TPEngineCore``
(``tkcc.runtime.tp``), a subclass that serves the sharded model; the hooks
here (``_serving_tiers``, ``_reference``, ``_build``, ``op_startup``) are
where it differs.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import os
import random
import secrets
import time
import zlib
from dataclasses import dataclass, field

import torch

from tkcc.errors import EngineError
from tkcc.kernels.graph_replay import CapturedCall, GraphCaptureError
from tkcc.runtime import candidates as cands
from tkcc.runtime import determinism, device_memory, prefetch
from tkcc.runtime.measurement import Measurement, environment
from tkcc.runtime.programs import (build_tiers, check_device, check_tier, fast_blocks_for, load_program,
                                   parse_dtype)
from tkcc.runtime.timing import bucket_inputs, objective_of, time_bucket
from tkcc.runtime.validation import (TOLERANCES, WEIGHTS_CHANGED, StateGuard, ValidationFailure, clone_all,
                                     compare, long_context_bucket, pick_buckets, poison, tensors_of, validate,
                                     weights_checksum, changed_weight)
from tkcc.runtime.stability import unstable_error
from tkcc.runtime.workloads import check_buckets, default_workload, for_program, workload_from_json

HISTORY = 8  # earlier forwards kept per tier for revert
MIN_GPU_REPS = 30  # the cap on timed repetitions per bucket on a GPU, at least (adaptive timing may stop earlier)
MIN_REPS = 10      # adaptive timing: repetitions per bucket before the stopping rule is asked
CI_REL = 0.005     # ... which stops once the median's 95 % confidence interval is within +-0.5 % of it
CAPTURE_WARMUP = 1  # eager calls on the side stream before a candidate's capture (see _capture)
SAMPLED_CALLS = 2   # timed calls per bucket, chosen at random, whose outputs are checked (and the last one)
ISOLATIONS = ("auto", "process", "inprocess")


class CheckFailed(EngineError):
    """A timed call's outputs did not match the reference on its fresh inputs: the candidate is invalid."""

    invalid = True


def resolve_isolation(mode, device: torch.device, tp: int) -> str:
    """``process`` where a fork of the worker is safe (CPU, one rank), else ``inprocess``; see the module doc."""
    m = "inprocess" if mode is None else str(mode)
    if m not in ISOLATIONS:
        raise EngineError(f"--isolation {mode!r}: must be one of {list(ISOLATIONS)}")
    fork_safe = device.type == "cpu" and tp == 1
    if m == "auto":
        return "process" if fork_safe else "inprocess"
    if m == "process" and not fork_safe:
        why = "a CUDA context does not survive fork" if device.type != "cpu" else "--tp ranks share one group"
        raise EngineError(f"--isolation process needs a CPU engine with one rank ({why}); use --isolation auto or "
                          "inprocess (candidates then run in the worker, which audits its global state after each)")
    return m


@dataclass
class Slot:
    current: str = "baseline"
    history: list[str] = field(default_factory=list)
    graphs: dict = field(default_factory=dict)        # bucket key -> CapturedCall
    graph_notes: dict = field(default_factory=dict)   # bucket key -> why it runs eagerly
    graphs_for: str | None = None                     # workload fingerprint the graphs were captured for


def _freeing_graphs_on_oom(op):
    """An engine operation that, out of device memory, runs once more after the engine dropped every CUDA graph
    it keeps (``EngineCore.free_graphs``): what filled the device may be the engine's own graphs, not the
    candidate. A second OutOfMemoryError is the candidate's, raised as it is. One rank only: a rank of a
    tensor-parallel group retrying alone would leave the others' collectives unpaired."""
    @functools.wraps(op)
    def run(self, *args, **kwargs):
        try:
            return op(self, *args, **kwargs)
        except torch.cuda.OutOfMemoryError as e:
            if self.device.type != "cuda" or self.tp != 1 or not self.free_graphs():
                raise
            first = str(e).splitlines()[0] if str(e) else "out of memory"
        out = op(self, *args, **kwargs)
        if isinstance(out, dict):
            out["graphs_freed"] = f"ran out of device memory ({first}); ran again after freeing the engine's graphs"
        return out

    run.frees_graphs_on_oom = True  # (kept by functools.wraps in the decorators above it)
    return run


class EngineCore:
    tp = 1  # ranks the served model is split over (TPEngineCore: > 1)

    def __init__(self, cfg: dict):
        t0 = time.perf_counter()
        self.cfg = cfg
        self.kernel_cache = prefetch.setup(cfg)  # before anything compiles: the shared, checksummed cache
        self.device = torch.device(check_device(self._device_name(cfg)))
        self.dtype = parse_dtype(cfg.get("dtype", "float32"))
        self._upcast: dict = {}  # id(Program) -> {phase: its graph computing in fp32} (tkcc.runtime.exact_reference)
        self.work_dir = cfg.get("work_dir") or os.path.join(cfg.get("state_dir", "/tmp"), "candidates")
        os.makedirs(self.work_dir, exist_ok=True)
        self.max_bytes = int(cfg.get("max_artifact_bytes", 256 << 20))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.device_memory = None  # the device-memory limit and account (tkcc.runtime.device_memory), once started
        self.device_max_given = self._device_max(cfg)  # checked before the model is built: a bad value costs nothing
        self.isolation = resolve_isolation(cfg.get("isolation"), self.device, self.tp)
        self.threads = int(cfg["threads"]) if cfg.get("threads") else torch.get_num_threads()
        if self.isolation == "process":
            torch.set_num_threads(1)  # fork safety (tkcc.runtime.trial); every trial runs with self.threads
        elif cfg.get("threads"):
            torch.set_num_threads(self.threads)  # CPU timing: a fixed, stated thread count
        self.trials = None
        self.events: list[dict] = []  # for the supervisor: what changed outside a request (trials lost)
        t1 = time.perf_counter()
        if cfg.get("program") is not None:  # an in-process engine (tkcc.compile): the Program captured there
            self.program = cfg["program"]
        else:
            self.program = load_program(cfg["model"], self.dtype, str(self.device), cfg.get("max_cache_len"),
                                        int(cfg.get("batch", 1)))
        t2 = time.perf_counter()
        self.fast_blocks = fast_blocks_for(self.program.num_blocks, cfg.get("fast_blocks"))
        self.programs = self._serving_tiers(self.program)
        self.program = self.programs["slow"]
        t3 = time.perf_counter()
        self.slots = {t: Slot() for t in self.programs}
        from tkcc.runtime.refbank import ReferenceBank

        self.refbank = ReferenceBank()  # the reference's results per tier and shape, reused (tkcc.runtime.refbank)
        self.replays: dict = {}  # (candidate or "reference", tier) -> {phase: Replays}: graphs kept per shape
        self.ref_graphs: dict = {}  # (tier, bucket key) -> the reference's own CapturedCall (False: not capturable)
        baseline = cands.Candidate("baseline", "baseline", {"baseline": True})
        self.candidates: dict[str, cands.Candidate] = {"baseline": baseline}
        if self.isolation == "process":
            from tkcc.runtime.trial import TrialHost

            self.trials = TrialHost(self)
        for t in self.programs:
            self._build(baseline, t)
        self.validated: set[tuple[str, str]] = {("baseline", t) for t in self.programs}
        self.validations: dict[tuple[str, str], dict] = {}
        self.weights = weights_checksum(self.program.model)
        self.default_workload = default_workload(self.program)
        self.env = environment(self.device, self.dtype)
        self.startup = {"import_and_setup_s": t1 - t0, "build_and_capture_s": t2 - t1, "tiers_s": t3 - t2,
                        "total_s": time.perf_counter() - t0}
        self.deterministic: dict = {}
        self.policies: dict = {}  # tier -> determinism.TierPolicy (exact or scale-aware tolerance)
        self.validation_mode = determinism.check_mode(cfg.get("validation"))
        self.canaries: dict = {}
        if self.tp == 1:
            self.op_startup()  # a rank group runs it on every rank at once (its checks call collectives)

    def _device_max(self, cfg: dict) -> int | None:
        """``cfg["device_max_bytes"]`` checked against the device: None (no cap: an in-process engine in a user's
        own process, a CPU), 0 (derived after start-up) or the bytes given."""
        given = cfg.get("device_max_bytes")
        if given is None:
            return None
        if self.device.type != "cuda":
            if given:
                raise EngineError(f"--device-max-mem applies to a CUDA device; this engine runs on {self.device}")
            return None
        return device_memory.check_given(given, device_memory.CudaMemory(self.device).read().total, str(self.device))

    def owned_device_bytes(self) -> int:
        """Device bytes the engine's own caches hold (the reference's graphs and bank, the graphs and kept
        replays of every tier): what a candidate's leak is measured net of."""
        return device_memory.held_by([self.refbank, self.ref_graphs, self.replays, self.slots, self.canaries],
                                     self.device.type)

    def op_startup(self) -> dict:
        """Checks of the baseline before any candidate code runs: reproducibility, canary outputs."""
        t0 = time.perf_counter()
        for t in self.programs:
            probe = self._baseline_deterministic(t)
            policy = determinism.decide(probe, self.validation_mode, self.dtype, t,
                                        float(self.cfg.get("tolerance_safety") or determinism.SAFETY))
            if not policy.exact and self.tp == 1 and {"prefill", "decode"} <= set(self.programs[t].graphs):
                from tkcc.runtime.golden import reference_greedy

                policy.greedy = reference_greedy(self.programs[t], self._reference(t), policy.tolerance.bound)
            self.policies[t] = policy
            self.deterministic[t] = {**probe, "validation": policy.summary()}
        self.canaries = {t: self._canary_run(t) for t in self.programs}
        if self.device_max_given is not None and self.device_memory is None:
            mem = self.memory()  # after the checks: what the engine holds now is the resident model
            self.device_memory = device_memory.DeviceBudget.start(
                device_memory.CudaMemory(self.device), self.device_max_given, mem["model_bytes"] + mem["cache_bytes"],
                owned=self.owned_device_bytes, device=str(self.device))
        self.startup["checks_s"] = time.perf_counter() - t0
        self.startup["total_s"] += self.startup["checks_s"]
        return {"deterministic": self.deterministic}

    # ------------------------------------------------------------ tp hooks
    def _device_name(self, cfg: dict) -> str:
        return cfg["device"]

    def _serving_tiers(self, program) -> dict:
        """{tier: Program the tier serves}; its baseline forward is the Program's graphs."""
        return build_tiers(program, self.fast_blocks)

    def _reference(self, tier: str) -> dict:
        """{phase: callable}: what candidates on ``tier`` are validated against (the golden forward). With
        process isolation, the captured graphs run in the baseline's trial process, with the same threads as
        every candidate's (this process computes nothing, so it can fork)."""
        if self.trials is None:
            return self.programs[tier].graphs
        return self._forwards(self.candidates["baseline"], tier)

    def _build(self, cand: cands.Candidate, tier: str) -> None:
        if self.trials is None:
            cands.build_for_tier(cand, tier, self.programs, self.work_dir, self.max_bytes)
            return
        from tkcc.runtime.trial import RemoteForward

        trial = self.trials.trial(cand.id)
        res = trial.build(cand.spec, cand.kind, tier)
        cand.exact = bool(res["exact"])
        cand.compile_s[tier] = float(res["compile_s"])
        cand.info[tier] = {**res["info"], "trial": {"pid": trial.pid, "fork_s": round(trial.start_s, 6)}}
        cand.forwards[tier] = {p: RemoteForward(trial, tier, p) for p in res["phases"]}

    def _forwards(self, cand: cands.Candidate, tier: str) -> dict:
        """The candidate's forwards on ``tier``; the baseline's are rebuilt if its trial process was lost."""
        fwd = cand.forwards.get(tier)
        if fwd is None and cand.id == "baseline":
            self._build(cand, tier)
            fwd = cand.forwards[tier]
        if fwd is None:
            raise EngineError(f"candidate {cand.id!r} is not loaded for the {tier} tier; load it first")
        return fwd

    def trial_lost(self, cid: str, reason: str) -> None:
        """A candidate's trial process is gone: drop its forwards; a tier it served goes back to what served
        before it (the supervisor learns it from ``events``)."""
        cand = self.candidates.get(cid)
        if cand is None:
            return
        cand.forwards.clear()
        if cid == "baseline":
            return  # rebuilt on the next use: it runs no candidate code
        for key in [k for k in self.validated if k[0] == cid]:
            self.validated.discard(key)
        moved = {}
        for t, slot in self.slots.items():
            slot.history = [h for h in slot.history if h != cid]
            if slot.current == cid:
                slot.current = slot.history.pop() if slot.history else "baseline"
                self._drop_graphs(slot)
                moved[t] = slot.current
        if moved:
            self.events.append({"kind": "trial_lost", "candidate": cid, "reason": reason, "moved": moved,
                                "slots": {t: {"current": s.current, "history": list(s.history)}
                                          for t, s in self.slots.items()}})

    def drain_events(self) -> list[dict]:
        """Trials found dead since the last request (the watchdog kills, this thread reaps), and what changed."""
        if self.trials is not None:
            for cid, trial in list(self.trials.trials.items()):
                if trial.dead is None and not trial.alive():
                    why = self.trials.killed.pop(trial.pid, None) or f"its process died ({trial.dead})"
                    self.trials.trials.pop(cid, None)
                    trial.kill()
                    self.trial_lost(cid, why)
                    if not any(e.get("candidate") == cid for e in self.events):
                        self.events.append({"kind": "trial_lost", "candidate": cid, "reason": why, "moved": {}})
            self.events += self.trials.drain_events()
        out, self.events = self.events, []
        return out

    def _run_validation(self, prog, reference: dict, forwards: dict, buckets: list, exact: bool, atol: float,
                        rtol: float, seed: int) -> dict:
        tier = next((t for t, p in self.programs.items() if p is prog), None)
        policy = self.policies.get(tier) if tier is not None else None
        declared = (atol, rtol) != tuple(TOLERANCES.get(self.dtype, (1e-4, 1e-4)))  # the candidate's own atol/rtol
        if policy is not None and not exact and policy.tolerance is None and not declared:
            # an inexact candidate on an exact tier, at the dtype's tolerance: the scale-aware bound
            policy = dataclasses.replace(policy, mode="tolerance", tolerance=self._scaled(tier, False))
        policy = policy if policy is not None and not exact else None
        bank = self.refbank if tier is not None and self.tp == 1 else None
        how = "replay" if getattr(self, "_replaying", False) else "eager"
        return validate(prog, reference, forwards, buckets, exact, atol, rtol, seed, (self.program.model, self.weights),
                        policy=policy, bank=bank, tier=f"{tier}/{'exact' if exact else 'tolerance'}/{how}",
                        candidate_id=getattr(self, "_validating", ""),
                        # one rank alone re-running its reference would leave the others' collectives unpaired
                        room=self.device_memory.reference if self.device_memory is not None and self.tp == 1 else None,
                        exact_reference=self._exact_reference(prog) if policy is not None else None)

    def _exact_opinion(self, tier: str, phase: str, inputs, guard, ref: list, got: list, scaled,
                       of_state: bool = False, memo: dict | None = None) -> str | None:
        """What the reference computing in fp32 says of outputs (or, ``of_state``, a cache) past the scaled bound
        (``tkcc.runtime.exact_reference``): the finding where the candidate passes on its word, else None (the
        failure stands). The same second opinion validation asks."""
        from tkcc.runtime.validation import exact_opinion

        fn = (self._exact_reference(self.programs[tier]) or {}).get(phase)
        if fn is None or scaled is None:
            return None
        said = exact_opinion(fn, inputs, guard, ref, got, scaled.bound, of_state, memo)
        return said[1] if said is not None and said[0] else None

    def _exact_reference(self, prog) -> dict | None:
        """{phase: the captured graph computing in fp32}, for tolerance mode's second opinion
        (``tkcc.runtime.exact_reference``); None where it cannot run here: with process isolation this process
        computes nothing (it forks trials), and one rank alone would leave collectives unpaired."""
        from tkcc.runtime.exact_reference import upcast

        if self.trials is not None or self.tp != 1 or self.dtype not in (torch.bfloat16, torch.float16):
            return None
        if id(prog) not in self._upcast:
            ups = ((p, upcast(gm)) for p, gm in prog.graphs.items() if isinstance(gm, torch.fx.GraphModule))
            self._upcast[id(prog)] = {p: g for p, g in ups if g is not None}
        return self._upcast[id(prog)]

    def _agree(self, res: dict) -> dict:
        """A validation verdict as every rank sees it (one rank: its own)."""
        return res

    def _all_ok(self, ok: bool) -> bool:
        """True only if ``ok`` on every rank (one rank: ``ok``); keeps the ranks' steps paired."""
        return ok

    # ---------------------------------------------------------------- helpers
    def _workload(self, workload):
        w = self.default_workload if workload is None else for_program(self.program, workload_from_json(workload))
        check_buckets(self.program, w)
        return w

    def _cand(self, cid: str) -> cands.Candidate:
        try:
            return self.candidates[cid]
        except KeyError:
            raise EngineError(f"no candidate {cid!r} is loaded; loaded: {sorted(self.candidates)}") from None

    def _tolerance(self, cand: cands.Candidate) -> tuple[float, float]:
        atol, rtol = TOLERANCES.get(self.dtype, (1e-4, 1e-4))
        meta = self.program.meta
        atol = float(cand.spec.get("atol", meta.get("atol", atol)))
        rtol = float(cand.spec.get("rtol", meta.get("rtol", rtol)))
        return atol, rtol

    def _mode(self, cand: cands.Candidate, tier: str) -> tuple[bool, str]:
        declared = bool(self.program.meta.get("exact", True)) and cand.exact
        policy = self.policies[tier]
        if declared and not policy.exact:
            return False, policy.why()
        return declared, ""

    def _scaled(self, tier: str, exact: bool):
        """The scale-aware tolerance of a tolerance-mode check (None: exact). A tier whose reference reproduces
        itself still validates inexact candidates (tolerance passes, sharded layouts) this way, at the dtype's
        floor: an element-wise rtol means nothing on bf16 logits near zero."""
        if exact:
            return None
        policy = self.policies[tier]
        return policy.tolerance or determinism.tolerance_from(
            policy.probe, self.dtype, float(self.cfg.get("tolerance_safety") or determinism.SAFETY))

    def _baseline_deterministic(self, tier: str) -> dict:
        """The start-up determinism probe (``tkcc.runtime.determinism``): eager reruns under poisoned allocations
        and, on CUDA, separate graph captures of the reference, compared bitwise."""
        prog = self.programs[tier]
        return determinism.probe(prog, self._reference(tier), determinism.probe_buckets(self.default_workload, prog),
                                 self.device)

    def _canary_run(self, tier: str) -> list:
        """Baseline outputs on fixed inputs, recorded before any candidate code ran (see op_validate)."""
        prog = self.programs[tier]
        gen = torch.Generator().manual_seed(4321)
        out = []
        for b in pick_buckets(self.default_workload, 1)[:2]:
            inputs = bucket_inputs(prog, b, gen, 1)[0]
            guard = StateGuard(prog.state)
            with torch.no_grad():
                out.append([t.clone() for t in tensors_of(self._reference(tier)[b.phase](*clone_all(inputs)))])
            guard.restore()
        if prog.state is not None and hasattr(prog.state, "reset"):
            prog.state.reset()
        return out

    def _canary_ok(self, tier: str) -> str:
        """'' if the baseline still computes what it computed at start-up; else why not.

        A candidate's code runs in this process: one that patched torch, the
        model or its buffers would move the reference with it. The canary is
        the baseline on inputs fixed before any candidate was loaded.
        """
        exact = self.policies[tier].exact
        atol, rtol = TOLERANCES.get(self.dtype, (1e-4, 1e-4))
        try:
            for i, (want, got) in enumerate(zip(self.canaries[tier], self._canary_run(tier))):
                compare(want, got, exact, atol, rtol, f"canary {i}", self.policies[tier].tolerance)
        except ValidationFailure as e:
            return f"the baseline forward no longer computes what it did at start-up ({e})"
        return ""

    def memory(self) -> dict:
        model_bytes = sum(p.numel() * p.element_size() for p in self.program.model.parameters())
        state = self.program.state
        cache_bytes = sum(b.numel() * b.element_size() for b in state.buffers()) if state is not None else 0
        out = {"model_bytes": model_bytes, "cache_bytes": cache_bytes}
        if self.device.type == "cuda":
            r = device_memory.CudaMemory(self.device).read()
            out.update(allocated_bytes=r.allocated, max_allocated_bytes=r.peak, reserved_bytes=r.reserved,
                       device_used_bytes=r.total - r.free, device_total_bytes=r.total)
            if self.device_memory is not None:
                out["device_limit"] = self.device_memory.status()
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out["rss_bytes"] = int(line.split()[1]) * 1024
        except OSError:
            pass
        return out

    # ------------------------------------------------------------- operations
    def op_ping(self) -> dict:
        """The supervisor's watchdog, between requests: the device-memory cap still holds (see DeviceBudget.idle)."""
        out = {"pid": os.getpid()}
        if self.device_memory is not None:
            why, fatal = self.device_memory.idle()
            if why:
                loaded = sorted(c for c in self.candidates if c != "baseline")
                out["device_memory"] = f"{why} between requests (candidates loaded: {loaded or 'none'})"
                out["device_memory_fatal"] = fatal
        return out

    def op_status(self) -> dict:
        return {
            "pid": os.getpid(),
            "model": self.cfg["model"],
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "phases": self.program.phases,
            "num_blocks": self.program.num_blocks,
            "tiers": {t: {"blocks": p.num_blocks, "fingerprint": p.fingerprint, "current": self.slots[t].current,
                          "history": list(self.slots[t].history), "graphs": sorted(self.slots[t].graphs),
                          "eager": dict(self.slots[t].graph_notes), "deterministic": self.deterministic[t],
                          "validation": self.policies[t].summary()}
                      for t, p in self.programs.items()},
            "max_cache_len": self.program.meta.get("max_cache_len"),
            "batch": self.program.meta.get("batch"),
            "candidates": sorted(self.candidates),
            "memory": self.memory(),
            "env": self.env,
            "startup": self.startup,
            "isolation": self._isolation_status(),
            "reference_bank": self.refbank.to_json(),
        }

    def _isolation_status(self) -> dict:
        out = {"mode": self.isolation, "threads": self.threads}
        if self.trials is not None:
            forks = self.trials.forks
            out.update(trials={str(pid): cid for pid, cid in self.trials.pids().items()},
                       trial_max_bytes=self.trials.limit, forks=len(forks),
                       fork_s_median=sorted(forks)[len(forks) // 2] if forks else None)
        return out

    def op_discover(self, spec: dict, tier: str) -> dict:
        """The Triton compiles ``spec``'s build on ``tier`` needs, listed without compiling or launching anything
        (``tkcc.runtime.prefetch``); a build that launched nothing is kept, so its ``load`` is free."""
        check_tier(tier)
        return prefetch.discover(self, spec, tier)

    @prefetch.jit_counted
    def op_load(self, spec: dict, tier: str, serving: bool = False) -> dict:
        """Build ``spec`` for ``tier`` (once; a loaded candidate is reused). ``serving`` is the worker's memory
        ledger's (``tkcc.runtime.worker``): the build is the same."""
        from tkcc.runtime.tp import check_layout_of, exact_at_degree_1

        check_tier(tier)
        cid = cands.candidate_id(spec, self.max_bytes)
        cand = self.candidates.get(cid)
        if cand is None:
            check_layout_of(spec, self.tp)
            build_spec = dict(spec)
            if self.tp == 1 and exact_at_degree_1(spec):
                build_spec["exact"] = True  # sharding at degree 1 returns the Program unchanged: stays exact
            cand = cands.Candidate(cid, cands.spec_kind(spec), build_spec)
        if tier not in cand.forwards:
            self._build(cand, tier)
            self.candidates[cid] = cand
        return {"candidate": cid, "tier": tier, "compile_s": cand.compile_s.get(tier, 0.0),
                "exact": cand.exact, "info": cand.info.get(tier, {})}

    @prefetch.jit_counted
    @_freeing_graphs_on_oom
    def op_validate(self, candidate: str, tier: str, workload=None, seed: int | None = None,
                    max_shapes: int = 4) -> dict:
        check_tier(tier)
        cand = self._cand(candidate)
        fwd = self._forwards(cand, tier)
        w = self._workload(workload)
        prog = self.programs[tier]
        exact, note = self._mode(cand, tier)
        atol, rtol = self._tolerance(cand)
        seed = secrets.randbits(62) if seed is None else int(seed)  # fresh: drawn after the candidate loaded
        buckets = pick_buckets(w, max_shapes)
        longest = long_context_bucket(prog, buckets) if self.device.type == "cuda" else None  # (interpreter: slow)
        if longest is not None:
            buckets.append(longest)
        self._validating = candidate  # the reference bank gives it only draws it has not been validated on
        fwd, ref = self._validation_forwards(cand, tier, fwd)
        res = self._run_validation(prog, ref, fwd, buckets, exact, atol, rtol, seed)
        if not res["ok"] and res.get("mismatch") and self._demote_on_own_failure(cand, tier, res):
            exact, note = self._mode(cand, tier)  # tolerance from here on: validate this candidate again under it
            res = self._run_validation(prog, ref, fwd, buckets, exact, atol, rtol, seed)
        res["replays"] = self._replay_status(cand, tier)
        if getattr(self, "before_canary", None) is not None:
            self.before_canary()  # in-process: the worker's audit puts back what a candidate changed, first
        tampered = self._canary_ok(tier)
        if tampered:
            res.update(ok=False, fatal=True, reason=f"{tampered}: the candidate changed shared state; the worker "
                                                    "restarts" + (f" (also: {res['reason']})" if res["reason"] else ""))
        res = self._agree(res)
        res["note"] = note
        res["policy"] = self.policies[tier].summary()
        res["tier"] = tier
        res["candidate"] = candidate
        if res["ok"]:
            self.validated.add((candidate, tier))
        else:
            self.validated.discard((candidate, tier))
            if WEIGHTS_CHANGED in (res["reason"] or ""):
                res["fatal"] = True  # the resident weights are no longer the model's: restart
        self.validations[(candidate, tier)] = res
        return res

    @prefetch.jit_counted
    @_freeing_graphs_on_oom
    def op_swap(self, candidate: str, tier: str, workload=None, capture: bool = True, seed: int | None = None) -> dict:
        """Point the tier's forward at ``candidate`` (validated), keep the old one for revert, re-capture graphs."""
        check_tier(tier)
        cand = self._cand(candidate)
        if (candidate, tier) not in self.validated:
            why = self.validations.get((candidate, tier), {}).get("reason") or "it has not been validated"
            raise EngineError(f"candidate {candidate!r} cannot be swapped into the {tier} tier: {why}")
        slot = self.slots[tier]
        t0 = time.perf_counter()
        prev = slot.current
        if prev != candidate:
            slot.history.append(prev)
            del slot.history[:-HISTORY]
        slot.current = candidate
        self._drop_graphs(slot)
        swap_s = time.perf_counter() - t0
        cap = {"capture_s": 0.0, "graphs": 0, "eager": {}}
        if capture:
            try:
                cap = self._capture(tier, self._workload(workload), seed)
            except BaseException:
                self._point(slot, prev)
                raise
        return {"candidate": cand.id, "tier": tier, "previous": prev, "swap_s": swap_s, **cap}

    def _validation_forwards(self, cand: cands.Candidate, tier: str, fwd: dict) -> tuple[dict, dict]:
        """(candidate, reference) forwards to validate with. On a GPU (one rank): CUDA-graph replays of both,
        captured once per input shape and kept (``tkcc.runtime.replays``): the candidate is validated the way
        it is measured, and swap reuses its graphs. The baseline replays the reference's own graphs."""
        self._replaying = self.device.type == "cuda" and self.tp == 1
        if not self._replaying:
            return fwd, self._reference(tier)
        ref = self._replays_of("reference", tier, self._reference(tier))
        if cand.id == "baseline":
            return ref, ref
        return self._replays_of(cand.id, tier, fwd), ref

    def _graph(self, fn, inputs: tuple, warmup: int) -> CapturedCall:
        """Every CUDA graph the engine captures, each in a memory pool of its own.

        One pool shared by all was tried on an H200 (commit 93c82d6): it kept olmoe-16l's 16 GiB prefill-chunk
        graphs (then ``batched_mm`` experts) from filling the device, but an exact-mode ``tkcc compile`` of
        llama-1b-16l with it stopped at A/A calibration, the serving candidate's decode replay 0.035 from the
        reference's. The same command with private pools completed, though its log shows mismatches of the same
        kind (0.016-0.068 at decode contexts) for other candidates: the pool is not shown to be the cause, and
        private pools stay until that is settled. What keeps the pools small now is the prefill captured with
        grouped experts (``tkcc.frontend.hf.experts_for_phase``); what frees them when the device is full is
        ``free_graphs``."""
        return CapturedCall(fn, inputs, warmup=warmup, device=self.device)

    def _replays_of(self, cid: str, tier: str, fwd: dict) -> dict:
        from tkcc.runtime.replays import replays_of

        key = (cid, tier)
        if key not in self.replays:
            self.replays[key] = replays_of(fwd, self.programs[tier].state, self._graph, CAPTURE_WARMUP)
        return self.replays[key]

    def _replay_status(self, cand: cands.Candidate, tier: str) -> dict | None:
        rp = self.replays.get(("reference" if cand.id == "baseline" else cand.id, tier))
        if rp is None:
            return None
        return {"graphs": sum(len(r.graphs) for r in rp.values()), "captured": sum(r.captures for r in rp.values()),
                "eager": {p: list(r.notes.values()) for p, r in rp.items() if r.notes}}

    def _validated_graph(self, cand: cands.Candidate, tier: str, phase: str, inputs: tuple):
        """The graph validation captured and replayed for this candidate at these inputs' shape, if any."""
        from tkcc.runtime.replays import signature

        rp = self.replays.get(("reference" if cand.id == "baseline" else cand.id, tier))
        r = rp.get(phase) if rp else None
        return r.graphs.get(signature(inputs)) if r is not None else None

    def _point(self, slot: Slot, cid: str) -> None:
        if slot.history and slot.history[-1] == cid:
            slot.history.pop()
        slot.current = cid
        self._drop_graphs(slot)

    def _reference_replay(self, tier: str, b, key: str, inputs, guard) -> list:
        """The reference's outputs as the candidate's are produced: replayed from its own CUDA graph.

        A graph replay can pick other library kernels than an eager call (cuBLAS and sdpa choose by
        pointer alignment and pool state: seen on an H200, the olmoe-16l baseline's replay differs from its
        eager run by 0.69 in bf16 logits), so a candidate's replay is held to the reference's replay; the
        eager reference is used where the reference cannot be captured."""
        ref_graphs = self.ref_graphs
        g = ref_graphs.get((tier, key)) if self.device.type == "cuda" else False
        if g is None:
            try:
                g = self._graph(self._reference(tier)[b.phase], inputs, warmup=3)
            except GraphCaptureError:
                g = False
            ref_graphs[(tier, key)] = g
            guard.restore()
        if g is False:
            with torch.no_grad():
                return [t.clone() for t in tensors_of(self._reference(tier)[b.phase](*clone_all(inputs)))]
        outs = g.run(*inputs)
        torch.cuda.synchronize(self.device)
        return [t.clone() for t in outs]

    def _demote_on_own_failure(self, cand: cands.Candidate, tier: str, res: dict) -> bool:
        """The baseline is the reference's own forward: if it fails exact validation, the reference does not
        reproduce itself at that shape (the start-up probe saw other shapes, or was lucky: on an H200 olmoe-16l's
        eager decode at one context differed from itself by 0.023 after a clean probe). With ``--validation
        auto`` the tier switches to tolerance mode with a bound from the difference seen; True if it did."""
        if not self._own_forward(cand, tier):
            return False
        m = res["mismatch"]
        self._demote(tier, m["abs"], m["norm"], f"the baseline against the reference ({res['reason']})")
        return True

    def _own_forward(self, cand: cands.Candidate, tier: str) -> bool:
        """Is ``cand`` the reference's own computation (the baseline, or an empty plan: the same ops), on a tier
        whose mode may follow the reference's measured self-disagreement (auto, or tolerance: not forced exact)?"""
        same = cand.kind == "baseline" or (cand.kind == "plan" and not cand.spec.get("plan"))
        policy = self.policies[tier]
        return same and (policy.source == "auto" or policy.mode == "tolerance")

    def _demote(self, tier: str, abs_err: float, norm_err: float, what: str) -> None:
        """Switch ``tier`` to tolerance mode (auto): the reference was seen to disagree with itself by this much."""
        policy = self.policies[tier]
        probe = {**policy.probe, "deterministic": False,
                 "max_abs_diff": max(abs_err, policy.probe.get("max_abs_diff", 0.0)),
                 "max_norm_diff": max(norm_err, policy.probe.get("max_norm_diff", 0.0)),
                 "worst": f"{what}, found after start-up"}
        new = determinism.decide(probe, "tolerance" if policy.source == "forced" else "auto", self.dtype, tier,
                                 float(self.cfg.get("tolerance_safety") or determinism.SAFETY))
        if self.tp == 1 and {"prefill", "decode"} <= set(self.programs[tier].graphs):
            from tkcc.runtime.golden import reference_greedy

            new.greedy = reference_greedy(self.programs[tier], self._reference(tier), new.tolerance.bound)
        self.policies[tier] = new
        self.deterministic[tier] = {**probe, "validation": new.summary()}

    def _reference_unstable(self, tier: str, b, key: str, inputs, guard, ref: list) -> bool:
        """After an exact-mode replay mismatch: does a second, separate capture of the reference reproduce the
        first on this bucket? If not (the start-up probe saw other shapes; on an H200 olmoe-16l's captures of
        one forward differed by 0.42 at a context the probe had not tried), and the mode is ``auto``, the tier
        switches to tolerance mode with a bound from this disagreement, and True is returned."""
        policy = self.policies[tier]
        if policy.source != "auto" or self.device.type != "cuda":
            return False
        try:
            g = self._graph(self._reference(tier)[b.phase], inputs, warmup=3)
        except GraphCaptureError:
            guard.restore()
            return False
        guard.restore()
        again = [t.clone() for t in g.run(*inputs)]
        torch.cuda.synchronize(self.device)
        guard.restore()
        del g
        equal, ab, nm = determinism.compare_runs(ref, again)
        if equal:
            return False
        self._demote(tier, ab, nm, f"bucket {key}, two CUDA-graph captures of the reference")
        guard.restore()
        return True

    def free_graphs(self) -> int:
        """Drop every CUDA graph the engine keeps (the reference's, every candidate's, the slots': each is
        captured again when next needed) with their memory pools, and return the cached memory to the device;
        the number of graphs dropped."""
        n = sum(g is not False for g in self.ref_graphs.values()) + sum(len(s.graphs) for s in self.slots.values())
        n += sum(len(r.graphs) for rp in self.replays.values() for r in rp.values())
        self.ref_graphs, self.replays = {}, {}
        for slot in self.slots.values():
            slot.graphs, slot.graph_notes, slot.graphs_for = {}, {}, None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return n

    def _drop_graphs(self, slot: Slot) -> None:
        slot.graphs, slot.graph_notes, slot.graphs_for = {}, {}, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _capture(self, tier: str, w, seed: int | None = None) -> dict:
        """CUDA graphs of the current forward for each bucket, each checked once against the baseline."""
        slot = self.slots[tier]
        if self.device.type != "cuda":
            slot.graphs_for = w.fingerprint()
            return {"capture_s": 0.0, "graphs": 0, "eager": {}}
        t0 = time.perf_counter()
        prog = self.programs[tier]
        cand = self._cand(slot.current)
        fwd = cand.forwards[tier]
        exact, _ = self._mode(cand, tier)
        atol, rtol = self._tolerance(cand)
        scaled = self._scaled(tier, exact)
        gen = torch.Generator().manual_seed(secrets.randbits(62) if seed is None else int(seed))
        graphs, notes, notes_exact = {}, {}, {}
        reused = 0
        for b in w.buckets:
            key = b.key()
            if key in graphs or key in notes:
                continue
            inputs = bucket_inputs(prog, b, gen, 1)[0]
            kept = self._validated_graph(cand, tier, b.phase, inputs)
            if kept is not None:  # validation captured it at this shape and replayed it against the reference
                graphs[key] = kept
                reused += 1
                continue
            guard = StateGuard(prog.state)
            try:  # one warm-up call does a forward's lazy set-up (the replay is checked against the reference below)
                g, why = self._graph(fwd[b.phase], inputs, warmup=CAPTURE_WARMUP), ""
            except GraphCaptureError as e:
                g, why = None, f"CUDA graph capture failed ({e}); timed eagerly"
            if not self._all_ok(g is not None):
                notes[key] = why or "CUDA graph capture failed on another rank; timed eagerly"
                guard.restore()
                continue
            guard.restore()
            ref = self._reference_replay(tier, b, key, inputs, guard)
            guard.restore()
            poison(g.static_outputs, self.device, 0)
            outs = g.run(*inputs)
            torch.cuda.synchronize(self.device)
            guard.restore()
            failure = None
            try:
                exact, scaled, note = self._check_replay(tier, cand, b, key, inputs, guard, ref, outs, exact, scaled,
                                                         atol, rtol)
                if note:
                    notes_exact[key] = note
            except ValidationFailure as e:
                failure = EngineError(f"candidate {cand.id} on the {tier} tier: the CUDA graph replay does not "
                                      f"match the reference: {e}")
            if not self._all_ok(failure is None):
                raise failure or EngineError(f"candidate {cand.id} on the {tier} tier: the CUDA graph replay of bucket "
                                             f"{key} does not match the reference on another rank")
            graphs[key] = g
        slot.graphs, slot.graph_notes, slot.graphs_for = graphs, notes, w.fingerprint()
        return {"capture_s": time.perf_counter() - t0, "graphs": len(graphs), "eager": notes,
                "replay_notes": notes_exact, "reused": reused}

    def _check_replay(self, tier: str, cand: cands.Candidate, b, key: str, inputs, guard, ref: list, outs: list,
                      exact: bool, scaled, atol: float, rtol: float,
                      what: str | None = None, memo: dict | None = None) -> tuple[bool, object, str | None]:
        """Hold a candidate's graph replay (or a timed call's outputs) to the reference's; (exact, scaled, note)
        as they stand afterwards (the tier may have switched mode on the way), or ValidationFailure. ``memo``:
        the fp32 reference's runs on these inputs, shared with the check of the cache they wrote."""
        what = what or f"CUDA graph of bucket {key}"
        try:
            compare(ref, outs, exact, atol, rtol, what, scaled)
            return exact, scaled, None
        except ValidationFailure as e:
            first = e
        note = None
        if exact and self._reference_unstable(tier, b, key, inputs, guard, ref):
            exact, scaled, note = False, self._scaled(tier, False), self.policies[tier].why()
        elif exact and self._own_forward(cand, tier) and self.policies[tier].source == "auto":
            # the reference's own ops, replayed from a CUDA graph, differ from its eager run (library kernels
            # round differently there): the tier is not exact after all; judge in tolerance mode from here on,
            # at the dtype floor (how far the reference jumps at this input is the stability check's to say)
            self._demote(tier, 0.0, 0.0, f"bucket {key}: the reference's own forward replayed from a CUDA graph "
                                         "differs from its eager run")
            exact, scaled, note = False, self._scaled(tier, False), self.policies[tier].why()
        if scaled is None:
            if not exact:
                raise first
            try:  # a replay may pick other library kernels than eager: within tolerance is a note, not a failure
                err = compare(ref, outs, False, atol, rtol, what)
            except ValidationFailure:
                raise first from None
            return exact, scaled, f"graph replay differs from the eager reference by {err:.3g} (within tolerance)"
        try:
            compare(ref, outs, False, atol, rtol, what, scaled)
        except ValidationFailure as e:
            jump = unstable_error(self._reference(tier)[b.phase], inputs, guard, ref, scaled,
                                  zlib.crc32(key.encode()))
            if jump is not None:  # the reference itself jumps here (tkcc.runtime.stability): not judged
                return exact, scaled, (f"{what} not judged: the reference moved by {jump:.3g} of its scale under "
                                       "a one-rounding-step perturbation of its cache")
            said = (self._exact_opinion(tier, b.phase, inputs, guard, ref, outs, scaled, memo=memo)
                    if e.mismatch else None)
            if said is not None:
                return exact, scaled, f"{what}: {said}"
            if not (e.mismatch and self._own_forward(cand, tier)):
                raise
            # the reference's own forward, captured again, is this far from itself: widen the bound
            self._demote(tier, e.mismatch["abs"], e.mismatch["norm"],
                         f"bucket {key}, two CUDA-graph captures of the reference's forward")
            scaled, note = self._scaled(tier, False), self.policies[tier].why()
            compare(ref, outs, False, atol, rtol, what, scaled)
        return exact, scaled, note

    @prefetch.jit_counted
    @_freeing_graphs_on_oom
    def op_measure(self, tier: str, workload=None, reps: int = 30, warmup: int = 5, rotations: int = 4,
                   seed: int | None = None, min_reps: int | None = MIN_REPS, ci_rel: float = CI_REL) -> dict:
        """Time the tier's current forward per bucket: ``warmup`` calls, then ``min_reps``..``reps`` recorded
        ones, stopping once the median's 95 % confidence interval is within +-``ci_rel`` (``min_reps=None``
        or ``ci_rel=0``: exactly ``reps``). Every call gets fresh input values, and a sample of the timed calls
        (``SAMPLED_CALLS`` at random, and the last) is checked against the reference on those inputs: a
        mismatch raises CheckFailed. See ``tkcc.runtime.measurement``."""
        check_tier(tier)
        if reps < 1 or warmup < 0 or rotations < 1 or (min_reps is not None and min_reps < 1) or ci_rel < 0:
            raise EngineError(f"measure: reps={reps}, warmup={warmup}, rotations={rotations}, min_reps={min_reps}, "
                              f"ci_rel={ci_rel} must be >= 1, >= 0, >= 1, >= 1 (or None), >= 0")
        w = self._workload(workload)
        note = ""
        if self.device.type == "cuda" and reps < MIN_GPU_REPS:
            note = (f"reps raised from {reps} to {MIN_GPU_REPS} (the engine's floor on a GPU; adaptive timing may "
                    "stop earlier)")
            reps = MIN_GPU_REPS
        slot = self.slots[tier]
        capture_s = 0.0
        if self.device.type == "cuda" and slot.graphs_for != w.fingerprint():
            capture_s = self._capture(tier, w, seed)["capture_s"]
        prog = self.programs[tier]
        cand = self._cand(slot.current)
        fwd = self._forwards(cand, tier)
        t0 = time.perf_counter()
        seed = secrets.randbits(62) if seed is None else int(seed)
        gen = torch.Generator().manual_seed(seed)
        picks = random.Random(seed ^ 0x5A5A)  # which timed calls are checked: drawn here, never told to the forward
        timings, seen, checked, check_s, fp32_runs = [], {}, {}, {}, {}
        for b in w.buckets:
            key = b.key()
            if key in seen:
                continue
            seen[key] = True
            sets = bucket_inputs(prog, b, gen, rotations)
            guard = StateGuard(prog.state)  # the context every timed call of this bucket runs on
            check, outputs, sample, cost = None, None, (), {}
            if self.tp == 1:  # --tp: ranks would have to agree on every check; they validate, not sample
                check, outputs, cost = self._sampler(tier, cand, b, fwd[b.phase], sets[0], guard)
                first = min(reps, min_reps or reps) if ci_rel > 0 else reps  # calls every run makes
                sample = picks.sample(range(first), min(SAMPLED_CALLS, first))
            try:
                bt = time_bucket(fwd[b.phase], slot.graphs.get(key), prog, b, gen, reps, warmup, rotations,
                                 self.device, slot.graph_notes.get(key, ""), min_reps, ci_rel, self._all_ok,
                                 sets=sets, refresh=self._refresher(prog, b.phase, gen), check=check, sample=sample,
                                 outputs=outputs)
            except (ValidationFailure, CheckFailed) as e:
                self.validated.discard((cand.id, tier))
                self.validations[(cand.id, tier)] = {"ok": False, "reason": str(e)}
                if prog.state is not None and hasattr(prog.state, "reset"):
                    prog.state.reset()
                raise CheckFailed(f"candidate {cand.id} on the {tier} tier: {e}") from None
            except Exception as e:
                from tkcc.runtime.trial import BenchCheckFailed

                if not isinstance(e, BenchCheckFailed):
                    raise
                self.validated.discard((cand.id, tier))
                raise CheckFailed(f"candidate {cand.id} on the {tier} tier: bucket {key}, a timed call: {e}") from None
            checked[key] = bt.checked
            if cost:
                check_s[key], fp32_runs[key] = round(cost["seconds"], 4), cost["fp32_runs"]
            timings.append(bt)
        if prog.state is not None and hasattr(prog.state, "reset"):
            prog.state.reset()  # timing filled the cache with random context; leave it as a fresh request finds it
        medians = {t.key: t.median_s for t in timings}
        name, value, why = objective_of(w, medians)
        mode = "" if self.policies[tier].exact else f"validation in {self.policies[tier].why()}"
        note = "; ".join(x for x in (note, why, mode) if x)
        env = dict(self.env, isolation=self.isolation)
        if self.trials is not None:
            env["timed"] = "by the worker's clock, across the trial process boundary (one round trip per call)"
        m = Measurement(candidate=cand.id, tier=tier, blocks=prog.num_blocks, buckets=timings, objective_name=name,
                        objective=value, workload_fingerprint=w.fingerprint(),
                        validation={**self.validations.get((cand.id, tier), {"ok": True, "reason": "baseline"}),
                                    "policy": self.policies[tier].summary()},
                        env=env, wall_s=time.perf_counter() - t0, note=note,
                        checks={"fresh_inputs": True, "calls_checked": checked, "ok": True,
                                "per_bucket": SAMPLED_CALLS + 1 if self.tp == 1 else 0,
                                "seconds": check_s, "fp32_runs": fp32_runs})
        return dict(m.to_json(), capture_s=capture_s)

    def _sampler(self, tier: str, cand: cands.Candidate, b, fn, first: tuple, guard: StateGuard):
        """(check, outputs, cost) for one bucket's timed calls: ``check(args, outs)`` holds a timed call's outputs
        and the cache it wrote to the reference's on the same (fresh) inputs; ``outputs`` are the reference's
        outputs on ``first``, whose shapes size a trial's output slots; ``cost`` adds up the checks' seconds and
        the fp32 reference runs they asked for (a candidate past the scaled bound at router near ties asks for
        many: they can take longer than the timing itself)."""
        key = b.key()
        exact, _ = self._mode(cand, tier)
        atol, rtol = self._tolerance(cand)
        scaled = self._scaled(tier, exact)
        remote = getattr(fn, "trial", None)
        guard.restore()
        outputs = self._reference_replay(tier, b, key, first, guard)
        guard.restore()
        state = {"exact": exact, "scaled": scaled}
        cost = {"seconds": 0.0, "fp32_runs": 0}

        def check(args, outs):
            t0, memo = time.perf_counter(), {}  # the fp32 runs on these inputs, for the outputs and the cache
            try:
                judge(args, outs, memo)
            finally:
                cost["seconds"] += time.perf_counter() - t0
                cost["fp32_runs"] += len(memo)

        def judge(args, outs, memo):
            if remote is not None:
                remote.host.state_out(remote)  # what the candidate's call wrote to its cache
            cand_state = guard.current()
            outs = [o.clone() for o in outs]
            guard.restore()
            try:
                ref = self._reference_replay(tier, b, key, args, guard)
                ref_state = guard.current()
                what = f"bucket {key}, a timed call on fresh inputs"
                state["exact"], state["scaled"], note = self._check_replay(
                    tier, cand, b, key, args, guard, ref, outs, state["exact"], state["scaled"], atol, rtol, what,
                    memo)
                if note and note.startswith(f"{what} not judged"):
                    return  # the reference itself jumps at these inputs: its cache says nothing of the candidate
                try:
                    compare(ref_state, cand_state, state["exact"], atol, rtol, f"{what}: cache state",
                            state["scaled"])
                except ValidationFailure:
                    if state["exact"] or state["scaled"] is None:
                        raise
                    # the same rule as the outputs' (tkcc.runtime.stability): where the reference's own cache
                    # jumps under a one-rounding-step perturbation, this input is not judged
                    if (unstable_error(self._reference(tier)[b.phase], args, guard, ref, state["scaled"],
                                       zlib.crc32(key.encode()), ref_state=ref_state) is None
                            and self._exact_opinion(tier, b.phase, args, guard, ref_state, cand_state,
                                                    state["scaled"], of_state=True, memo=memo) is None):
                        raise
            finally:
                guard.restore()

        return check, outputs, cost

    def _refresher(self, prog, phase: str, gen: torch.Generator):
        """Fresh values for an input set before each timed call (outside the timed region): new token ids in
        ``input_ids``, and every floating input a fresh shuffle of its own values; positions and other integer
        inputs stay. So no call repeats another's inputs, and a forward that caches its outputs (by address or
        by content) is caught by the sampled checks or measured at its true speed."""
        names = list((prog.meta.get("inputs") or {}).get(phase) or [])
        vocab = int(prog.meta.get("vocab_size") or 0)
        dev_gen = gen if self.device.type == "cpu" else torch.Generator(device=self.device).manual_seed(
            int(torch.randint(0, 2**62, (1,), generator=gen)))
        pools: dict = {}

        def refresh(args) -> None:
            with torch.no_grad():
                for i, a in enumerate(args):
                    if not isinstance(a, torch.Tensor) or a.numel() == 0:
                        continue
                    if i < len(names) and names[i] == "input_ids" and vocab > 1:
                        a.random_(0, vocab, generator=dev_gen)
                    elif a.is_floating_point():
                        n = a.numel()
                        pool = pools.get((i, n))
                        if pool is None:
                            flat = a.detach().reshape(-1)
                            pool = pools[(i, n)] = torch.cat([flat[torch.randperm(n, generator=gen).to(a.device)]
                                                              for _ in range(3)])
                        off = int(torch.randint(0, 2 * n, (1,), generator=gen))
                        a.copy_(pool[off:off + n].view_as(a))

        return refresh

    def op_revert(self, tier: str, workload=None, capture: bool = True, seed: int | None = None) -> dict:
        check_tier(tier)
        slot = self.slots[tier]
        if not slot.history:
            raise EngineError(f"nothing to revert on the {tier} tier: it serves {slot.current!r} with no history")
        gone = slot.current
        slot.current = slot.history.pop()
        self._drop_graphs(slot)
        cap = self._capture(tier, self._workload(workload), seed) if capture else {}
        return {"tier": tier, "reverted": gone, "current": slot.current, **cap}

    def op_unload(self, candidate: str) -> dict:
        if candidate == "baseline":
            return {"unloaded": False}
        in_use = [t for t, s in self.slots.items() if s.current == candidate or candidate in s.history]
        if in_use:
            return {"unloaded": False, "in_use": in_use}
        self.candidates.pop(candidate, None)
        for key in [k for k in self.replays if k[0] == candidate]:
            del self.replays[key]  # its graphs, and their memory pools
        if self.trials is not None:
            self.trials.discard(candidate)  # its process, and all it did, goes
        for key in [k for k in self.validated if k[0] == candidate]:
            self.validated.discard(key)
        return {"unloaded": True}

    def op_generate(self, prompt: list[int], n: int, tier: str = "slow") -> dict:
        """Greedy tokens from the tier's current forward (prefill, then n-1 decode steps)."""
        check_tier(tier)
        prog = self.programs[tier]
        if not {"prefill", "decode"} <= set(prog.phases):
            raise EngineError("generate needs a causal LM with prefill and decode phases")
        cap = int(prog.meta.get("max_cache_len", 0))
        if not prompt or len(prompt) + n > cap:
            raise EngineError(f"generate: prompt of {len(prompt)} tokens + {n} new must be in 1..{cap}")
        from tkcc.frontend.generate import greedy

        fwd = self._forwards(self._cand(self.slots[tier].current), tier)
        batch = int(prog.meta.get("batch", 1))
        ids = torch.tensor([prompt] * batch, device=self.device)
        tokens = greedy(prog, ids, n, forwards={p: fwd[p] for p in ("prefill", "decode")})
        return {"tokens": tokens[0].tolist(), "candidate": self.slots[tier].current, "tier": tier}

    def op_check_health(self) -> dict:
        """The device still works and the weights are untouched (after a candidate failed)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            x = torch.ones(16, device=self.device)
            if float((x * 2).sum()) != 32.0:
                raise RuntimeError("device arithmetic check failed")
        changed = changed_weight(self.weights, weights_checksum(self.program.model))
        if changed:
            raise RuntimeError(f"the resident weights changed: {changed}")
        return {"ok": True}
