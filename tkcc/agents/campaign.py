"""The campaign loop: propose, screen on the fast tier, confirm on the slow tier, ship past the noise.

Measurement is behind an ``Evaluator`` (build a candidate for a tier, measure
it, ship or revert it), so the same loop drives the persistent engine over RPC
or an in-process evaluator, and a two-tier campaign can be compared with a
slow-tier-only one under the same budget.

* **The budget is a wall-clock bound on the whole command** (``tkcc.agents.budget``):
  start-up counts, a step starts only if its estimated cost lets it finish, and
  a budget too short to try one candidate is said to be so, with the minimum.
* **Noise is measured, not assumed, and costs budget like any step:** A/A
  measurements of the serving candidate on the screening tier are interleaved
  with the search (each one pairs with the serving candidate's previous
  measurement); how many is sized to the budget.
* **Every decision is explained:** each experiment row says what was
  concluded from it, and every ship decision (ship, stay, refused) is recorded
  with its numbers: gain, threshold, A/A spread and pairs.
* **Reuse is honest:** a finished result is reused only for the same
  artifact, workload, tier and measurement conditions (``Evaluator.conditions()``:
  the engine session, repetitions, device), from this campaign or a recent one,
  and every reuse is recorded and said.

Every result goes to the store before the loop moves on, so a campaign killed
at any moment resumes with ``resume=True`` and loses no finished experiment.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Protocol

from tkcc.agents.budget import Budget, step_kind
from tkcc.agents.noise import NoiseModel
from tkcc.agents.progress import progress_writer
from tkcc.agents.proposer import Candidate, Outcome, Proposer
from tkcc.agents.store import ExperimentStore
from tkcc.agents.throughput import Throughput, describe
from tkcc.errors import TkccError
from tkcc.passes.plan import PassPlan


@dataclass
class EvalResult:
    verdict: str  # measured | invalid | crashed | timeout
    objective: float | None = None
    measurement: dict | None = None
    reason: str | None = None
    timing: dict | None = None  # seconds per phase (tkcc.agents.throughput.phases_of), when the evaluator knows


class Evaluator(Protocol):
    def build(self, candidate: Candidate, tier: str) -> str:
        """Compile (or load) the candidate for a tier; returns its artifact hash. Raises TkccError on failure."""

    def measure(self, artifact_hash: str, tier: str) -> EvalResult:
        """Validate then measure a built artifact on the evaluator's workload."""

    def ship(self, artifact_hash: str) -> None:
        """Swap the (slow-tier) artifact into serving."""

    def workload_fingerprint(self) -> str: ...

    # Optional:
    #   run_jobs(next_job) -> iterable of BatchResult, as they finish, with ``parallel`` (engines), ``set_serving``,
    #       ``has_reference`` and ``can_decide``: a pool of engines (``tkcc.agents.ray_pool``) that takes every
    #       job of the search (screening, A/A pairs, confirmations, ships) on whichever engine is free;
    #       ``engine``: the name of the engine the first, sequential steps run on.
    #   conditions() -> dict: what else decides a measurement (engine session, repetitions, device);
    #       results are reused only under equal conditions.
    #   tier_scale -> {tier: relative cost}: lets the budget estimate a tier it has not measured yet.
    #   validation -> {tier: {...}}: how each tier validates (shown and recorded).


@dataclass
class Job:
    """One step of the search a pool runs on a free engine: ``kind`` screen (a proposal on the screening
    tier), aa (what serves, measured again), confirm (a promoted candidate on the slow tier) or ship."""

    candidate: Candidate
    tier: str
    kind: str
    retry: dict | None = None  # {engine, why}: the engine that died running it


@dataclass
class BatchResult:
    """One result of ``Evaluator.run_jobs``: a job's, or (``proposer`` set) a measurement the evaluator
    needed to compare it with, e.g. the serving candidate on an engine that had not measured it."""

    candidate: Candidate
    artifact_hash: str | None
    result: EvalResult
    engine: str
    seconds: float
    proposer: str | None = None
    note: str = ""
    job: Job | None = None


@dataclass
class CampaignConfig:
    name: str
    model: str
    budget_s: float
    tiers: tuple[str, ...] = ("fast", "slow")  # ("slow",) for a slow-only campaign
    batch: int = 4  # candidates proposed per round (the built-in search's screening is one round of its own size)
    promote: int = 1  # fast-tier winners confirmed on the slow tier per round
    aa_pairs: int = 3  # A/A pairs needed before anything can ship (more if the budget affords them)
    resume: bool = False
    extra: dict = field(default_factory=dict)
    started: float | None = None  # clock() when the command started: start-up counts against the budget
    reserve_s: float = 0.0  # seconds kept for what runs after the loop (stopping an engine, the summary)
    aa_share: float = 0.2  # share of the search time A/A pairs may take beyond the minimum
    max_aa_pairs: int = 20
    reuse_max_age_s: float = 600.0  # another campaign's result older than this is measured again
    ahead: int = 4  # candidates kept proposed and compiling ahead of the one measured (evaluator.prepare); 0: off


@dataclass
class CampaignState:
    campaign_id: int
    history: list[Outcome]
    shipped: tuple[str, float | None] | None  # (candidate key, slow objective this session, if measured)
    noise: NoiseModel
    evaluated: dict[str, int]  # tier -> experiments run (not reused) this session
    log: list[str] = field(default_factory=list)
    validation: dict = field(default_factory=dict)  # tier -> the evaluator's validation mode (exact|tolerance, why)
    tried: int = 0  # proposed candidates screened this session
    stopped: str = ""  # why the loop ended
    reused: list[dict] = field(default_factory=list)  # results reused instead of measured, and from where
    decisions: list[dict] = field(default_factory=list)  # ship decisions of this session, with their numbers
    budget: dict = field(default_factory=dict)  # Budget.to_json() at the end
    baseline: float | None = None  # the empty plan's slow objective this session, if measured
    throughput: dict = field(default_factory=dict)  # experiments per hour and seconds per phase, this session

    @property
    def could_try(self) -> bool:
        return self.tried > 0


@dataclass
class _Run:
    """Everything one session of the loop works with."""

    cfg: CampaignConfig
    store: ExperimentStore
    proposer: Proposer
    evaluator: Evaluator
    state: CampaignState
    budget: Budget
    wfp: str
    conditions: dict
    out: object  # callable(str) for progress lines, or None
    bar: object = None
    serving_screen: list[float] = field(default_factory=list)  # serving candidate's screening-tier objectives
    serving_slow: float | None = None
    serving_cand: Candidate | None = None
    throughput: Throughput = field(default_factory=Throughput)
    prepared: dict = field(default_factory=dict)  # candidate key -> Candidate, compiling ahead, not measured yet
    served_before: list = field(default_factory=list)  # (shipped, serving_slow, serving_cand, serving_screen) per ship
    out_of_memory: int = 0  # candidates in a row that crashed out of device memory (_device_exhausted)
    stop_event: object = None  # threading.Event: the caller ends the loop (run_campaign's ``stop``)
    screen_only: bool = True  # screen when the budget cannot reach a ship (run_campaign's ``screen_only``)

    def stopped_by_caller(self) -> bool:
        """The caller asked the loop to end: say so once, as why it stopped."""
        if self.stop_event is None or not self.stop_event.is_set():
            return False
        if not self.state.stopped:
            self.state.stopped = "stopped by its caller (a server shutting down)"
        return True

    @property
    def screen(self) -> str:
        return self.cfg.tiers[0]

    @property
    def two_tier(self) -> bool:
        return len(self.cfg.tiers) > 1

    def say(self, msg: str) -> None:
        self.state.log.append(msg)
        if self.out is not None:
            self.out(msg)


