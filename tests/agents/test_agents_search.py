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
