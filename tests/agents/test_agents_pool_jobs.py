"""The campaign on a pool of engines (``RayEvaluator.run_jobs`` + ``campaign._search_pool``), on a simulated
clock: Ray is replaced by a scheduler of simulated engines, so who does what, and who waits, is exact.

* No engine waits while another decides: A/A pairs, confirmations and ships are jobs any engine takes when
  it is free, so both engines are busy all the loop long and both measure A/A pairs.
* Each engine is compared with itself: engine-1 measures everything at half the speed, yet a plan's
  screening objective is the same wherever it ran; an A/A pair is two measurements on one engine.
* The best plan ships on the engine that confirmed it, against what serves measured on that engine.
"""
import random
import types

from tkcc.agents.campaign import CampaignConfig, run_campaign
from tkcc.agents.proposer import Candidate
from tkcc.agents.ray_pool import RayEvaluator
from tkcc.agents.store import ExperimentStore
from tkcc.passes.plan import PassPlan

SPEED = {"engine-0": 1.0, "engine-1": 0.5}  # engine-1 is a GPU half as fast
SECONDS = {"fast": 1.0, "slow": 2.0, "ship": 1.5}
GOOD, GAIN = 5, 1.3  # the sixth plan proposed is 30% faster; the others 5-15% slower


def _gain_of(plan: list) -> float:
    if not plan:
        return 1.0
    i = plan[0]["params"]["i"]
    return GAIN if i == GOOD else 0.85 + 0.1 * (i % 3) / 2


def _gain(cand: Candidate) -> float:
    return _gain_of(cand.plan.to_json())


class _Call:
    def __init__(self, sim, engine, fn):
        self.sim, self.engine, self.fn = sim, engine, fn

    def remote(self, *args):
        return self.sim.run(self.engine, self.fn, args)


class _Engine:
    """A simulated engine actor: each call runs after the previous one, for its simulated seconds."""

    def __init__(self, sim, name):
        self.sim, self.name = sim, name

    def __getattr__(self, method):
        return _Call(self.sim, self.name, getattr(self, "_" + method))

    def _result(self, cand, tier):
        noise = 1 + self.sim.rng.gauss(0, 0.002)
        return 100.0 * _gain(cand) * SPEED[self.name] * noise

    def _evaluate(self, cand, tier):
        from tkcc.agents.campaign import EvalResult

        self.sim.built[f"{tier}-{cand.key}"] = cand
        t = self.sim.seconds[tier]
        return (f"{tier}-{cand.key}", EvalResult("measured", self._result(cand, tier)), t), t

    def _ship_candidate(self, cand):
        from tkcc.agents.campaign import EvalResult

        self.sim.ships.append((self.name, cand.key))
        return (f"slow-{cand.key}", EvalResult("shipped"), self.sim.seconds["ship"]), self.sim.seconds["ship"]

    def _build(self, cand, tier):
        self.sim.built[f"{tier}-{cand.key}"] = cand
        return f"{tier}-{cand.key}", 0.0

    def _measure(self, key, tier):
        from tkcc.agents.campaign import EvalResult

        return EvalResult("measured", self._result(self.sim.built[key], tier)), self.sim.seconds[tier]

    def _ship(self, key):
        self.sim.ships.append((self.name, self.sim.built[key].key))
        return None, self.sim.seconds["ship"]

    def _stop(self):
        return None, 0.0


class _Future:
    def __init__(self, done_at, value):
        self.done_at, self.value = done_at, value