def conditions_of(evaluator) -> dict:
    """What decides a measurement besides artifact, workload and tier (``Evaluator.conditions()``), or {}."""
    fn = getattr(evaluator, "conditions", None)
    return dict(fn()) if callable(fn) else {}


def run_campaign(cfg: CampaignConfig, store: ExperimentStore, proposer: Proposer, evaluator: Evaluator,
                 progress=True, *, clock=time.monotonic, costs: dict | None = None, costs_source: str = "",
                 starts: list[Candidate] | None = None, stop=None, screen_only: bool = True) -> CampaignState:
    """Run until the wall-clock budget is spent; returns the final state (also in the store).

    progress: True (a bar and lines on stderr), False, or a callable taking each line.
    clock:    the monotonic clock the budget is kept with (tests pass a fake one).
    costs:    step costs known before the campaign (``tkcc.agents.budget.cost_estimates``), for the
              up-front check; learnt as it runs otherwise.
    starts:   candidates that may serve first (default: the empty plan); with several, each is measured
              on the slow tier and the best ships first.
    stop:     a ``threading.Event``; once set, no further step starts (a server's watcher shutting down: its
              engine goes with it, and the steps after would be recorded as failed builds).
    screen_only: whether to screen candidates when the budget cannot reach a ship (no room for the A/A pairs
              and a confirmation). A server's watcher says False: beside live traffic each measurement costs the
              served requests' latency (x2.5 P90 TPOT on the H200), for results nothing would ship.
    """
    _check_config(cfg)
    wfp = evaluator.workload_fingerprint()
    validation = validation_modes(evaluator)
    conditions = conditions_of(evaluator)
    budget = Budget(cfg.budget_s, cfg.started if cfg.started is not None else clock(), clock, cfg.reserve_s,
                    dict(costs or {}), costs_source, dict(getattr(evaluator, "tier_scale", None) or {}))
    cid = store.open_campaign(cfg.name, cfg.model, {"tiers": cfg.tiers, "budget_s": cfg.budget_s,
                                                   "aa_pairs": cfg.aa_pairs, "workload": wfp,
                                                   "validation": validation, **cfg.extra},
                              resume=cfg.resume)
    state = _restore(store, cid, conditions, cfg.aa_pairs)
    state.validation = validation
    out, bar = progress_writer(f"campaign {cfg.name}", progress)
    run = _Run(cfg, store, proposer, evaluator, state, budget, wfp, conditions, out, bar, stop_event=stop,
               screen_only=screen_only)
    session = _open_session(run)
    try:
        for tier, v in validation.items():
            run.say(f"[{tier}] validation {v.get('why') or v.get('mode')}")
        if len(state.noise.aa_diffs):
            run.say(f"noise: {len(state.noise.aa_diffs)} A/A pair(s) of earlier sessions under the same "
                    f"conditions reused")
        short = budget.too_short(run.screen)
        if short:
            state.stopped = short
            run.say(short)
        elif _start(run, starts or [Candidate("baseline", PassPlan())]):
            _search(run)
        store.set_status(cid, "done")
    except BaseException:
        store.set_status(cid, "failed")
        raise
    finally:
        _cancel_prepared(run)
        state.budget = budget.to_json()
        state.throughput = run.throughput.to_json(budget.spent(), budget.startup_s)
        for line in describe(state.throughput):
            run.say(line)
        _close_session(run, session)
        if bar is not None:
            bar.close()
    return state


def _check_config(cfg: CampaignConfig) -> None:
    if not cfg.budget_s > 0:
        raise TkccError(f"campaign budget must be positive, got {cfg.budget_s} s")
    if not cfg.tiers or cfg.tiers[-1] != "slow":
        raise TkccError(f"campaign tiers must end with 'slow', got {cfg.tiers}")
    if cfg.aa_pairs < 2:
        raise TkccError(f"aa_pairs must be at least 2 (a spread needs two pairs), got {cfg.aa_pairs}")


def validation_modes(evaluator) -> dict:
    """{tier: {"mode", "why", self-disagreement, bound}} from an evaluator that knows it (the engine's), else {}."""
    out = {}
    for tier, v in (getattr(evaluator, "validation", None) or {}).items():
        keep = ("mode", "source", "deterministic", "self_disagreement_abs", "self_disagreement_norm", "why")
        out[tier] = {k: v[k] for k in keep if k in v}
        if v.get("tolerance"):
            out[tier]["bound"] = v["tolerance"].get("bound")
    return out


# ---- sessions (one per run or resume) -------------------------------------------------------------

def _open_session(run: _Run) -> int:
    sessions = list(run.store.campaign(run.state.campaign_id)["config"].get("sessions", []))
    sessions.append({"started": time.time() - run.budget.startup_s, "budget_s": run.cfg.budget_s,
                     "startup_s": round(run.budget.startup_s, 2), "conditions": run.conditions,
                     "workload": run.wfp})
    run.store.update_config(run.state.campaign_id, sessions=sessions)
    return len(sessions) - 1


def _close_session(run: _Run, index: int) -> None:
    st = run.state
    cfg = run.store.campaign(st.campaign_id)["config"]
    sessions = cfg.get("sessions", [])
    if index < len(sessions):
        sessions[index].update(wall_s=round(run.budget.spent(), 2), tried=st.tried, stopped=st.stopped,
                               evaluated=st.evaluated, reused=len(st.reused),
                               aa_pairs=len(st.noise.aa_diffs), budget=st.budget, throughput=st.throughput)
        run.store.update_config(st.campaign_id, sessions=sessions)


def _restore(store: ExperimentStore, cid: int, conditions: dict, min_pairs: int = 3) -> CampaignState:
    """History, serving candidate and the A/A pairs measured under the same conditions, from the store."""
    history = [Outcome(PassPlan.from_json(e.plan), e.objective, e.tier, key=e.candidate, start=e.proposer == "eager")
               for e in store.experiments(cid)
               if e.verdict != "reused"]
    shipped = None
    for s in store.ships(cid):  # replay the ship/revert history
        if s["action"] in ("ship", "revert"):
            shipped = (s["candidate"], s["objective"])
    noise = NoiseModel(min_pairs=min_pairs)
    for e in store.experiments(cid):
        m = e.measurement or {}
        if e.proposer == "aa" and "aa_pair" in m and m.get("conditions", {}) == conditions:
            noise.aa_diffs.append(m["aa_pair"])
    return CampaignState(cid, history, shipped, noise, {"fast": 0, "slow": 0})


