"""The campaign's budget, A/A sizing, ship reasons and reuse, decided against a fake clock.

Every step of the evaluator here advances a fake clock by a fixed cost, so the
budget decisions (what fits, when to stop, how many A/A pairs) are tested
without depending on the machine's load.
"""
import json

import pytest
from campaign_helpers import FakeClock, Fuse, Slow, TimedEvaluator, Wide

from tkcc.agents.budget import Budget, cost_estimates, up_front
from tkcc.agents.campaign import CampaignConfig, run_campaign
from tkcc.agents.summary import summary_of, summary_text
from tkcc.agents.search import BayesianSearch, SearchSpace
from tkcc.agents.store import ExperimentStore


def _campaign(tmp_path, clock, ev, budget, startup=0.0, name="c", costs=None, tiers=("fast", "slow"),
              passes=(Fuse, Slow), **kw):
    store = ExperimentStore(tmp_path / "s.db")
    cfg = CampaignConfig(name=name, model="m", budget_s=budget, tiers=tiers, started=clock() - startup, **kw)
    state = run_campaign(cfg, store, BayesianSearch(SearchSpace(list(passes)), seed=0), ev, progress=False,
                         clock=clock, costs=costs, costs_source="a test")
    return state, store


def test_the_budget_bounds_the_whole_command_start_up_included(tmp_path):
    clock = FakeClock()
    started = clock() - 10.0  # the engine took 10 s to start
    ev = TimedEvaluator(clock)
    state, store = _campaign(tmp_path, clock, ev, budget=20.0, startup=10.0, reserve_s=1.0)
    assert clock() <= started + 20.0 - 1.0  # nothing ran into the reserve, let alone past the deadline
    assert state.could_try and state.tried >= 1  # 10 s left: a reference (2 s) and candidates (3 s each)
    assert "does not fit" in state.stopped
    session = store.campaign("c")["config"]["sessions"][0]
    assert session["startup_s"] == pytest.approx(10.0) and session["tried"] == state.tried
    assert "tried" in summary_text(summary_of(store, state))


def test_a_budget_too_short_is_said_up_front_with_the_minimum(tmp_path):
    clock = FakeClock()
    ev = TimedEvaluator(clock)
    costs = {"reference:fast": 2.0, "candidate:fast": 3.0, "startup": 10.0}
    state, _ = _campaign(tmp_path, clock, ev, budget=12.0, startup=10.0, costs=costs)
    assert ev.measured == []  # nothing was spent on a campaign that could not try anything
    assert not state.could_try
    assert "too short to try any candidate" in state.stopped and "minimum budget is ~15 s" in state.stopped
    # the CLI says the same before an engine starts, from earlier campaigns' costs
    msg = up_front(12.0, costs, "2 earlier campaigns", "fast")
    assert msg and "minimum budget is ~15 s" in msg
    assert up_front(15.0, costs, "x", "fast") is None
    assert up_front(5.0, {}, "", "fast") is None  # nothing known: nothing to say up front


def test_too_short_found_after_the_reference_says_so_with_the_minimum(tmp_path):
    clock = FakeClock()
    ev = TimedEvaluator(clock)
    state, store = _campaign(tmp_path, clock, ev, budget=13.0, startup=10.0)
    assert ev.measured == [("4f53cda18c2baa0c-fast", "fast")]  # the reference only
    s = summary_of(store, state)
    assert not s["could_try"] and "too short to try any candidate" in s["stopped"]
    assert "minimum budget is ~15 s" in s["stopped"]  # 10 start-up + 2 reference + 1.5 x 2 candidate
    assert "could not try any candidate" in summary_text(s)


def test_aa_pairs_run_on_the_fast_tier_interleaved_with_search_and_sized_to_the_budget(tmp_path):
    pairs = {}
    for budget in (120.0, 600.0):
        clock = FakeClock()
        ev = TimedEvaluator(clock)
        where = tmp_path / f"b{budget:.0f}"
        where.mkdir()
        state, store = _campaign(where, clock, ev, budget=budget, passes=(Wide,))
        rows = store.experiments(state.campaign_id)
        aa = [e for e in rows if e.proposer == "aa"]
        assert aa and all(e.tier == "fast" for e in aa)
        order = [e.proposer for e in rows]
        assert order.index("search") < order.index("aa")  # a candidate is tried before the first A/A pair
        assert all("A/A pair" in e.reason for e in aa)
        pairs[budget] = len(state.noise.aa_diffs)
        assert clock() <= 1000.0 + budget
    assert pairs[120.0] >= 3 and pairs[600.0] > pairs[120.0]


def test_no_aa_pairs_when_the_budget_cannot_reach_a_ship(tmp_path):
    clock = FakeClock()
    ev = TimedEvaluator(clock, cost={"fast": 1.0, "slow": 30.0})
    state, store = _campaign(tmp_path, clock, ev, budget=20.0)
    assert state.tried >= 3
    assert not [e for e in store.experiments(state.campaign_id) if e.proposer == "aa"]
    assert any("no A/A pairs this session" in line for line in state.log)


def test_every_ship_decision_is_recorded_with_its_numbers(tmp_path):
    clock = FakeClock()
    ev = TimedEvaluator(clock)
    state, store = _campaign(tmp_path, clock, ev, budget=300.0)
    decided = [s for s in store.ships(state.campaign_id) if s["action"] in ("ship", "stay", "refused")
               and s["reason"] != "baseline"]
    assert decided and any(s["action"] == "ship" for s in decided)
    for s in decided:
        d = s["detail"]
        assert {"gain", "threshold", "aa_sd", "pairs", "z", "floor"} <= set(d)
        assert "threshold" in s["reason"] and "A/A pairs" in s["reason"]
    summary = summary_of(store, state)
    assert [d["why"] for d in summary["decisions"]] == [s["reason"] for s in decided]
    assert summary["noise"]["calibrated"] and summary["noise"]["threshold"] >= 0.01
    g = summary["gain"]
    assert g["value"] > 1.5 and g["low"] is not None and not g["within_noise"]
    assert "over the baseline" in summary_text(summary)


