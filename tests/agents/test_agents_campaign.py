"""Campaign loop logic against a deterministic evaluator: tiers, shipping, reuse, resume, bad input.

The evaluator here is a test double for the engine (the loop's contract is the
Evaluator protocol); the engine-backed evaluator has its own integration test.
Each measurement advances a fake clock by a fixed cost, and the campaign keeps
its budget with that clock, so what fits in a budget does not depend on the
machine's load.
"""
import random

import pytest
from campaign_helpers import FakeClock

from tkcc.agents.campaign import CampaignConfig, EvalResult, run_campaign
from tkcc.agents.search import BayesianSearch, SearchSpace
from tkcc.agents.store import ExperimentStore
from tkcc.errors import TkccError
from tkcc.passes.base import Pass


class Fuse(Pass):
    name, params = "fuse_test", {"block": [16, 64]}


class Slow(Pass):
    name, params = "slow_test", {}


class SyntheticEvaluator:
    """Objective = 100 x (2 if fuse_test) x (0.5 if slow_test) x noise; fast tier costs 1/5 of slow."""

    def __init__(self, noise=0.002, cost_s=0.002, seed=0, fail_plans=(), clock=None):
        self.noise, self.cost_s, self.rng = noise, cost_s, random.Random(seed)
        self.clock = clock or FakeClock()  # _run gives it the campaign's clock
        self.built, self.measured, self.shipped, self.fail_plans = {}, [], [], set(fail_plans)

    def workload_fingerprint(self):
        return "wl-test"

    def build(self, cand, tier):
        h = f"{cand.key}-{tier}"
        self.built[h] = cand.plan
        return h

    def measure(self, ahash, tier):
        plan = self.built[ahash]
        self.clock.t += self.cost_s * (1 if tier == "fast" else 5)
        self.measured.append((ahash, tier))
        names = {s.name for s in plan.steps}
        if names & self.fail_plans:
            return EvalResult("invalid", reason="outputs differ from golden")
        v = 100.0 * (2 if "fuse_test" in names else 1) * (0.5 if "slow_test" in names else 1)
        return EvalResult("measured", v * (1 + self.rng.gauss(0, self.noise)), {"ms": 1 / v})

    def ship(self, ahash):
        self.shipped.append(ahash)


def _run(tmp_path, tiers=("fast", "slow"), budget=1.0, resume=False, ev=None, name="c"):
    ev = ev or SyntheticEvaluator()
    clock = ev.clock  # the budget is kept in the evaluator's fake seconds
    store = ExperimentStore(tmp_path / "s.db")
    cfg = CampaignConfig(name=name, model="m", budget_s=budget, tiers=tiers, resume=resume, started=clock())
    state = run_campaign(cfg, store, BayesianSearch(SearchSpace([Fuse, Slow]), seed=0), ev, progress=False,
                         clock=clock)
    return state, store, ev


def test_ships_the_real_gain_only(tmp_path):
    state, store, ev = _run(tmp_path)
    ships = store.ships(state.campaign_id)
    assert ships[0]["reason"] == "baseline"
    assert any(s["plan"] and s["plan"][0]["name"] == "fuse_test" for s in ships[1:])
    for s in ships[1:]:
        assert all(step["name"] != "slow_test" for step in s["plan"])
    assert state.shipped[1] > 150


def test_two_tiers_screen_more_candidates_than_slow_only(tmp_path):
    # a budget the slow tier alone runs out of (12 slow measurements would try all 7 plans), the two tiers not;
    # a store each, so neither reuses the other's measurements
    (tmp_path / "two").mkdir(), (tmp_path / "one").mkdir()
    two, _, _ = _run(tmp_path / "two", budget=0.1, name="two")
    one, _, _ = _run(tmp_path / "one", tiers=("slow",), budget=0.1, name="one")
    assert two.evaluated["fast"] + two.evaluated["slow"] > one.evaluated["slow"]
    assert two.tried > one.tried and "budget spent" in one.stopped


