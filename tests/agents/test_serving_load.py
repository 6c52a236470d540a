"""The campaign's evaluator builds what serves already with ``serving`` (the engine's memory ledger then keeps
what its first load warms: ``tkcc.runtime.worker``), and every other candidate without it."""
from __future__ import annotations

from tkcc.agents.engine_eval import EngineEvaluator
from tkcc.agents.proposer import Candidate
from tkcc.passes.plan import PassPlan
from tkcc.runtime.workloads import Bucket, Workload


class _Client:
    def __init__(self):
        self.loads = []

    def status(self) -> dict:
        return {"engine": {"model": "m"}, "worker": {"device": "cpu"}}

    def load(self, spec, tiers="both", **kw):
        self.loads.append((spec, tiers, kw))
        return {tiers: {"info": {"hash": f"h{len(self.loads)}"}}}


def test_only_the_serving_candidate_is_loaded_as_serving():
    c = _Client()
    ev = EngineEvaluator(c, Workload(buckets=[Bucket("forward", weight=1.0)], objective="mean_latency_s",
                                     source="test"))
    plan = PassPlan.from_json([{"name": "dce"}])
    ev.build(Candidate("serving", plan, serving=True), "slow")
    ev.build(Candidate("other", plan), "slow")
    assert [kw for _, _, kw in c.loads] == [{"serving": True}, {"serving": False}]
    assert all(t == "slow" for _, t, _ in c.loads)