class Sim:
    """Stands in for the ``ray`` module: ``wait`` returns the call that finishes first and moves the clock."""

    exceptions = types.SimpleNamespace(RayActorError=type("RayActorError", (Exception,), {}))

    def __init__(self, seconds=SECONDS):
        self.now, self.rng, self.seconds = 0.0, random.Random(0), dict(seconds)
        self.free = dict.fromkeys(SPEED, 0.0)
        self.busy: dict[str, list] = {n: [] for n in SPEED}  # (start, end) of each call
        self.built, self.ships = {}, []

    def remote(self, **_):
        return lambda cls: cls

    def run(self, engine, fn, args):
        value, seconds = fn(*args)
        start = max(self.now, self.free[engine])
        self.free[engine] = start + seconds
        if seconds:
            self.busy[engine].append((start, start + seconds))
        return _Future(start + seconds, value)

    def wait(self, futures, num_returns=1, timeout=None):
        ready = sorted(futures, key=lambda f: f.done_at)[:num_returns]
        if timeout == 0:
            ready = [f for f in ready if f.done_at <= self.now]
        if ready:
            self.now = max(self.now, ready[-1].done_at)
        return ready, [f for f in futures if f not in ready]

    def get(self, f):
        if isinstance(f, list):
            return [self.get(x) for x in f]
        self.now = max(self.now, f.done_at)
        return f.value

    def kill(self, *_, **__):
        pass


class Plans:
    """Proposes plan 0, 1, 2, ... in order, ``n`` at a time."""

    def __init__(self):
        self.i = 0

    def propose(self, n, history):
        out = [Candidate("search", PassPlan.of(("p", {"i": i}))) for i in range(self.i, self.i + n)]
        self.i += n
        return out


class _Workload:
    def fingerprint(self):
        return "sim"


def _pool(sim: Sim) -> RayEvaluator:
    ev = RayEvaluator.__new__(RayEvaluator)
    ev._init_pool(sim, 1, 0.0, {}, 5, [], None)
    ev._handles = {n: _Engine(sim, n) for n in SPEED}
    ev.workload = _Workload()
    ev._adopt([{"name": n, "model": "sim", "device": "sim-gpu", "device_type": "cuda", "validation": {},
                "tier_scale": {"fast": 1.0, "slow": 2.0}, "conditions": {}, "compiles_ahead": False}
               for n in SPEED])
    return ev


def test_every_engine_takes_screening_aa_pairs_and_confirmations_so_none_waits(tmp_path):
    sim = Sim()
    ev = _pool(sim)
    store = ExperimentStore(tmp_path / "store.db")
    cfg = CampaignConfig(name="sim", model="sim", budget_s=120, batch=4, aa_pairs=3)
    state = run_campaign(cfg, store, Plans(), ev, progress=False, clock=lambda: sim.now)
    rows = store.experiments(state.campaign_id)
    end = max(e for spans in sim.busy.values() for _, e in spans)
    start = min(s for s, _ in sim.busy["engine-1"])  # the pool starts once the home engine has measured the baseline
    for engine, spans in sim.busy.items():  # busy at least 90% of the loop: nobody waits for a decision
        busy = sum(min(e, end) - max(s, start) for s, e in spans if e > start)
        assert busy >= 0.9 * (end - start), (engine, busy, end - start)
    aa = [r for r in rows if r.proposer == "aa"]
    assert {r.engine for r in aa} == set(SPEED) and len(aa) >= cfg.aa_pairs
    for r in aa:  # a pair is two measurements of what serves on one engine: b now, a its previous one there
        m = r.measurement
        assert m["b"] == r.objective and abs(m["a"] / (100.0 * SPEED[r.engine] * _gain_of(r.plan)) - 1) < 0.01
    screened = [r for r in rows if r.proposer == "search" and r.tier == "fast"]
    assert {r.engine for r in screened} == set(SPEED)
    ref = next(r.objective for r in rows if r.proposer == "baseline" and r.tier == "fast")
    for r in screened:  # scaled by its own engine's reference: the plan's gain, whatever engine measured it
        assert abs(r.objective / ref / _gain_of(r.plan) - 1) < 0.01, (r.engine, r.objective, ref)
    good = PassPlan.of(("p", {"i": GOOD})).hash()
    (confirm,) = [r for r in rows if r.tier == "slow" and r.proposer == "search"]
    assert confirm.candidate == good
    assert [r for r in rows if r.engine == confirm.engine and r.tier == "slow" and r.id < confirm.id
            and r.proposer in ("engine-reference", "baseline")]  # what serves, measured on that engine first
    assert sim.ships == [(confirm.engine, good)]
    (d,) = [d for d in state.decisions if d["action"] == "ship"]
    assert d["candidate"] == good and d["engine"] == confirm.engine and abs(d["gain"] - (GAIN - 1)) < 0.01


