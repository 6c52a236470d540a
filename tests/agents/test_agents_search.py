"""Built-in search: it must learn which passes help from measured outcomes."""
import math

from tkcc.agents.proposer import Outcome
from tkcc.agents.search import BayesianSearch, SearchSpace
from tkcc.passes.base import Pass
from tkcc.passes.plan import PassPlan


def _space():
    class Good(Pass):
        name, params = "good", {"block": [16, 32, 64]}

    class Bad(Pass):
        name, params = "bad", {}

    class Neutral(Pass):
        name, params = "neutral", {"x": [0, 1]}

    return SearchSpace([Good, Bad, Neutral])


def _objective(plan: PassPlan) -> float:
    """Hidden truth: 'good' doubles the objective (more with block 64), 'bad' halves it."""
    names = {s.name: s.params for s in plan.steps}
    v = 1.0
    if "good" in names:
        v *= 2.0 * (1.2 if names["good"].get("block") == 64 else 1.0)
    if "bad" in names:
        v *= 0.5
    return v


def test_search_finds_the_good_plan():
    space = _space()
    search = BayesianSearch(space, seed=1)
    history = [Outcome(PassPlan(), 1.0, "fast")]
    for _ in range(6):
        for c in search.propose(3, history):
            history.append(Outcome(c.plan, _objective(c.plan), "fast"))
    best = max(history, key=lambda h: h.objective)
    names = {s.name: s.params for s in best.plan.steps}
    assert "good" in names and names["good"]["block"] == 64 and "bad" not in names
    mean, _, _ = search.posterior(history)
    assert mean[search.index[("good",)]] > 0 > mean[search.index[("bad",)]]


def test_search_never_reproposes_and_penalises_failures():
    space = _space()
    search = BayesianSearch(space, seed=2)
    history = [Outcome(PassPlan.of("bad"), None, "fast"), Outcome(PassPlan(), 1.0, "fast")]
    props = search.propose(5, history)
    hashes = [c.plan.hash() for c in props]
    assert len(set(hashes)) == len(hashes)
    assert not {h.plan.hash() for h in history} & set(hashes)
    mean, _, _ = search.posterior(history)
    assert mean[search.index[("bad",)]] < -0.5
    assert math.isfinite(float(mean.sum()))


def _steps(plan: PassPlan) -> dict:
    return {s.name: dict(s.params) for s in plan.steps}


def _one_step_apart(a: PassPlan, b: PassPlan) -> bool:
    """One pass toggled, or one parameter of one pass changed (SearchSpace.mutate's moves)."""
    x, y = _steps(a), _steps(b)
    if set(x) ^ set(y):
        return len(set(x) ^ set(y)) == 1 and all(x[k] == y[k] for k in set(x) & set(y))
    return sum(sum(x[k].get(p) != y[k].get(p) for p in set(x[k]) | set(y[k])) for k in x) == 1


def test_a_campaign_from_a_tuned_plan_alternates_its_neighbours_with_the_screening():
    """A watcher's campaign starts from what serves: neighbours of the best plan the screening did not propose
    (what serves, until a neighbour beats it) and the screening's single passes alternate, the first proposal a
    neighbour; without such a plan the screening comes first, all of it."""
    space = _space()
    serving = PassPlan.from_json([{"name": "good", "params": {"block": 32}}, {"name": "neutral", "params": {"x": 1}}])
    singles = {PassPlan.of(n).hash() for n in ("good", "bad", "neutral")}
    for seed in range(5):
        search = BayesianSearch(space, seed=seed)
        history = [Outcome(serving, 2.0, "fast")]
        kinds = []
        for _ in range(5):
            best = search.incumbent(history).plan
            (c,) = search.propose(1, history)
            assert c.plan.hash() not in {h.plan.hash() for h in history}
            if c.plan.hash() in singles:
                kinds.append("screen")
            else:
                assert _one_step_apart(c.plan, best), (c.plan, best)
                kinds.append("neighbour")
            history.append(Outcome(c.plan, _objective(c.plan), "fast"))
        assert kinds == ["neighbour", "screen", "neighbour", "screen", "neighbour"], (seed, kinds)
        # proposing ahead (a batch, or candidates still queued) keeps the same order
        batch = BayesianSearch(space, seed=seed).propose(4, [Outcome(serving, 2.0, "fast")])
        assert [c.plan.hash() in singles for c in batch] == [False, True, False, True]

    fresh = BayesianSearch(space, seed=0).propose(5, [Outcome(PassPlan(), 1.0, "fast")])
    assert {c.plan.hash() for c in fresh} == singles  # the screening, and nothing else, first


def test_the_neighbours_of_a_plan_are_each_move_once():
    """Each parameter change of a pass in the plan (to every other value, its default counted as its value), each
    drop, and each other pass added at its defaults: a pass with a wide space is no likelier than one without."""
    space = _space()
    plan = PassPlan.from_json([{"name": "good", "params": {"block": 32}}])
    got = {p.hash(): _steps(p) for p in space.neighbours(plan)}
    want = [{"good": {"block": 16}}, {"good": {"block": 64}}, {}, {"good": {"block": 32}, "bad": {}},
            {"good": {"block": 32}, "neutral": {}}]
    assert sorted(map(str, got.values())) == sorted(map(str, want))
    assert all(_one_step_apart(p, plan) for p in space.neighbours(plan))
