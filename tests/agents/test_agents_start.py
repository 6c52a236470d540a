"""What serves first: the best starting candidate that measures on both tiers (both compare against it). A start
that the screening tier refuses is skipped with its reason, never the campaign's end without one."""
import pytest
from campaign_helpers import FakeClock, Fuse, TimedEvaluator

from tkcc.agents.campaign import CampaignConfig, EvalResult, run_campaign
from tkcc.agents.proposer import Candidate
from tkcc.agents.search import BayesianSearch, SearchSpace
from tkcc.agents.store import ExperimentStore
from tkcc.errors import TkccError
from tkcc.passes.plan import PassPlan


class FastRefuses(TimedEvaluator):
    """The fused start measures fastest on the slow tier and is invalid on the fast one."""

    def __init__(self, clock, refuse_all=False):
        super().__init__(clock)
        self.refuse_all = refuse_all

    def measure(self, ahash, tier):
        if tier == "fast" and (self.refuse_all or self.built[ahash].steps):
            self.clock.t += self.cost[tier]
            self.measured.append((ahash, tier))
            return EvalResult("invalid", None, {"device": "fake"},
                              reason="a timed call's cache state differs by 0.11 of scale")
        return super().measure(ahash, tier)


def _run(tmp_path, ev, clock, serving=False):
    cfg = CampaignConfig(name="s", model="m", budget_s=60, tiers=("fast", "slow"), started=clock())
    store = ExperimentStore(tmp_path / "e.db")
    starts = [Candidate("start", PassPlan.of((Fuse.name, {"block": 16})), serving=serving),
              Candidate("baseline", PassPlan())]
    return run_campaign(cfg, store, BayesianSearch(SearchSpace([Fuse]), seed=0), ev, progress=False, clock=clock,
                        starts=starts), store


def test_a_start_refused_on_the_screening_tier_gives_way_to_the_next(tmp_path):
    clock = FakeClock()
    ev = FastRefuses(clock)
    state, store = _run(tmp_path, ev, clock)
    ships = store.ships(state.campaign_id)
    assert ships[0]["candidate"] == Candidate("baseline", PassPlan()).key, ships[0]
    assert "failed on the fast tier" in ships[0]["detail"]["why"] and "cache state differs" in ships[0]["detail"]["why"]


def test_what_a_server_serves_is_replaced_by_nothing_when_it_cannot_be_measured(tmp_path):
    """The same refusal, where the start is what a live server serves: nothing was compared with it, so the
    campaign ships nothing (an H200 watcher swapped a faster forward out for the empty plan)."""
    clock = FakeClock()
    ev = FastRefuses(clock)
    with pytest.raises(TkccError, match=r"what serves now \(\w+\) could not be measured on the fast tier "
                                        r"\(.*cache state differs.*nothing replaces it"):
        _run(tmp_path, ev, clock, serving=True)
    assert not ev.shipped


def test_no_start_on_both_tiers_names_each_reason(tmp_path):
    clock = FakeClock()
    with pytest.raises(TkccError, match="no starting candidate measures on both tiers.*cache state differs"):
        _run(tmp_path, FastRefuses(clock, refuse_all=True), clock)


def test_a_re_optimisation_starts_from_what_serves(tmp_path):
    """The watch loop's next campaign starts from what serves (a server's alone): started from the empty
    plan alone, a campaign that found nothing better shipped it, and the server swapped a faster forward out."""
    from tkcc.agents.watch import serving_starts

    store = ExperimentStore(tmp_path / "w.db")
    cid = store.open_campaign("w-0", "m", {}, resume=False)
    assert serving_starts(store, None) is None and serving_starts(store, cid) is None
    fused = PassPlan.of((Fuse.name, {"block": 64}))
    store.record_ship(cid, PassPlan().hash(), [], 100.0, "ship", "baseline")
    store.record_ship(cid, fused.hash(), fused.to_json(), 200.0, "ship", "gain")
    starts = serving_starts(store, cid)
    assert [c.plan for c in starts] == [fused, PassPlan()] and starts[0].key == fused.hash()
    store.record_ship(cid, PassPlan().hash(), [], 100.0, "revert", "the baseline measures better now")
    assert serving_starts(store, cid) is None  # reverted to the empty plan: the campaign's own default
    # a server's watcher: what the server serves alone (the recheck after a drift compares it with the empty
    # plan), before any ship (its own default plan) and after; loaded as what serves already
    exact = PassPlan.of(("cse", {}), ("dce", {}))
    for cid_now in (None, cid):
        starts = serving_starts(store, cid_now, serving=lambda: exact)
        assert [(c.plan, c.serving) for c in starts] == [(exact, True)] and starts[0].key == exact.hash()
    assert serving_starts(store, cid, serving=lambda: PassPlan()) is None
    assert serving_starts(store, cid, serving=lambda: None) is None  # a forward without a plan


def test_a_servers_campaign_measures_what_serves_and_never_the_empty_plan(tmp_path):
    """A server's watcher campaign screens against what serves and spends nothing on the empty plan (the recheck
    after a drift covers it); its one start is loaded as serving and stays what serves when nothing beats it."""
    from tkcc.agents.watch import serving_starts

    clock = FakeClock()
    ev = TimedEvaluator(clock)
    serving = PassPlan.of((Fuse.name, {"block": 16}))
    store = ExperimentStore(tmp_path / "e.db")
    cfg = CampaignConfig(name="w", model="m", budget_s=30, tiers=("fast", "slow"), started=clock())
    state = run_campaign(cfg, store, BayesianSearch(SearchSpace([Fuse]), seed=0), ev, progress=False, clock=clock,
                         starts=serving_starts(store, None, serving=lambda: serving))
    starts = {(e.candidate, e.tier) for e in store.experiments(state.campaign_id) if e.proposer in ("start", "baseline")}
    assert starts == {(serving.hash(), "fast"), (serving.hash(), "slow")}, starts  # no empty plan among them
    first = store.ships(state.campaign_id)[0]
    assert first["candidate"] == serving.hash() and "what serves now" in first["detail"]["why"]
    assert not ev.shipped  # nothing was swapped in: what served is what serves

    clock = FakeClock()
    with pytest.raises(TkccError, match="the serving candidate .* failed on the fast tier .*cache state differs"):
        run_campaign(CampaignConfig(name="w2", model="m", budget_s=30, tiers=("fast", "slow"), started=clock()),
                     ExperimentStore(tmp_path / "e2.db"), BayesianSearch(SearchSpace([Fuse]), seed=0),
                     FastRefuses(clock), progress=False,
                     clock=clock, starts=serving_starts(store, None, serving=lambda: serving))