def test_resume_reuses_and_loses_nothing(tmp_path):
    state, store, ev = _run(tmp_path, budget=0.3)
    n_before = len(store.experiments(state.campaign_id))
    measured_before = len(ev.measured)
    ev2 = SyntheticEvaluator()
    state2, store2, _ = _run(tmp_path, budget=0.3, resume=True, ev=ev2)
    rows = store2.experiments(state2.campaign_id)
    assert len(rows) >= n_before
    assert measured_before > 0
    # the baseline's slow measurement and the A/A calibration were reused from the store, not re-measured
    from tkcc.passes.plan import PassPlan

    assert f"{PassPlan().hash()}-slow" not in [a for a, _ in ev2.measured]
    assert {e.candidate for e in rows[:n_before]} <= {e.candidate for e in rows}
    assert state2.shipped is not None and len(state2.noise.aa_diffs) >= 3


def test_failed_candidates_are_recorded_never_shipped(tmp_path):
    ev = SyntheticEvaluator(fail_plans={"fuse_test"})
    state, store, _ = _run(tmp_path, ev=ev, budget=0.4)
    bad = [e for e in store.experiments(state.campaign_id) if e.verdict == "invalid"]
    assert bad and all("golden" in e.reason for e in bad)
    assert all(not s["plan"] or s["plan"][0]["name"] != "fuse_test" for s in store.ships(state.campaign_id))


def test_bad_budget_and_tiers(tmp_path):
    with pytest.raises(TkccError, match="budget"):
        _run(tmp_path, budget=0)
    with pytest.raises(TkccError, match="tiers"):
        _run(tmp_path, tiers=("slow", "fast"))


def test_revert_when_new_traffic_makes_shipped_slower(tmp_path):
    from tkcc.agents.ship import recheck_and_revert, shipped_chain

    state, store, ev = _run(tmp_path, budget=0.5)
    assert shipped_chain(store, state.campaign_id)[-1]["plan"]  # a fused plan ships first

    class DriftedEvaluator(SyntheticEvaluator):
        """New traffic: the fused kernel now costs 3x (e.g. contexts it was not tuned for)."""

        def measure(self, ahash, tier):
            res = super().measure(ahash, tier)
            if res.objective and "fuse_test" in {s.name for s in self.built[ahash].steps}:
                res.objective /= 3
            return res

    drifted = DriftedEvaluator()
    out = recheck_and_revert(store, state.campaign_id, drifted, state.noise)
    assert out.reverted and "reverting" in out.reason
    assert store.ships(state.campaign_id)[-1]["action"] == "revert"
    assert drifted.shipped  # the better candidate was swapped back in
    # nothing to do on a second recheck: what serves is best
    again = recheck_and_revert(store, state.campaign_id, drifted, state.noise)
    assert not again.reverted


@pytest.mark.parametrize("serving", [False, True])
def test_a_recheck_loads_what_a_live_server_serves_as_serving(tmp_path, serving):
    """In a server's watcher the shipped candidate is rebuilt as the server's own forward (no isolation
    account in the engine); its predecessor and the empty plan are fresh candidates; outside a server, all are."""
    from tkcc.agents.ship import recheck_and_revert, shipped_chain

    state, store, _ = _run(tmp_path, budget=0.5)
    current = shipped_chain(store, state.campaign_id)[-1]
    assert current["plan"]

    class Recording(SyntheticEvaluator):
        def build(self, cand, tier):
            self.flags = getattr(self, "flags", []) + [(cand.proposer, cand.plan.hash(), cand.serving)]
            return super().build(cand, tier)

    ev = Recording()
    recheck_and_revert(store, state.campaign_id, ev, state.noise, serving=serving)
    checked = [(h, s) for who, h, s in ev.flags if who == "recheck"]
    assert len(checked) >= 2 and checked[0][0] == current["candidate"]
    assert [s for _, s in checked] == [serving] + [False] * (len(checked) - 1)