# ---- one step: build, reuse or measure, record ----------------------------------------------------

def _reusable(run: _Run, ahash: str, tier: str):
    """The newest result of this artifact on this workload and tier taken under the same conditions, from
    this campaign, or from another one at most ``reuse_max_age_s`` old; (experiment or None, why not)."""
    why_not = ""
    for e in run.store.measurements_of(ahash, run.wfp, tier):
        if (e.measurement or {}).get("conditions", {}) != run.conditions:
            why_not = f"experiment #{e.id} was measured under other conditions"
            continue
        age = time.time() - e.finished
        if e.campaign_id != run.state.campaign_id and age > run.cfg.reuse_max_age_s:
            why_not = why_not or f"experiment #{e.id} is {age / 60:.0f} min old"
            continue
        return e, ""
    return None, why_not


def _evaluate(run: _Run, cand: Candidate, tier: str, *, reuse: bool = True, judge=None,
              proposer: str | None = None, extra=None):
    """Build, then reuse or measure ``cand`` on ``tier``; record the row; returns (objective | None, row id).

    ``judge(objective) -> str`` says what the result means (recorded as the row's reason);
    ``extra(objective) -> dict`` adds fields to the recorded measurement."""
    st, proposer = run.state, proposer or cand.proposer
    kind = step_kind(proposer, tier)
    started, t0 = time.time(), run.budget.clock()
    try:
        ahash = run.evaluator.build(cand, tier)
    except TkccError as e:
        run.budget.charge(kind, run.budget.clock() - t0)
        run.prepared.pop(cand.key, None)
        timing = _timing(getattr(e, "timing", None), run.budget.clock() - t0)
        run.throughput.add(tier, timing, run.budget.clock() - t0)
        rid = run.store.record(st.campaign_id, candidate=cand.key, plan=cand.plan.to_json(), proposer=proposer,
                               workload_fp=run.wfp, tier=tier, verdict="invalid", reason=f"build failed: {e}",
                               started=started, engine=getattr(run.evaluator, "engine", None), timing=timing)
        st.history.append(Outcome(cand.plan, None, tier, key=cand.key, start=cand.eager))
        run.say(f"[{tier}] {cand.key} build failed: {e}")
        return None, rid
    if reuse:
        old, why_not = _reusable(run, ahash, tier)
        if old is not None:
            age = time.time() - old.finished
            where = "this campaign" if old.campaign_id == st.campaign_id else f"campaign #{old.campaign_id}"
            note = (f"reused experiment #{old.id} of {where} ({age:.0f} s old; same artifact, workload, tier and "
                    f"conditions)")
            reason = note + (f"; {judge(old.objective)}" if judge else "")
            rid = run.store.record(st.campaign_id, candidate=cand.key, plan=cand.plan.to_json(), proposer=proposer,
                                   workload_fp=run.wfp, tier=tier, verdict="reused", objective=old.objective,
                                   measurement={**(old.measurement or {}), "reused_from": old.id},
                                   artifact_hash=ahash, reason=reason, started=started)
            st.reused.append({"candidate": cand.key, "tier": tier, "experiment": old.id, "age_s": round(age, 1),
                              "campaign_id": old.campaign_id})
            st.history.append(Outcome(cand.plan, old.objective, tier, key=cand.key, start=cand.eager))
            run.say(f"[{tier}] {cand.key} {note}")
            return old.objective, rid
        if why_not:
            run.say(f"[{tier}] {cand.key} measured again: {why_not}")
    res = run.evaluator.measure(ahash, tier)
    run.budget.charge(kind, run.budget.clock() - t0)
    run.prepared.pop(cand.key, None)
    res.timing = _timing(res.timing, run.budget.clock() - t0)
    run.throughput.add(tier, res.timing, run.budget.clock() - t0)
    measured = res.verdict == "measured" and res.objective is not None
    meas = dict(res.measurement or {})
    meas["conditions"] = run.conditions
    reason = res.reason
    if measured and judge is not None:
        reason = judge(res.objective)
    if measured and extra is not None:
        meas.update(extra(res.objective))
    rid = run.store.record(st.campaign_id, candidate=cand.key, plan=cand.plan.to_json(), proposer=proposer,
                           workload_fp=run.wfp, tier=tier, verdict=res.verdict, objective=res.objective,
                           measurement=meas, artifact_hash=ahash, reason=reason, started=started,
                           engine=getattr(run.evaluator, "engine", None), timing=res.timing)
    st.evaluated[tier] = st.evaluated.get(tier, 0) + 1
    st.history.append(Outcome(cand.plan, res.objective if measured else None, tier, key=cand.key,
                              start=cand.eager))
    if run.bar is not None:
        run.bar.update(1)
        run.bar.set_postfix_str(f"{tier} {cand.key[:8]} {res.verdict} {res.objective or 0:.4g}, "
                                f"{max(0.0, run.budget.deadline - run.budget.clock()):.0f} s left")
    if not measured:
        run.say(f"[{tier}] {cand.key} {res.verdict}: {res.reason}")
        _device_exhausted(run, res)
        return None, rid
    _device_fits(run, cand)
    return res.objective, rid


OUT_OF_MEMORY_STOP = 3  # candidates in a row out of device memory that stop the loop


def _device_fits(run: _Run, cand: Candidate) -> None:
    """A candidate measured: the streak of out-of-memory crashes ends, unless it is what serves (an A/A pair): its
    graphs were resident before, so that it still runs says nothing of room for a new one."""
    if run.serving_cand is None or cand.key != run.serving_cand.key:
        run.out_of_memory = 0


def _device_exhausted(run: _Run, res: EvalResult) -> None:
    """Stop the loop when OUT_OF_MEMORY_STOP candidates in a row crashed out of device memory. The engine already
    ran each once more after freeing its own graphs, so the device no longer fits a candidate beside what stays
    resident (the weights, the KV cache, what serves): proposing more only crashes more (on an H200, 200
    olmoe-16l candidates crashed in a row, one a second, to the end of the budget)."""
    text = (res.reason or "").lower()
    if res.verdict != "crashed" or not ("out of memory" in text or "outofmemory" in text):
        run.out_of_memory = 0
        return
    run.out_of_memory += 1
    if run.out_of_memory >= OUT_OF_MEMORY_STOP and not run.state.stopped:
        last = (res.reason or "").splitlines()[0][:300]
        run.state.stopped = (f"the engine ran out of device memory on {run.out_of_memory} candidates in a row, each "
                             f"after freeing its own CUDA graphs (last: {last}); what serves stays")


# ---- the serving candidate: first measurements, A/A pairs ------------------------------------------

