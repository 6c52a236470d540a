"""A watch loop outlives a failed re-optimisation: the failure is an event with its cause, what serves keeps
serving, and the next drift verdict tries again (the H200 serve run's watcher died with its first campaign,
and the server never re-optimised again)."""
from __future__ import annotations

import random
import time

from tkcc.errors import EngineError


def _append(path, rows, t0):
    with open(path, "a") as f:
        for i, (dt, inp, out) in enumerate(rows):
            ts = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0 + dt)) + f".{i % 1000:03d}0000"
            f.write(f"{ts},{inp},{out}\n")


def test_a_failed_campaign_is_an_event_and_the_next_drift_reoptimises(tmp_path):
    from campaign_helpers import FakeClock, Fuse, Slow, TimedEvaluator
    from tkcc.agents.search import BayesianSearch, SearchSpace
    from tkcc.agents.store import ExperimentStore
    from tkcc.agents.watch import watch
    from tkcc.traffic.follow import RollingWorkload

    class Failing(TimedEvaluator):
        def measure(self, ahash, tier):
            raise EngineError("the serving candidate failed on the fast tier (crashed: during validate: "
                              "OutOfMemoryError)")

    rng = random.Random(0)
    log = tmp_path / "requests.csv"
    log.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    t0 = 1_700_000_000.0
    batches = [[(i, rng.randint(100, 200), rng.randint(20, 60)) for i in range(60)],
               [(60 + i, rng.randint(900, 1400), rng.randint(20, 60)) for i in range(60)]]
    clock = FakeClock()
    made = []

    def make_evaluator(workload):
        made.append(workload)
        return (Failing if len(made) == 1 else TimedEvaluator)(clock)

    def sleep(_):
        if batches:
            _append(log, batches.pop(0), t0)

    sleep(0)
    events = watch(RollingWorkload(log, horizon="60s"), make_evaluator,
                   lambda: BayesianSearch(SearchSpace([Fuse, Slow])), ExperimentStore(tmp_path / "s.db"),
                   name="w", model="m", budget_s=30.0, min_requests=50, poll_s=0, max_polls=2,
                   workload_kwargs={"max_context": 2047, "batch_sizes": (1,)}, sleep=sleep)
    kinds = [e.kind for e in events]
    assert kinds[:2] == ["reference", "failed"], kinds
    failed = events[1]
    assert failed.detail["stage"] == "campaign" and failed.detail["name"] == "w-0"
    assert "EngineError" in failed.detail["error"] and "OutOfMemoryError" in failed.detail["error"]
    assert "keeps serving" in failed.line()
    # the loop went on: the drift to long prompts was seen, re-checked and re-optimised
    assert "drift" in kinds and kinds[-1] == "campaign", kinds
    assert events[-1].detail["shipped"] is not None


def test_a_servers_watcher_neither_screens_what_cannot_ship_nor_outlives_its_stop(tmp_path, monkeypatch):
    """Each campaign of a server's watcher (``serving`` given) gets the server's stop and ``screen_only=False``;
    a `tkcc watch` apart from a server screens as a campaign does."""
    import threading
    from types import SimpleNamespace

    from campaign_helpers import FakeClock, TimedEvaluator
    from tkcc.agents import watch as watch_mod
    from tkcc.passes.plan import PassPlan, PassStep
    from tkcc.traffic.follow import RollingWorkload

    seen = []

    def spy(cfg, store, proposer, evaluator, **kw):
        seen.append(kw)
        return SimpleNamespace(campaign_id=1, noise=None, shipped=None, evaluated={}, tried=0, stopped="",
                               decisions=[])

    monkeypatch.setattr(watch_mod, "run_campaign", spy)
    rng = random.Random(0)
    log = tmp_path / "requests.csv"
    log.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    _append(log, [(i, rng.randint(100, 200), rng.randint(20, 60)) for i in range(60)], 1_700_000_000.0)
    stop = threading.Event()
    serving = [None, lambda: PassPlan((PassStep("dce", {}),))]
    for s in serving:
        watch_mod.watch(RollingWorkload(log, horizon="60s"), lambda wl: TimedEvaluator(FakeClock()), lambda: None,
                        None, name="w", model="m", budget_s=30.0, min_requests=50, poll_s=0, max_polls=1,
                        workload_kwargs={"max_context": 2047, "batch_sizes": (1,)}, sleep=lambda _: None,
                        stop=stop, serving=s)
    assert [k["screen_only"] for k in seen] == [True, False]
    assert all(k["stop"] is stop for k in seen)