def test_report_html(tmp_path):
    from tkcc.agents.report import write_report

    state, store, _ = _run(tmp_path, budget=0.3)
    out = write_report(tmp_path / "s.db", "c", tmp_path / "r" / "report.html")
    html = out.read_text()
    assert html.count("data:image/png;base64,") >= 2
    assert "Ship decisions" in html and "baseline" in html and "Noise threshold" in html
    n = len(store.experiments(state.campaign_id))
    assert html.count("<td class=\"reason\">") == n + len(store.ships(state.campaign_id))  # a reason per row
    assert "fuse_test(block=" in html  # candidates with their plans, not only hashes
    pages = {p.name for p in (tmp_path / "r" / "report_files").glob("*.html")}
    assert {f"{e.candidate}.html" for e in store.experiments(state.campaign_id)} == pages


def test_a_candidate_that_fails_revalidation_at_ship_time_is_refused_and_the_campaign_goes_on(tmp_path):
    """The engine re-validates on fresh shapes when shipping; a failure there is recorded, nothing ships."""
    from tkcc.errors import TkccError

    class RefusingEvaluator(SyntheticEvaluator):
        def ship(self, ahash):
            if "fuse_test" in {s.name for s in self.built[ahash].steps}:
                raise TkccError(f"shipping {ahash} failed re-validation: bucket decode/b1/c1465 differs")
            super().ship(ahash)

    state, store, ev = _run(tmp_path, ev=RefusingEvaluator())
    ships = store.ships(state.campaign_id)
    refused = [s for s in ships if s["action"] == "refused"]
    assert refused and all(s["plan"][0]["name"] == "fuse_test" for s in refused)
    assert "failed re-validation" in refused[0]["reason"]
    assert not any(s["action"] == "ship" and s["plan"] for s in ships if s["plan"] and s["plan"][0]["name"] == "fuse_test")
    assert state.shipped[1] < 150  # the 2x candidate never became the shipped one


class _CrashingEvaluator(SyntheticEvaluator):
    """Every candidate with a pass crashes with ``reason``; the empty plan measures."""

    def __init__(self, reason, **kw):
        super().__init__(**kw)
        self.reason = reason

    def measure(self, ahash, tier):
        if self.built[ahash].steps:
            self.clock.t += self.cost_s
            self.measured.append((ahash, tier))
            return EvalResult("crashed", reason=self.reason)
        return super().measure(ahash, tier)


def test_a_device_out_of_memory_for_every_candidate_stops_the_loop(tmp_path):
    oom = ("fast tier: during validate: OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 GiB ... "
           "109.15 GiB is allocated by PyTorch in private pools")
    state, store, ev = _run(tmp_path, ev=_CrashingEvaluator(oom), budget=100.0)
    crashed = [e for e in store.experiments(state.campaign_id) if e.verdict == "crashed"]
    assert len(crashed) == 3  # not a crash a step to the end of the budget
    assert "out of device memory on 3 candidates in a row" in state.stopped and "Tried to allocate" in state.stopped
    assert state.shipped is not None and not store.ships(state.campaign_id)[-1]["plan"]  # what serves stays


def test_other_crashes_do_not_stop_the_loop_as_device_exhaustion(tmp_path):
    state, store, ev = _run(tmp_path, ev=_CrashingEvaluator("fast tier: during measure: IndexError in kernel"),
                            budget=0.5)
    crashed = [e for e in store.experiments(state.campaign_id) if e.verdict == "crashed"]
    assert len(crashed) > 3 and "out of device memory" not in state.stopped


class _Pass(Pass):
    params = {}


def _passes(n):
    return [type(f"P{i}", (_Pass,), {"name": f"screen_order_test_{i}"}) for i in range(n)]


class _LastBestEvaluator(SyntheticEvaluator):
    """Pass i alone gives 100 x (1.1 + 0.01 i), the last one 100 x 3.6: the best single pass comes last."""

    def __init__(self, n, **kw):
        super().__init__(**kw)
        self.n = n

    def measure(self, ahash, tier):
        self.clock.t += self.cost_s * (1 if tier == "fast" else 5)
        self.measured.append((ahash, tier))
        v = 100.0
        for s in self.built[ahash].steps:
            i = int(s.name.rsplit("_", 1)[1])
            v *= 3.6 if i == self.n - 1 else 1.1 + 0.01 * i
        return EvalResult("measured", v * (1 + self.rng.gauss(0, self.noise)), {})