def test_results_are_reused_only_under_the_same_conditions_and_reuse_is_said(tmp_path):
    clock = FakeClock()
    first, store = _campaign(tmp_path, clock, TimedEvaluator(clock, conditions={"engine": "A"}), 60.0, name="one")
    other = TimedEvaluator(clock, conditions={"engine": "B"})
    second, _ = _campaign(tmp_path, clock, other, 60.0, name="two")
    assert second.reused == []
    assert any("measured under other conditions" in line for line in second.log)
    same = TimedEvaluator(clock, conditions={"engine": "A"})
    third, store = _campaign(tmp_path, clock, same, 60.0, name="three")
    assert third.reused and all(r["campaign_id"] == first.campaign_id for r in third.reused)
    rows = [e for e in store.experiments(third.campaign_id) if e.verdict == "reused"]
    assert rows and all(e.reason.startswith("reused experiment #") and "same artifact, workload, tier and conditions"
                        in e.reason for e in rows)
    stale = TimedEvaluator(clock, conditions={"engine": "A"})
    fourth, _ = _campaign(tmp_path, clock, stale, 60.0, name="four", reuse_max_age_s=-1.0)
    assert fourth.reused == []  # older than the reuse age: measured again


def test_a_refused_ship_keeps_its_reason_with_the_numbers(tmp_path):
    clock = FakeClock()
    ev = TimedEvaluator(clock, refuse=True)
    state, store = _campaign(tmp_path, clock, ev, budget=300.0)
    refused = [s for s in store.ships(state.campaign_id) if s["action"] == "refused"]
    assert refused and "failed re-validation" in refused[0]["reason"] and "threshold" in refused[0]["reason"]
    assert refused[0]["detail"]["gain"] > 0.5
    assert state.shipped[0] == "4f53cda18c2baa0c"  # the baseline still serves
    assert json.loads(json.dumps(summary_of(store, state)))["decisions"][0]["action"] == "refused"


def test_step_costs_are_learnt_and_estimated_from_earlier_campaigns(tmp_path):
    clock = FakeClock()
    b = Budget(100.0, clock(), clock, prior={"reference:slow": 7.0})
    assert b.estimate("candidate:fast") is None and b.fits("candidate:fast")  # unknown: tried while time is left
    b.charge("reference:fast", 2.0)
    assert b.estimate("candidate:fast") == pytest.approx(3.0)  # at least what the reference costs, plus compile
    b.charge("candidate:fast", 4.0)
    assert b.estimate("candidate:fast") == 4.0  # one seen: that one
    b.charge("candidate:fast", 2.5)
    b.charge("candidate:fast", 3.0)
    assert b.estimate("candidate:fast") == 3.0  # the slowest recent one, the first (it paid the compiles) left out
    assert b.estimate("reference:slow") == 7.0  # from an earlier campaign
    clock.t += 97.0
    assert not b.fits("candidate:fast") and b.fits()
    # estimates from a store: the campaigns above, by model (and device where recorded)
    clock = FakeClock()
    state, store = _campaign(tmp_path, clock, TimedEvaluator(clock), 60.0, startup=5.0)
    costs, source = cost_estimates(store, "m")
    assert costs["startup"] == pytest.approx(5.0) and "reference:fast" in costs and "1 earlier" in source
    assert cost_estimates(store, "other-model") == ({}, "")


class ColdStart(TimedEvaluator):
    """The first measurement on a tier also pays one-time compiles (``cold`` seconds more), as the engine's does."""

    def __init__(self, clock, cold, **kw):
        super().__init__(clock, **kw)
        self.cold = dict(cold)

    def measure(self, ahash, tier):
        self.clock.t += self.cold.pop(tier, 0.0)
        return super().measure(ahash, tier)


@pytest.mark.parametrize("budget, ships", [(160.0, True), (100.0, False)])
def test_a_cold_first_measurement_does_not_make_a_watcher_give_up(tmp_path, budget, ships):
    """A server's watcher on an H200 (``screen_only=False``): the serving plan's first fast-tier measurement took
    16.3 s, the next ones 7 s. Its 150 s campaign estimated a ship from the cold one (131 s, 114 s left) and
    screened nothing. Now the first A/A pair measures again first and the estimate leaves the cold one out: 160 s
    screens and ships the 2x candidate (the cold estimate, 130 s, still exceeds the 125 s left there); 100 s is
    short either way and says so."""
    clock = FakeClock()
    ev = ColdStart(clock, {"fast": 9.3}, cost={"fast": 7.0, "slow": 19.0}, build_s=0.0)
    store = ExperimentStore(tmp_path / "s.db")
    cfg = CampaignConfig(name="w", model="m", budget_s=budget, tiers=("fast", "slow"), started=clock())
    state = run_campaign(cfg, store, BayesianSearch(SearchSpace([Fuse, Slow]), seed=0), ev, progress=False,
                         clock=clock, screen_only=False)
    aa = [e for e in store.experiments(state.campaign_id) if e.proposer == "aa"]
    assert aa and "one-time compiles" in aa[0].reason
    if ships:
        assert state.tried >= 1 and any("fuse_budget_test" in {s.name for s in ev.built[h].steps} for h in ev.shipped)
    else:
        assert state.tried == 0 and "nothing measured now could ship" in state.stopped and len(aa) == 1