def _start(run: _Run, starts: list[Candidate]) -> bool:
    """Measure what serves first; False when nothing can serve (then the campaign has nothing to compare with)."""
    st = run.state
    if st.shipped is not None:  # resumed: what served at the end of the last session serves now
        plan = next((s["plan"] for s in reversed(run.store.ships(st.campaign_id))
                     if s["candidate"] == st.shipped[0] and s["action"] in ("ship", "revert")), [])
        starts = [Candidate("start", PassPlan.from_json(plan))]
    if len(starts) > 1:
        return _start_best_of(run, starts)
    cand = starts[0]
    obj, _ = _evaluate(run, cand, run.screen, proposer=_ref_proposer(cand),
                       judge=lambda o: f"the serving candidate on the {run.screen} tier (the reference to screen "
                                       f"against)")
    if obj is None:
        raise TkccError(f"the serving candidate {cand.key} failed on the {run.screen} tier "
                        f"({_last_reason(run)}); nothing to compare against")
    run.serving_screen, run.serving_cand = [obj], cand
    if not run.two_tier:
        run.serving_slow = obj
    elif run.budget.cost("reference:slow") is not None and run.budget.fits("reference:slow", f"candidate:{run.screen}"):
        _measure_serving_slow(run)  # optional now (needed at the first confirmation): only when it surely fits
    else:
        why = ("its cost is not known yet" if run.budget.cost("reference:slow") is None
               else "the budget has no room for it before the first candidate")
        run.say(f"the slow tier's reference is measured when a candidate is promoted: {why}")
    if st.shipped is None:
        st.shipped = (cand.key, run.serving_slow)
        why = ("what serves now serves first (the one starting candidate)" if cand.serving
               else "the empty plan serves first (what the engine starts with)" if not cand.plan.steps
               else "the one starting candidate serves first")
        run.store.record_ship(st.campaign_id, cand.key, cand.plan.to_json(), run.serving_slow, "ship", "baseline",
                              {"why": why})
    else:
        st.shipped = (st.shipped[0], run.serving_slow)
    return True


def _ref_proposer(cand: Candidate) -> str:
    if cand.eager:
        return "eager"
    return "baseline" if not cand.plan.steps and cand.artifact_dir is None else "start"


def _start_best_of(run: _Run, starts: list[Candidate]) -> bool:
    """Several candidates may serve first: measure each on the slow tier (and the screening tier); ship the best."""
    st = run.state
    scored = []
    for cand in starts:
        slow, _ = _evaluate(run, cand, "slow", proposer=_ref_proposer(cand),
                            judge=lambda o: "a starting candidate, measured to choose what serves first")
        if slow is not None:
            scored.append((slow, cand))
        elif cand.serving:
            raise TkccError(_unmeasured_serving(cand, "slow", _last_reason(run)))
    if not scored:
        raise TkccError(f"none of the {len(starts)} starting candidates could be measured ({_last_reason(run)})")
    scored.sort(key=lambda t: -t[0])
    screen, failed = None, []
    for slow, cand in scored:  # the best that also measures on the screening tier serves (both tiers compare to it)
        if not run.two_tier:
            break
        screen, _ = _evaluate(run, cand, run.screen, proposer=_ref_proposer(cand),
                              judge=lambda o: f"the serving candidate on the {run.screen} tier")
        if screen is not None:
            break
        if cand.serving:
            raise TkccError(_unmeasured_serving(cand, run.screen, _last_reason(run)))
        failed.append(f"{cand.key} failed on the {run.screen} tier ({_last_reason(run)})")
        run.say(f"starting candidate {failed[-1]}; the next best serves first")
    else:
        raise TkccError(f"no starting candidate measures on both tiers: {'; '.join(failed)}")
    others = ", ".join(f"{c.key} {o:.4g}" for o, c in scored if c is not cand) or "none measured"
    why = f"best of {len(starts)} starting candidates on the slow tier: {cand.key} {slow:.4g} (others: {others})"
    if failed:
        why += f"; skipped: {'; '.join(failed)}"
    run.evaluator.ship(run.evaluator.build(cand, "slow"))
    run.store.record_ship(st.campaign_id, cand.key, cand.plan.to_json(), slow, "ship", "baseline",
                          {"why": why, "starts": {c.key: o for o, c in scored}})
    st.shipped = (cand.key, slow)
    run.serving_slow, run.serving_cand = slow, cand
    run.say(f"serving first: {why}")
    if run.two_tier:
        run.serving_screen = [screen]
    else:
        run.serving_screen = [slow]
    return True


def _unmeasured_serving(cand: Candidate, tier: str, reason: str) -> str:
    """Why a campaign stops when what a server serves could not be measured: nothing was compared with it, so
    nothing may replace it (an H200 watcher swapped a faster forward out for the empty plan this way)."""
    return (f"what serves now ({cand.key}) could not be measured on the {tier} tier ({reason}): nothing else is "
            "compared with it, so nothing replaces it")


def _measure_serving_slow(run: _Run) -> float | None:
    cand = run.serving_cand
    obj, _ = _evaluate(run, cand, "slow", proposer=_ref_proposer(cand),
                       judge=lambda o: "the serving candidate on the slow tier (the reference ship decisions "
                                       "compare with)")
    run.serving_slow = obj
    if obj is not None and not cand.plan.steps:
        run.state.baseline = obj
    if run.state.shipped is not None:
        run.state.shipped = (run.state.shipped[0], obj)
    return obj


def _ship_steps(run: _Run, pairs: int) -> list[str]:
    """The steps between now and a first ship: the missing A/A pairs, a candidate, its confirmation, the ship."""
    steps = [f"reference:{run.screen}"] * pairs + [f"candidate:{run.screen}"]
    if run.two_tier:
        steps += (["reference:slow"] if run.serving_slow is None else []) + ["candidate:slow"]
    return steps + ["ship"]


def _ship_unreachable(run: _Run) -> str:
    steps = _ship_steps(run, max(0, run.cfg.aa_pairs - len(run.state.noise.aa_diffs)))
    return (f"calibrating the noise, confirming and shipping a candidate needs {_est(run, *steps)}, more than the "
            f"{max(0.0, run.budget.left()):.1f} s left")


def _aa_target(run: _Run, left_s: float) -> int:
    """A/A pairs this session aims at: the minimum to ship, plus what ``aa_share`` of the search time buys;
    none when the budget cannot reach a ship at all (then they would only take the candidates' time)."""
    have = len(run.state.noise.aa_diffs)
    need = run.budget.cost(*_ship_steps(run, max(0, run.cfg.aa_pairs - have)))
    if need is not None and need > left_s:
        return have
    ref = run.budget.estimate(f"reference:{run.screen}")
    if not ref:
        return run.cfg.aa_pairs
    extra = int(run.cfg.aa_share * max(0.0, left_s) / ref)
    return max(run.cfg.aa_pairs, min(run.cfg.max_aa_pairs, extra))


