"""The campaign loop: propose, screen on the fast tier, confirm on the slow tier, ship past the noise.

Measurement is behind an ``Evaluator`` (build a candidate for a tier, measure
it, ship or revert it), so the same loop drives the persistent engine over RPC
or an in-process evaluator, and a two-tier campaign can be compared with a
slow-tier-only one under the same budget. Every result goes to the store
before the loop moves on, so a campaign killed at any moment resumes with
``resume=True`` and loses no finished experiment; results already measured for
the same artifact, workload and tier are reused, not re-measured.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from tkcc.agents.noise import NoiseModel, check_aa_pairs
from tkcc.agents.proposer import Candidate, Outcome, Proposer
from tkcc.agents.store import ExperimentStore
from tkcc.errors import TkccError
from tkcc.passes.plan import PassPlan


@dataclass
class EvalResult:
    verdict: str  # measured | invalid | crashed | timeout
    objective: float | None = None
    measurement: dict | None = None
    reason: str | None = None


class Evaluator(Protocol):
    def build(self, candidate: Candidate, tier: str) -> str:
        """Compile (or load) the candidate for a tier; returns its artifact hash. Raises TkccError on failure."""

    def measure(self, artifact_hash: str, tier: str) -> EvalResult:
        """Validate then measure a built artifact on the evaluator's workload."""

    def ship(self, artifact_hash: str) -> None:
        """Swap the (slow-tier) artifact into serving."""

    def workload_fingerprint(self) -> str: ...


@dataclass
class CampaignConfig:
    name: str
    model: str
    budget_s: float
    tiers: tuple[str, ...] = ("fast", "slow")  # ("slow",) for a slow-only campaign
    batch: int = 4  # candidates proposed per round
    promote: int = 1  # fast-tier winners confirmed on the slow tier per round
    aa_pairs: int = 3  # A/A pairs measured before anything can ship
    resume: bool = False
    extra: dict = field(default_factory=dict)


@dataclass
class CampaignState:
    campaign_id: int
    history: list[Outcome]
    shipped: tuple[str, float] | None  # (candidate key, slow objective)
    noise: NoiseModel
    evaluated: dict[str, int]  # tier -> experiments run (not reused) this session
    log: list[str] = field(default_factory=list)
    validation: dict = field(default_factory=dict)  # tier -> the evaluator's validation mode (exact|tolerance, why)


def _say(state: CampaignState, msg: str, progress=None) -> None:
    state.log.append(msg)
    if progress is not None:
        progress.write(msg)


def run_campaign(cfg: CampaignConfig, store: ExperimentStore, proposer: Proposer, evaluator: Evaluator,
                 progress: bool = True) -> CampaignState:
    """Run until the wall-clock budget is spent; returns the final state (also in the store)."""
    if cfg.budget_s <= 0:
        raise TkccError(f"campaign budget must be positive, got {cfg.budget_s} s")
    check_aa_pairs(cfg.aa_pairs)
    if not cfg.tiers or cfg.tiers[-1] != "slow":
        raise TkccError(f"campaign tiers must end with 'slow', got {cfg.tiers}")
    wfp = evaluator.workload_fingerprint()
    validation = validation_modes(evaluator)
    cid = store.open_campaign(cfg.name, cfg.model, {"tiers": cfg.tiers, "budget_s": cfg.budget_s,
                                                   "workload": wfp, "validation": validation, **cfg.extra},
                              resume=cfg.resume)
    state = _restore(store, cid)
    state.validation = validation
    deadline = time.monotonic() + cfg.budget_s
    bar = _progress_bar(cfg, progress)
    for tier, v in validation.items():
        _say(state, f"[{tier}] validation {v.get('why') or v.get('mode')}", bar)
    try:
        baseline = Candidate("baseline", PassPlan())
        base_obj = _evaluate(store, state, evaluator, baseline, "slow", wfp, bar)
        if base_obj is None:
            last = store.experiments(cid)[-1]
            raise TkccError(f"the baseline (empty plan) failed ({last.verdict}: {last.reason}); nothing to compare "
                            f"against")
        if state.shipped is None:
            state.shipped = (baseline.key, base_obj)
            store.record_ship(cid, baseline.key, [], base_obj, "ship", "baseline")
        if len(cfg.tiers) > 1:  # what serves must be known on the screening tier, or nothing can be screened out
            _evaluate(store, state, evaluator, baseline, cfg.tiers[0], wfp, bar)
        _calibrate_noise(cfg, store, state, evaluator, baseline, wfp, bar)
        while time.monotonic() < deadline:
            props = proposer.propose(cfg.batch, state.history)
            if not props:
                _say(state, "proposer has nothing new; stopping early", bar)
                break
            screened = []
            for cand in props:
                if time.monotonic() >= deadline:
                    break
                obj = _evaluate(store, state, evaluator, cand, cfg.tiers[0], wfp, bar)
                if obj is not None:
                    screened.append((obj, cand))
            if len(cfg.tiers) > 1:
                ref = _fast_objective_of_shipped(state)
                for obj, cand in sorted(screened, key=lambda t: -t[0])[: cfg.promote]:
                    if time.monotonic() >= deadline:
                        break
                    if ref is not None and obj <= ref:
                        continue  # no better than what ships on the fast tier: not worth a slow run
                    _confirm(cfg, store, state, evaluator, cand, wfp, bar)
            else:
                for obj, cand in screened:
                    _decide_ship(store, state, evaluator, cand, obj, bar)
        store.set_status(cid, "done")
    except BaseException:
        store.set_status(cid, "failed")
        raise
    finally:
        if bar is not None:
            bar.close()
    return state


