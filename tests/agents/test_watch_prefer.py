"""A re-optimisation screens first the passes its predecessor measured to beat what served: beside live traffic a
campaign reaches only its first few screening points, and the space's order put the best one out of reach."""
from campaign_helpers import FakeClock, Fuse, Slow, TimedEvaluator, Wide

from tkcc.agents.campaign import CampaignConfig, run_campaign
from tkcc.agents.search import BayesianSearch, SearchSpace
from tkcc.agents.store import ExperimentStore
from tkcc.agents.watch import screened_gains, serving_starts
from tkcc.passes.plan import PassPlan, PassStep

SERVING = PassPlan.of((Wide.name, {"k": 3}))


def _campaign(store, name, budget_s, prefer=None):
    clock = FakeClock()
    search = BayesianSearch(SearchSpace([Slow, Wide, Fuse]), seed=0)
    if prefer is not None:
        search.prefer(prefer)
    cfg = CampaignConfig(name=name, model="m", budget_s=budget_s, tiers=("fast", "slow"), started=clock())
    return run_campaign(cfg, store, search, TimedEvaluator(clock), progress=False, clock=clock,
                        starts=serving_starts(store, None, serving=lambda: SERVING))


def _screened(store, cid) -> list[str]:
    """The passes measured alone at their defaults, in the order the campaign measured them."""
    out = []
    for e in store.experiments(cid):
        if e.proposer == "search" and len(e.plan) == 1 and not e.plan[0].get("params") and e.plan[0]["name"] not in out:
            out.append(e.plan[0]["name"])
    return out


def test_the_gains_a_campaign_measured_rank_the_next_ones_screening(tmp_path):
    store = ExperimentStore(tmp_path / "w.db")
    first = _campaign(store, "w-0", 120)
    assert set(_screened(store, first.campaign_id)) == {Slow.name, Wide.name, Fuse.name}
    gains = dict(screened_gains(store, first.campaign_id))
    assert Slow.name not in gains  # it lost to what served
    assert abs(gains[Fuse.name] - 2.0) < 0.05, gains  # the fake evaluator's x2
    assert screened_gains(store, first.campaign_id)[0][0] == Fuse.name  # best first
    assert screened_gains(store, None) == []

    # a short campaign after it: in the space's order it screens Slow first; told the gains, Fuse first
    plain = _campaign(store, "w-1", 40)
    told = _campaign(store, "w-2", 40, prefer=[n for n, _ in screened_gains(store, first.campaign_id)])
    assert _screened(store, plain.campaign_id)[0] == Slow.name
    assert _screened(store, told.campaign_id)[0] == Fuse.name


def test_prefer_reorders_only_the_screening_and_ignores_unknown_passes():
    search = BayesianSearch(SearchSpace([Slow, Wide, Fuse]), seed=0)
    search.prefer(["not_a_pass", Fuse.name])
    assert [p.steps[0].name for p in search.screening([])] == [Fuse.name, Slow.name, Wide.name]
    first = search.propose(3, [])
    assert [c.plan for c in first] == [PassPlan((PassStep(n, {}),)) for n in (Fuse.name, Slow.name, Wide.name)]