def _aa_step(run: _Run, why: str = "") -> bool:
    """One A/A measurement of the serving candidate on the screening tier, paired with its previous one."""
    kind = f"reference:{run.screen}"
    if not run.budget.fits(kind):
        run.state.stopped = (f"budget spent: an A/A measurement ({_est(run, kind)}) does not fit in the "
                             f"{max(0.0, run.budget.left()):.1f} s left")
        return False
    prev = run.serving_screen[-1]
    n = len(run.state.noise.aa_diffs) + 1
    cand = Candidate("aa", run.serving_cand.plan, run.serving_cand.artifact_dir)

    def judge(o):
        return (f"A/A pair {n}: {o:.4g} vs the previous {prev:.4g} ({(o / prev - 1) * 100:+.2f}%)"
                + (f"; {why}" if why else ""))

    obj, _ = _evaluate(run, cand, run.screen, reuse=False, judge=judge, proposer="aa",
                       extra=lambda o: {"aa_pair": o / prev - 1.0, "a": prev, "b": o})
    if obj is None:
        why = _last_reason(run)
        if not run.served_before:
            raise TkccError(f"A/A calibration failed: the serving candidate did not measure ({why})")
        return _revert(run, f"the serving candidate {run.serving_cand.key} failed an A/A measurement on fresh "
                            f"inputs ({why})")
    run.state.noise.add_pair(prev, obj)
    run.serving_screen.append(obj)
    return True


# ---- the search ------------------------------------------------------------------------------------

def _search(run: _Run) -> None:
    """Screen proposals, interleave A/A pairs, confirm the best of each round, until the budget is spent."""
    cfg, st, screen = run.cfg, run.state, run.screen
    queue: list[Candidate] = []
    ahead: list[Candidate] = []  # the next round, proposed early so its kernels compile meanwhile
    round_best: list[tuple[float, Candidate]] = []
    pending: list[tuple[float, Candidate]] = []  # promoted, waiting for their confirmation
    since_aa = 0
    if not run.budget.fits(f"candidate:{screen}"):
        st.stopped = run.budget.too_short(screen, done=True) or _no_room(run, f"candidate:{screen}")
        run.say(st.stopped)
        return
    def reach():  # (A/A pairs to aim at, whether a ship is within the budget)
        target = _aa_target(run, run.budget.left())
        return target, st.noise.calibrated or target > len(st.noise.aa_diffs)

    target, can_ship = reach()
    kind = f"reference:{screen}"
    if not can_ship and not run.screen_only and len(run.budget.seen.get(kind, ())) == 1 and run.budget.fits(kind):
        # the one measurement the estimate rests on paid the engine's one-time compiles: measure the serving
        # candidate again (the first A/A pair, which a ship needs anyway), then judge what the budget reaches
        if not _aa_step(run, why="the first measurement also paid one-time compiles"):
            run.say(f"stopped: {st.stopped}")
            return
        target, can_ship = reach()
    if not can_ship and not run.screen_only:
        st.stopped = f"{_ship_unreachable(run)}: nothing measured now could ship, so nothing is screened"
        run.say(st.stopped)
        return
    if not can_ship:
        run.say(f"no A/A pairs this session: {_ship_unreachable(run)}; candidates are screened only")
    if _pooled(run):
        _search_pool(run, target, can_ship)
        if st.stopped:
            run.say(f"stopped: {st.stopped}")
        return
    while not st.stopped and not run.stopped_by_caller():
        pairs = len(st.noise.aa_diffs)
        if pending and not st.noise.calibrated:
            if not _aa_step(run, why=f"needed before {pending[0][1].key} can be confirmed"):
                break
            since_aa = 0
            continue
        if pending:
            fast_obj, cand = pending.pop(0)
            if not _confirm(run, cand, fast_obj):
                break
            continue
        if pairs < target and since_aa >= (1 if pairs < cfg.aa_pairs else cfg.batch):
            if not _aa_step(run):
                break
            since_aa = 0
            continue
        if not queue:
            if round_best:
                pending = _promote(run, round_best, can_ship)
                round_best = []
                continue
            queue, ahead = ahead or list(run.proposer.propose(cfg.batch, st.history)), []
            if not queue:
                st.stopped = "the proposer has nothing new"
                run.say(f"{st.stopped}; stopping early")
                break
            _prepare(run, queue)
        cand = queue.pop(0)
        if not ahead and _lookahead(run) and len(queue) < _lookahead(run):
            ahead = _propose_ahead(run, queue + [cand])
        if not run.budget.fits(f"candidate:{screen}"):
            st.stopped = _no_room(run, f"candidate:{screen}")
            break
        ref = _serving_screen_ref(run)
        obj, _ = _evaluate(run, cand, screen, judge=lambda o: _screen_verdict(run, o, ref, can_ship))
        st.tried += 1
        since_aa += 1
        if obj is not None:
            if run.two_tier:
                round_best.append((obj, cand))
            elif obj > ref and can_ship:
                pending.append((obj, cand))
    if st.stopped:
        run.say(f"stopped: {st.stopped}")


def _timing(timing: dict | None, seconds: float) -> dict:
    """An experiment's seconds per phase; all of it "other" when the evaluator does not say."""
    return timing or {"critical": {"other": round(max(0.0, seconds), 4)}, "parallel": {}}


def _lookahead(run: _Run) -> int:
    """Candidates to keep compiling ahead: ``ahead`` when the evaluator compiles ahead, else 0."""
    return run.cfg.ahead if getattr(run.evaluator, "compiles_ahead", False) else 0


def _prepare(run: _Run, cands: list[Candidate]) -> None:
    """Hand each candidate's kernel compiles to the evaluator's pool now (screening tier), ahead of its turn."""
    if not _lookahead(run):
        return
    for c in cands:
        if c.key in run.prepared:
            continue
        info = run.evaluator.prepare(c, run.screen)
        if info is not None:
            run.prepared[c.key] = c
            if info.get("queued"):
                run.say(f"[{run.screen}] {c.key}: {info['queued']} kernel compile(s) queued ahead "
                        f"({info.get('cached', 0)} cached)")


def _propose_ahead(run: _Run, queued: list[Candidate]) -> list[Candidate]:
    """The next round, proposed before this one is measured (the queued candidates count as proposed), and
    prepared at once: the pool compiles its kernels while the engine measures this round."""
    pending = [Outcome(c.plan, None, run.screen, key=c.key, pending=True) for c in queued]
    nxt = list(run.proposer.propose(run.cfg.batch, run.state.history + pending))
    _prepare(run, nxt)
    return nxt


def _cancel_prepared(run: _Run) -> None:
    """The campaign stops: candidates compiling ahead that were never measured give their compiles back."""
    cancel = getattr(run.evaluator, "cancel", None)
    for c in list(run.prepared.values()):
        if callable(cancel):
            try:
                cancel(c)
            except TkccError:
                pass
    run.prepared.clear()


def _pooled(run: _Run) -> bool:
    """Does the evaluator run jobs on a pool of engines (``run_jobs``)?"""
    return callable(getattr(run.evaluator, "run_jobs", None))