def validation_modes(evaluator) -> dict:
    """{tier: {"mode", "why", self-disagreement, bound}} from an evaluator that knows it (the engine's), else {}."""
    out = {}
    for tier, v in (getattr(evaluator, "validation", None) or {}).items():
        keep = ("mode", "source", "deterministic", "self_disagreement_abs", "self_disagreement_norm", "why")
        out[tier] = {k: v[k] for k in keep if k in v}
        if v.get("tolerance"):
            out[tier]["bound"] = v["tolerance"].get("bound")
    return out


def _restore(store: ExperimentStore, cid: int) -> CampaignState:
    history = [Outcome(PassPlan.from_json(e.plan), e.objective, e.tier) for e in store.experiments(cid)]
    ships = [s for s in store.ships(cid)]
    shipped = None
    for s in ships:  # replay ship/revert history
        if s["action"] == "ship":
            shipped = (s["candidate"], s["objective"])
    noise = NoiseModel()
    for e in store.experiments(cid, tier="slow"):
        if e.proposer == "aa" and e.measurement and "aa_pair" in e.measurement:
            noise.aa_diffs.append(e.measurement["aa_pair"])
    return CampaignState(cid, history, shipped, noise, {"fast": 0, "slow": 0})


def _evaluate(store, state, evaluator, cand: Candidate, tier: str, wfp: str, bar, reuse: bool = True):
    started = time.time()
    try:
        ahash = evaluator.build(cand, tier)
    except TkccError as e:
        store.record(state.campaign_id, candidate=cand.key, plan=cand.plan.to_json(), proposer=cand.proposer,
                     workload_fp=wfp, tier=tier, verdict="invalid", reason=f"build failed: {e}", started=started)
        state.history.append(Outcome(cand.plan, None, tier))
        _say(state, f"[{tier}] {cand.key} build failed: {e}", bar)
        return None
    if reuse:
        old = store.reusable(ahash, wfp, tier)
        if old is not None:
            state.history.append(Outcome(cand.plan, old.objective, tier))
            return old.objective
    res = evaluator.measure(ahash, tier)
    store.record(state.campaign_id, candidate=cand.key, plan=cand.plan.to_json(), proposer=cand.proposer,
                 workload_fp=wfp, tier=tier, verdict=res.verdict, objective=res.objective,
                 measurement=res.measurement, artifact_hash=ahash, reason=res.reason, started=started)
    state.evaluated[tier] = state.evaluated.get(tier, 0) + 1
    state.history.append(Outcome(cand.plan, res.objective if res.verdict == "measured" else None, tier))
    if bar is not None:
        bar.update(1)
        bar.set_postfix_str(f"{tier} {cand.key[:8]} {res.verdict} {res.objective or 0:.4g}")
    if res.verdict != "measured":
        _say(state, f"[{tier}] {cand.key} {res.verdict}: {res.reason}", bar)
        return None
    return res.objective


def _calibrate_noise(cfg, store, state, evaluator, baseline, wfp, bar) -> None:
    """Measure the baseline A/A pairs on the slow tier until the noise model is calibrated."""
    while len(state.noise.aa_diffs) < cfg.aa_pairs:
        a = evaluator.measure(evaluator.build(baseline, "slow"), "slow")
        b = evaluator.measure(evaluator.build(baseline, "slow"), "slow")
        if a.verdict != "measured" or b.verdict != "measured":
            raise TkccError(f"A/A calibration failed: {a.reason or b.reason}")
        d = state.noise.add_pair(a.objective, b.objective)
        store.record(state.campaign_id, candidate=baseline.key, plan=[], proposer="aa", workload_fp=wfp,
                     tier="slow", verdict="measured", objective=b.objective,
                     measurement={"aa_pair": d, "a": a.objective, "b": b.objective})


def _fast_objective_of_shipped(state: CampaignState) -> float | None:
    key = state.shipped[0] if state.shipped else None
    vals = [h.objective for h in state.history if h.tier == "fast" and h.objective and h.plan.hash() == key]
    return max(vals) if vals else None


def _confirm(cfg, store, state, evaluator, cand, wfp, bar) -> None:
    obj = _evaluate(store, state, evaluator, cand, "slow", wfp, bar)
    if obj is not None:
        _decide_ship(store, state, evaluator, cand, obj, bar)


def _decide_ship(store, state, evaluator, cand: Candidate, obj: float, bar) -> None:
    cur_key, cur_obj = state.shipped
    ok, why = state.noise.decide(obj, cur_obj)
    if not ok:
        return
    try:  # the engine validates it again, on fresh inputs and shapes, before it serves
        evaluator.ship(evaluator.build(cand, "slow"))
    except TkccError as e:
        store.record_ship(state.campaign_id, cand.key, cand.plan.to_json(), obj, "refused", str(e))
        _say(state, f"not shipped {cand.key}: {e}", bar)
        return
    store.record_ship(state.campaign_id, cand.key, cand.plan.to_json(), obj, "ship", why)
    state.shipped = (cand.key, obj)
    _say(state, f"shipped {cand.key}: {why}", bar)


def _progress_bar(cfg: CampaignConfig, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc=f"campaign {cfg.name}", unit="exp", dynamic_ncols=True)