def test_the_whole_screening_is_one_round_so_the_best_single_pass_is_promoted_first(tmp_path):
    """Promoting the best of each batch-sized piece of the screening shipped a pass that comes early in the registry
    (x1.34 on an H200) before the best one (x3.6, eighth) was ever measured; the first promotion is the best."""
    passes = _passes(10)
    ev = _LastBestEvaluator(10)
    store = ExperimentStore(tmp_path / "s.db")
    cfg = CampaignConfig(name="order", model="m", budget_s=0.3, batch=4, started=ev.clock())
    state = run_campaign(cfg, store, BayesianSearch(SearchSpace(passes), seed=0), ev, progress=False, clock=ev.clock)
    promoted = [line for line in state.log if "promoting" in line]
    ships = [s for s in store.ships(state.campaign_id) if s["plan"]]
    assert promoted and ships
    assert ships[0]["plan"] == [{"name": "screen_order_test_9", "params": {}}]
    first_slow = next(i for i, (h, t) in enumerate(ev.measured) if t == "slow" and ev.built[h].steps)
    screened = {ev.built[h].steps[0].name for h, t in ev.measured[:first_slow] if t == "fast" and ev.built[h].steps}
    assert len(screened) == 10  # every pass alone was measured before anything was confirmed


@pytest.mark.parametrize("after", [1, 3, 6])
def test_a_caller_stop_ends_the_loop_before_its_next_step(tmp_path, after):
    """A server shutting down sets ``stop``: the campaign starts no further step (each one after would fail on
    the engine going away and be recorded as a failed build) and says why it stopped."""
    import threading

    stop = threading.Event()

    class Stopping(SyntheticEvaluator):
        def measure(self, ahash, tier):
            res = super().measure(ahash, tier)
            if len(self.measured) == after:
                stop.set()
            return res

    ev = Stopping()
    store = ExperimentStore(tmp_path / "s.db")
    cfg = CampaignConfig(name="c", model="m", budget_s=1.0, tiers=("fast", "slow"), started=ev.clock())
    state = run_campaign(cfg, store, BayesianSearch(SearchSpace([Fuse, Slow]), seed=0), ev, progress=False,
                         clock=ev.clock, stop=stop)
    assert len(ev.measured) == after
    assert state.stopped == "stopped by its caller (a server shutting down)"
    full, _, _ = _run(tmp_path / "full")  # the same campaign unstopped measures more
    assert len(full.history) > len(state.history)


@pytest.mark.parametrize("budget", [0.016, 0.02, 0.025])
def test_a_budget_that_cannot_ship_screens_only_when_allowed(tmp_path, budget):
    """With step costs known up front and no room for the A/A pairs and a confirmation, a campaign screens
    candidates (the default) or, ``screen_only=False`` (a server's watcher, beside live traffic), measures
    nothing more than its start and says why."""
    costs = {"reference:fast": 0.002, "candidate:fast": 0.002, "reference:slow": 0.01, "candidate:slow": 0.01,
             "ship": 0.001}

    def run(screen_only, where):
        ev = SyntheticEvaluator()
        store = ExperimentStore(where / "s.db")
        cfg = CampaignConfig(name="c", model="m", budget_s=budget, tiers=("fast", "slow"), started=ev.clock())
        st = run_campaign(cfg, store, BayesianSearch(SearchSpace([Fuse, Slow]), seed=0), ev, progress=False,
                          clock=ev.clock, costs=costs, screen_only=screen_only)
        return st, ev

    screened, ev1 = run(True, tmp_path / "a")
    assert screened.tried >= 2 and any("screened only" in line for line in screened.log)
    held, ev2 = run(False, tmp_path / "b")
    assert held.tried == 0 and "nothing measured now could ship, so nothing is screened" in held.stopped
    assert len(ev2.measured) < len(ev1.measured) and len(store_ships := ExperimentStore(tmp_path / "b" / "s.db")
                                                          .ships(held.campaign_id)) == 1
    assert store_ships[0]["reason"] == "baseline"  # what served stays