@dataclass
class _Pool:
    """What the search on a pool has in flight (``_search_pool``)."""

    queue: list = field(default_factory=list)  # proposed, not sent yet
    rounds: dict = field(default_factory=dict)  # round -> {"left": screenings not back, "best": [(obj, cand)]}
    round_of: dict = field(default_factory=dict)  # candidate key -> its round
    pending: list = field(default_factory=list)  # [(screening objective, cand)] promoted, waiting to be confirmed
    in_flight: dict = field(default_factory=dict)  # candidate key -> Candidate, screening now
    aa: int = 0  # A/A measurements in flight
    decide: Job | None = None  # the confirmation or ship in flight (one at a time: each follows what serves)
    ship: tuple | None = None  # (Job, decision, slow objective, its raw measurement) of the ship decided
    ship_to: str | None = None  # the engine the decided ship waits for (the one that confirmed it)
    since_aa: int = 0
    screened: dict = field(default_factory=dict)  # candidate key -> (engine, raw screening objective)
    revert: str | None = None  # why what served before is being shipped again (``_pool_revert``), while it is sent
    stale: Job | None = None  # a confirmation measured against a candidate since reverted: not decided on


def _search_pool(run: _Run, target: int, can_ship: bool) -> None:
    """The search on a pool of engines: every free engine is given the next job, so none waits for another.

    Which job, in order: a ship waiting for that engine; a confirmation, on an engine of the home engine's
    device model that has measured what serves on the slow tier (or on any of them when none has); an A/A
    measurement when the noise needs one; else the next proposal. A/A pairs are measured on every engine of
    that device model, each paired with that engine's own previous measurement; a candidate's objective is
    scaled by what serves measured on its own engine (``RayEvaluator``), so engines compare with themselves."""
    ev, st, cfg, screen, pool = run.evaluator, run.state, run.cfg, run.screen, _Pool()
    ev.set_serving(screen, run.serving_cand, _serving_screen_ref(run), {ev.engine: run.serving_screen[-1]})
    if run.two_tier:
        ev.set_serving("slow", run.serving_cand, run.serving_slow,
                       {ev.engine: run.serving_slow} if run.serving_slow is not None else None)

    def stop(why: str) -> None:
        st.stopped = st.stopped or why

    def fits(engine: str, tier: str, kind: str) -> bool:
        steps = ([] if ev.has_reference(engine, tier) else [f"reference:{tier}"]) + [kind]
        if run.budget.fits(*steps):
            return True
        stop(_no_room(run, *steps))
        return False

    def next_job(engine: str) -> Job | None:
        decides = ev.can_decide(engine)
        if pool.ship_to is not None and decides and (pool.ship_to == engine or pool.ship_to not in ev.engines()):
            pool.ship_to = None  # a ship decided is carried out even when the budget stops the search: it fitted
            return pool.ship[0]
        if st.stopped or run.stopped_by_caller():
            return None
        if pool.revert is not None:
            return None  # what serves is being put back: nothing is measured against the one that failed
        if decides and pool.pending and pool.decide is None and st.noise.calibrated and not run.two_tier:
            obj, cand = pool.pending.pop(0)  # one tier: the screening measurement decides; no confirmation
            if not run.budget.fits("ship"):
                run.say(f"not shipped {cand.key}: {_no_room(run, 'ship', what=f'shipping it')}; screening goes on")
            else:
                _pool_decide(run, pool, cand, engine, obj, None, pool.screened[cand.key][1])
                if pool.ship_to == engine:
                    pool.ship_to = None
                    return pool.ship[0]
        if decides and pool.pending and pool.decide is None and st.noise.calibrated:
            others = [e for e in ev.engines() if e != engine and ev.can_decide(e) and ev.has_reference(e, "slow")]
            if ev.has_reference(engine, "slow") or not others:
                steps = ([] if ev.has_reference(engine, "slow") else ["reference:slow"]) + ["candidate:slow", "ship"]
                cand = pool.pending.pop(0)[1]
                if run.budget.fits(*steps):
                    pool.decide = Job(cand, "slow", "confirm")
                    return pool.decide
                # the other engines need not stop for it: screening goes on while a screening step fits
                run.say(f"not confirmed {cand.key}: {_no_room(run, *steps, what='confirming and shipping it')}; "
                        f"screening goes on")
        pairs = len(st.noise.aa_diffs) + pool.aa
        wants_aa = (pool.pending and not st.noise.calibrated and pairs < max(target, cfg.aa_pairs)) or (
            pairs < target and pool.since_aa >= (1 if pairs < cfg.aa_pairs else cfg.batch))
        if decides and wants_aa:
            if not fits(engine, screen, f"reference:{screen}"):
                return None
            pool.aa, pool.since_aa = pool.aa + 1, 0
            return Job(Candidate("aa", run.serving_cand.plan, run.serving_cand.artifact_dir), screen, "aa")
        if not pool.queue:
            queued = [Outcome(c.plan, None, screen, key=c.key, pending=True) for c in pool.in_flight.values()]
            pool.queue = list(run.proposer.propose(cfg.batch, st.history + queued))
            if not pool.queue:
                if not (pool.in_flight or pool.pending or pool.decide or pool.aa):
                    stop("the proposer has nothing new")
                    run.say(f"{st.stopped}; stopping early")
                return None
            r = len(pool.rounds)
            pool.rounds[r] = {"left": len(pool.queue), "best": []}
            pool.round_of.update({c.key: r for c in pool.queue})
            _prepare(run, pool.queue)
        if not fits(engine, screen, f"candidate:{screen}"):
            return None
        cand = pool.queue.pop(0)
        pool.in_flight[cand.key] = cand
        return Job(cand, screen, "screen")

    for r in ev.run_jobs(next_job):
        kind = r.job.kind if r.job is not None and r.proposer is None else "reference"
        if kind == "ship":
            _pool_shipped(run, pool, r)
            continue
        obj, rid = _record_pool_result(run, r, kind, can_ship)
        if kind == "reference" and r.result.verdict == "measured" and r.candidate.key == run.serving_cand.key:
            if r.job.tier == "slow" and run.serving_slow is None:  # the first slow measurement sets its units
                run.serving_slow = obj
                st.shipped = (st.shipped[0], obj)
                if not run.serving_cand.plan.steps:
                    st.baseline = obj
        elif kind == "aa":
            pool.aa -= 1
            if obj is None and r.job.retry:  # its engine died: another A/A measurement takes its place
                continue
            if obj is None:
                why = f"{r.result.verdict}: {r.result.reason}"
                if not run.served_before:
                    raise TkccError(f"A/A calibration failed: the serving candidate did not measure on {r.engine} "
                                    f"({why})")
                if r.candidate.plan.hash() == run.serving_cand.plan.hash():
                    _pool_revert(run, pool, r.engine, f"the serving candidate {run.serving_cand.key} failed an A/A "
                                                      f"measurement on {r.engine} on fresh inputs ({why})")
                continue
            m = r.result.measurement
            st.noise.add_pair(m["a"], m["b"])
        elif kind == "screen":
            _pool_screened(run, pool, r, obj, rid, can_ship)
        elif kind == "confirm":
            pool.decide = None
            if obj is not None and r.job is pool.stale:
                run.say(f"not decided {r.candidate.key}: what serves was reverted while it was confirmed")
            elif obj is not None:
                _pool_decide(run, pool, r.candidate, r.engine, obj, rid,
                             (r.result.measurement or {}).get("raw_objective", obj))
    if not st.stopped:
        st.stopped = "no engine left could take the next step"