def test_a_confirmation_that_does_not_fit_is_dropped_and_the_engines_screen_to_the_end(tmp_path):
    # a slow tier so slow that a ship is reachable when the search starts, but not once a candidate is promoted
    slow = {"reference:slow": 16.5, "candidate:slow": 16.5, "ship": 1.5}
    sim = Sim({**SECONDS, "slow": 16.5})
    ev = _pool(sim)
    store = ExperimentStore(tmp_path / "store.db")
    cfg = CampaignConfig(name="tail", model="sim", budget_s=40, batch=4, aa_pairs=3)
    lines = []
    state = run_campaign(cfg, store, Plans(), ev, progress=lines.append, clock=lambda: sim.now,
                         costs=slow)
    rows = store.experiments(state.campaign_id)
    assert not [r for r in rows if r.tier == "slow" and r.proposer == "search"] and sim.ships == []
    assert any(line.startswith(f"not confirmed {PassPlan.of(('p', {'i': GOOD})).hash()}") for line in lines), lines
    end = max(e for spans in sim.busy.values() for _, e in spans)
    assert end > 40 - 2 * SECONDS["fast"], (end, state.stopped)  # both engines went on screening to the end
    assert state.stopped.startswith("budget spent: another candidate on the fast tier")


class _FailsAfterShip(_Engine):
    """The best plan measures fine until it has shipped; its first A/A measurement after that is invalid."""

    def _evaluate(self, cand, tier):
        from tkcc.agents.campaign import EvalResult

        if cand.proposer == "aa" and _gain(cand) == GAIN and not self.sim.failed:
            self.sim.failed.append((self.name, self.sim.now))
            t = self.sim.seconds[tier]
            return (f"{tier}-{cand.key}", EvalResult("invalid", None, reason="output 0: error 0.0531 of scale"), t), t
        return super()._evaluate(cand, tier)


def test_a_shipped_candidate_failing_an_aa_measurement_on_the_pool_is_reverted(tmp_path):
    """On a pool, as in the one-engine loop (test_agents_aa_revert.py): what served before is shipped again on the
    engine where the A/A measurement failed, recorded as a revert, every engine is told what serves, and the
    search goes on; before this, the pool's campaign raised 'A/A calibration failed'."""
    sim = Sim()
    sim.failed = []
    ev = _pool(sim)
    ev._handles = {n: _FailsAfterShip(sim, n) for n in SPEED}
    store = ExperimentStore(tmp_path / "store.db")
    cfg = CampaignConfig(name="revert", model="sim", budget_s=200, batch=4, aa_pairs=3, max_aa_pairs=12)
    state = run_campaign(cfg, store, Plans(), ev, progress=False, clock=lambda: sim.now)
    good = PassPlan.of(("p", {"i": GOOD})).hash()
    (engine, when), = sim.failed
    actions = [(d["action"], d["candidate"]) for d in state.decisions]
    base = state.decisions[[a for a, _ in actions].index("revert")]["candidate"]
    assert actions[-2:] == [("ship", good), ("revert", base)], actions
    assert state.decisions[-1]["reverted"] == good and "failed an A/A measurement" in state.decisions[-1]["why"]
    assert [s for s in sim.ships if s[1] == base] == [(engine, base)]  # shipped again where the failure was seen
    assert state.shipped[0] == base and "A/A calibration failed" not in (state.stopped or "")
    assert ev._serving["slow"][0].key == base and ev._serving["fast"][0].key == base
    assert any(s > when for spans in sim.busy.values() for s, _ in spans)  # the engines went on after it
    assert [s["action"] for s in store.ships(state.campaign_id)][-1] == "revert"
