"""A shipped candidate that fails on fresh inputs in a later A/A measurement is reverted: what served before it
serves again (shipped through the evaluator), the store records the revert and why, and the search goes on. On an
H200, olmoe-16l's compile died here instead ("A/A calibration failed"), after its fused step had shipped."""
import pytest
from campaign_helpers import FakeClock, Fuse, TimedEvaluator, Wide

from tkcc.agents.campaign import CampaignConfig, EvalResult, run_campaign
from tkcc.agents.search import BayesianSearch, SearchSpace
from tkcc.agents.ship import shipped_chain
from tkcc.agents.store import ExperimentStore
from tkcc.errors import TkccError


class FailsAfterShip(TimedEvaluator):
    """The fused candidate measures fine until it has shipped; its next fast-tier measurement is invalid."""

    def measure(self, ahash, tier):
        fused = bool(self.built[ahash].steps)
        if tier == "fast" and fused and self.shipped and self.shipped[-1].startswith(ahash.split("-")[0]):
            self.clock.t += self.cost[tier]
            self.measured.append((ahash, tier))
            return EvalResult("invalid", None, {"device": "fake"},
                              reason="bucket decode/b1/c81 run 1 output 0: error 0.0531 of the output's scale")
        return super().measure(ahash, tier)


def _run(tmp_path, ev, clock, budget_s=600):
    cfg = CampaignConfig(name="r", model="m", budget_s=budget_s, tiers=("fast", "slow"), started=clock())
    store = ExperimentStore(tmp_path / "e.db")
    state = run_campaign(cfg, store, BayesianSearch(SearchSpace([Fuse, Wide]), seed=0), ev, progress=False, clock=clock)
    return state, store


def test_a_shipped_candidate_failing_its_aa_measurement_is_reverted(tmp_path):
    clock = FakeClock()
    ev = FailsAfterShip(clock)
    state, store = _run(tmp_path, ev, clock)
    ships = store.ships(state.campaign_id)
    actions = [s["action"] for s in ships]
    assert "ship" in actions[1:] and "revert" in actions, actions
    shipped = next(s for s in ships[1:] if s["action"] == "ship")
    rev = next(s for s in ships if s["action"] == "revert")
    assert rev["id"] > shipped["id"]
    assert rev["candidate"] == ships[0]["candidate"]  # what served before: the empty plan
    assert "failed an A/A measurement" in rev["reason"] and "0.0531" in rev["reason"]
    assert rev["detail"]["reverted"] == shipped["candidate"]
    # the evaluator was asked to serve the previous candidate again, right after the failed one
    i = ev.shipped.index(f"{shipped['candidate']}-slow")
    assert ev.shipped[i + 1] == f"{ships[0]['candidate']}-slow", ev.shipped
    # the loop went on after the revert: later experiments were measured, and the budget or the proposer ended it
    after = [e for e in store.experiments(state.campaign_id) if e.started >= rev["time"]]
    assert any(e.verdict == "measured" for e in after)
    assert "A/A calibration failed" not in state.stopped
    chain = shipped_chain(store, state.campaign_id)
    assert chain[-1]["candidate"] == state.shipped[0]
    assert any(d["action"] == "revert" and d["reverted"] == shipped["candidate"] for d in state.decisions)

def test_when_nothing_served_before_the_failure_still_says_why(tmp_path):
    """The first serving candidate (the empty plan: the reference itself) failing an A/A measurement leaves nothing
    to go back to: the campaign ends with the reason, as before."""
    clock = FakeClock()
    ev = FailsAfterShip(clock)

    def measure(ahash, tier, inner=ev.measure):
        if tier == "fast" and not ev.built[ahash].steps and sum(t == "fast" for _, t in ev.measured) >= 1:
            ev.measured.append((ahash, tier))
            return EvalResult("invalid", None, {"device": "fake"}, reason="run 1 output 0: error 0.0531 of scale")
        return inner(ahash, tier)

    ev.measure = measure
    with pytest.raises(TkccError, match="A/A calibration failed.*0.0531"):
        _run(tmp_path, ev, clock)


def test_the_compile_report_says_why_what_serves_came_back(tmp_path):
    """tkcc.compile's loop summary: after a revert, 'why' is the revert's reason (not the reverted ship's), and the
    candidate reverted to is not listed as refused."""
    from types import SimpleNamespace

    from tkcc.agents.noise import NoiseModel
    from tkcc.compiler import _loop_summary

    store = ExperimentStore(tmp_path / "s.db")
    cid = store.open_campaign("c", "m", {}, resume=False)
    store.record_ship(cid, "base", [], 1.0, "ship", "baseline", {"why": "the empty plan serves first"})
    store.record_ship(cid, "fused", [{"name": "f"}], 3.0, "ship", "gain", {"why": "gain +200%: ships"})
    store.record_ship(cid, "base", [], 1.0, "revert", "failed an A/A measurement: reverted to base",
                      {"why": "failed an A/A measurement: reverted to base"})
    state = SimpleNamespace(campaign_id=cid, shipped=("base", 1.0), evaluated={}, noise=NoiseModel(), log=[])
    loop = _loop_summary(store, state, 10.0, SimpleNamespace(device="cpu"), SimpleNamespace(objective="o", source="t"),
                         1.0, True)
    assert loop["serving"] == "base" and "reverted to base" in loop["why"], loop["why"]
    assert loop["refused"] == []