def _pool_screened(run: _Run, pool: _Pool, r: BatchResult, obj, rid, can_ship: bool) -> None:
    """A screening result: count it, and once its round is back, promote the round's best."""
    st, cand = run.state, r.candidate
    st.tried += 1
    pool.since_aa += 1
    pool.in_flight.pop(cand.key, None)
    if obj is not None:
        pool.screened[cand.key] = (r.engine, (r.result.measurement or {}).get("raw_objective", obj))
    rnd = pool.rounds.get(pool.round_of.pop(cand.key, None))
    if rnd is None:
        return
    rnd["left"] -= 1
    if obj is not None:
        rnd["best"].append((obj, cand))
    if rnd["left"] > 0:
        return
    if run.two_tier:
        pool.pending += _promote(run, rnd["best"], can_ship)
    elif can_ship:  # one tier: the round's best is decided on its screening measurement
        pool.pending += [t for t in sorted(rnd["best"], key=lambda t: -t[0])[:1] if t[0] > _serving_screen_ref(run)]


def _pool_decide(run: _Run, pool: _Pool, cand: Candidate, engine: str, obj: float, rid, raw: float) -> None:
    """A confirmation is back (``obj`` on ``engine``, ``raw`` unscaled): ship there, or record why not."""
    d = _decision(run, cand, obj, rid)
    if not d["ship"]:
        _ship_done(run, cand, obj, d)
        return
    job = Job(cand, "slow", "ship")
    pool.decide, pool.ship_to, pool.ship = job, engine, (job, d, obj, raw)


def _pool_revert(run: _Run, pool: _Pool, engine: str, why: str) -> None:
    """A shipped candidate failed an A/A measurement on ``engine``: what served before it is shipped there again
    (a ship job, which the engine validates before it serves) before anything else is sent; ``_pool_shipped``
    records the revert. A ship already decided goes first: it replaces the failed candidate itself."""
    if pool.revert is not None:
        return
    if pool.ship is not None:
        run.say(f"{why}; the ship of {pool.ship[0].candidate.key} already decided replaces it")
        return
    job = Job(run.served_before[-1][2], "slow", "ship")
    pool.revert, pool.ship_to, pool.ship = why, engine, (job, None, None, None)
    pool.stale = pool.decide


def _pool_shipped(run: _Run, pool: _Pool, r: BatchResult) -> None:
    """A ship is back: record it; what serves moves to the new candidate on every engine."""
    if pool.revert is not None:
        why, pool.revert, pool.ship = pool.revert, None, None
        run.budget.charge("ship", r.seconds)
        if _reverted(run, why, None if r.result.verdict == "shipped" else (r.result.reason or r.result.verdict)):
            ev = run.evaluator
            ev.set_serving(run.screen, run.serving_cand, _serving_screen_ref(run))
            if run.two_tier:
                ev.set_serving("slow", run.serving_cand, run.serving_slow)
        return
    _, d, obj, raw_slow = pool.ship
    pool.decide, pool.ship = None, None
    run.budget.charge("ship", r.seconds)
    d["ship_s"], d["engine"] = r.seconds, r.engine
    err = None if r.result.verdict == "shipped" else (r.result.reason or r.result.verdict)
    _ship_done(run, r.candidate, obj, d, err)
    if err is None:
        ev, cand = run.evaluator, r.candidate
        engine, raw = pool.screened.get(cand.key, (None, None))
        ev.set_serving(run.screen, cand, _serving_screen_ref(run), {engine: raw} if engine else None)
        if run.two_tier:
            ev.set_serving("slow", cand, obj, {r.engine: raw_slow})


def _record_pool_result(run: _Run, r: BatchResult, kind: str, can_ship: bool):
    """Record one result of the pool as it arrives, naming its engine; returns (objective | None, row id)."""
    st, cand, res, tier = run.state, r.candidate, r.result, r.job.tier
    proposer = r.proposer or ("aa" if kind == "aa" else cand.proposer)
    run.budget.charge(step_kind("reference" if kind == "reference" else proposer, tier), r.seconds)
    if kind == "screen":
        run.prepared.pop(cand.key, None)
    res.timing = _timing(res.timing, r.seconds)
    run.throughput.add(tier, res.timing, r.seconds)
    measured = res.verdict == "measured" and res.objective is not None
    meas = {**(res.measurement or {}), "conditions": run.conditions}
    reason = res.reason
    if measured and kind == "screen":
        reason = _screen_verdict(run, res.objective, _serving_screen_ref(run), can_ship)
    elif measured and kind == "aa":
        reason = (f"A/A pair {len(st.noise.aa_diffs) + 1} on {r.engine}: {meas['b']:.4g} vs its previous "
                  f"{meas['a']:.4g} ({meas['aa_pair'] * 100:+.2f}%)")
    elif measured and kind == "confirm":
        reason = "confirmation: " + st.noise.explain(res.objective, run.serving_slow)["why"]
    reason = "; ".join(x for x in (reason, r.note) if x)
    rid = run.store.record(st.campaign_id, candidate=cand.key, plan=cand.plan.to_json(), proposer=proposer,
                           workload_fp=run.wfp, tier=tier, verdict=res.verdict, objective=res.objective,
                           measurement=meas, artifact_hash=r.artifact_hash, reason=reason,
                           started=time.time() - r.seconds, engine=r.engine, timing=res.timing)
    st.evaluated[tier] = st.evaluated.get(tier, 0) + 1
    if kind in ("screen", "confirm"):
        st.history.append(Outcome(cand.plan, res.objective if measured else None, tier, key=cand.key,
                                  start=cand.eager))
    if run.bar is not None:
        run.bar.update(1)
    if not measured:
        run.say(f"[{tier}] {cand.key} on {r.engine} {res.verdict}: {reason}")
        _device_exhausted(run, res)
    else:
        _device_fits(run, cand)
        if r.note:
            run.say(f"[{tier}] {cand.key} on {r.engine}: {r.note}")
    return (res.objective if measured else None), rid


def _serving_screen_ref(run: _Run) -> float:
    return statistics.median(run.serving_screen)


def _screen_verdict(run: _Run, obj: float, ref: float, can_ship: bool = True) -> str:
    g = obj / ref - 1
    head = f"{obj:.4g} vs serving {ref:.4g} on the {run.screen} tier ({g * 100:+.2f}%)"
    if obj <= ref:
        return f"{head}: no better than what serves" + (", not confirmed" if run.two_tier else ": stays")
    if not can_ship:
        return f"{head}: better, but the budget cannot calibrate the noise and confirm it"
    return f"{head}: " + ("a promotion candidate (best of its round is confirmed)" if run.two_tier
                          else "ship decision follows")


def _promote(run: _Run, screened: list[tuple[float, Candidate]], can_ship: bool = True):
    """The round's best, if it beats what serves on the screening tier (and a ship can be reached)."""
    ref = _serving_screen_ref(run)
    best = sorted(screened, key=lambda t: -t[0])[: run.cfg.promote]
    # once the noise is known, a gain under the ship rule's floor cannot ship: not worth a slow measurement
    bar = ref * (1 + run.state.noise.floor) if run.state.noise.calibrated else ref
    chosen = [(o, c) for o, c in best if o > bar]
    for o, c in chosen:
        run.say(f"[{run.screen}] {'promoting' if can_ship else 'would promote'} {c.key}: {o:.4g} vs serving "
                f"{ref:.4g} ({(o / ref - 1) * 100:+.2f}%)" + ("" if can_ship else ", but a ship is out of budget"))
    return chosen if can_ship else []


def _confirm(run: _Run, cand: Candidate, screen_obj: float) -> bool:
    """Measure a promoted candidate on the slow tier (two tiers) and decide; False when the budget is spent."""
    steps = ["ship"]
    if run.two_tier:
        steps.insert(0, "candidate:slow")
        if run.serving_slow is None:
            steps.insert(0, "reference:slow")
    if not run.budget.fits(*steps):
        run.state.stopped = _no_room(run, *steps, what=f"confirming and shipping {cand.key}")
        return False
    if not run.two_tier:
        _decide_ship(run, cand, screen_obj)
        return True
    if run.serving_slow is None and _measure_serving_slow(run) is None:
        raise TkccError(f"the serving candidate failed on the slow tier ({_last_reason(run)})")
    cur = run.serving_slow
    obj, rid = _evaluate(run, cand, "slow", judge=lambda o: "confirmation: " + run.state.noise.explain(o, cur)["why"])
    if obj is not None:
        _decide_ship(run, cand, obj, rid)
    return True


def _decide_ship(run: _Run, cand: Candidate, obj: float, exp_id: int | None = None) -> None:
    """Ship ``cand`` if its gain beats the noise; record the decision, its reason and numbers, either way."""
    d = _decision(run, cand, obj, exp_id)
    err = None
    if d["ship"]:
        t0 = run.budget.clock()
        try:  # the engine validates it again, on fresh inputs and shapes, before it serves
            run.evaluator.ship(run.evaluator.build(cand, "slow"))
        except TkccError as e:
            err = str(e)
        d["ship_s"] = run.budget.clock() - t0
        run.budget.charge("ship", d["ship_s"])
    _ship_done(run, cand, obj, d, err)


def _decision(run: _Run, cand: Candidate, obj: float, exp_id: int | None) -> dict:
    """The ship rule's verdict on ``cand`` (slow objective ``obj``) against what serves, with its numbers."""
    d = run.state.noise.explain(obj, run.serving_slow)
    d.update(candidate=cand.key, serving=run.state.shipped[0], experiment=exp_id, aa_tier=run.screen)
    return d


def _ship_done(run: _Run, cand: Candidate, obj: float, d: dict, err: str | None = None) -> None:
    """Record a ship decision (ship, stay, or refused when re-validating it before serving failed)."""
    st = run.state
    if d["ship"] and err is not None:
        d.update(action="refused", why=f"{d['why']}, but re-validation before serving failed: {err}")
    elif d["ship"]:
        d["action"] = "ship"
        run.served_before.append((st.shipped, run.serving_slow, run.serving_cand, list(run.serving_screen)))
        st.shipped = (cand.key, obj)
        run.serving_slow, run.serving_cand = obj, cand
        run.serving_screen = [o.objective for o in st.history if o.tier == run.screen and o.objective
                              and o.plan.hash() == cand.plan.hash()][-1:] or run.serving_screen
    else:
        d["action"] = "stay"
    run.store.record_ship(st.campaign_id, cand.key, cand.plan.to_json(), obj, d["action"], d["why"], d)
    st.decisions.append(d)
    run.say(f"{'shipped' if d['action'] == 'ship' else 'not shipped'} {cand.key}: {d['why']}")


def _revert(run: _Run, why: str) -> bool:
    """A shipped candidate failed on fresh inputs after it shipped: what served before it serves again (shipped
    through the evaluator, which validates it), recorded as a revert with ``why``; the search goes on. False
    (the loop stops, what serves stays) when the one before cannot be shipped either."""
    cand = run.served_before[-1][2]
    try:
        run.evaluator.ship(run.evaluator.build(cand, "slow"))
    except TkccError as e:
        return _reverted(run, why, str(e))
    return _reverted(run, why)


def _reverted(run: _Run, why: str, err: str | None = None) -> bool:
    """Record the revert to what served before (``err``: shipping it failed, so the loop stops) and put it back
    as what serves; the sequential loop's and the pool's alike."""
    st = run.state
    shipped, slow, cand, screen = run.served_before[-1]
    failed = st.shipped[0]
    if err is not None:
        st.stopped = f"{why}; reverting to {cand.key} failed too ({err})"
        run.store.record_ship(st.campaign_id, failed, run.serving_cand.plan.to_json(), st.shipped[1], "refused",
                              st.stopped, {"why": st.stopped, "action": "refused", "revert_to": cand.key})
        run.say(st.stopped)
        return False
    run.served_before.pop()
    d = {"action": "revert", "why": f"{why}: reverted to {cand.key}", "candidate": cand.key, "reverted": failed}
    run.store.record_ship(st.campaign_id, cand.key, cand.plan.to_json(), slow, "revert", d["why"], d)
    st.decisions.append(d)
    st.shipped, run.serving_slow, run.serving_cand, run.serving_screen = shipped, slow, cand, screen
    run.say(f"reverted {failed}: {d['why']}")
    return True


def _est(run: _Run, *kinds: str) -> str:
    c = run.budget.cost(*kinds)
    return "unknown cost" if c is None else f"~{c:.1f} s"


def _no_room(run: _Run, *kinds: str, what: str | None = None) -> str:
    what = what or ("another " + " + ".join(k.replace(":", " on the ") + " tier" for k in kinds))
    return f"budget spent: {what} ({_est(run, *kinds)}) does not fit in the {max(0.0, run.budget.left()):.1f} s left"


def _last_reason(run: _Run) -> str:
    rows = run.store.experiments(run.state.campaign_id)
    return f"{rows[-1].verdict}: {rows[-1].reason}" if rows else "no result"


__all__ = ["BatchResult", "CampaignConfig", "Job", "CampaignState", "EvalResult", "Evaluator", "run_campaign", "validation_modes",
           "conditions_of"]
