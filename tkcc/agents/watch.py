"""Continual watch: follow a growing request log, and when traffic drifts, re-check and re-optimise.

Loop: every ``poll_s`` read the new complete lines of the log into a rolling
window (``tkcc.traffic.follow.RollingWorkload``). The first full window sets
the reference, and a campaign optimises for it. On a drift verdict that
warrants re-optimisation (``tkcc.traffic.drift``: a two-sample KS test plus
a percentile shift, over enough requests) the shipped candidate is
re-measured on the new workload beside its predecessor and the baseline
(reverted if it lost), then a budgeted campaign runs on the new traffic and
the reference moves to the new window.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from tkcc.agents.campaign import CampaignConfig, run_campaign
from tkcc.agents.ship import recheck_and_revert
from tkcc.agents.store import ExperimentStore


@dataclass
class WatchEvent:
    time: float
    kind: str  # reference | drift | recheck | campaign | quiet
    detail: dict = field(default_factory=dict)


def watch(rolling, make_evaluator, make_proposer, store: ExperimentStore, *, name: str, model: str,
          budget_s: float, min_requests: int = 200, poll_s: float = 5.0, max_polls: int | None = None,
          workload_kwargs: dict | None = None, tiers=("fast", "slow"), progress: bool = False,
          stop=None, events: list | None = None) -> list[WatchEvent]:
    """Run the watch loop (until ``max_polls`` polls, ``stop`` is set, or forever). Returns what happened.

    ``make_evaluator(workload)`` gives an Evaluator measuring on that workload; ``make_proposer()`` a
    fresh proposer. Each re-optimisation is its own campaign in the store, named ``{name}-{n}``.
    ``stop``: a ``threading.Event`` that ends the loop at its next poll (a server's ``--watch`` thread);
    ``events``: a list to append the events to as they happen (to follow a loop that runs in a thread).
    """
    events = events if events is not None else []
    polls, rounds, campaign_id, noise = 0, 0, None, None
    wk = dict(workload_kwargs or {})
    while (max_polls is None or polls < max_polls) and not (stop is not None and stop.is_set()):
        polls += 1
        rolling.update()
        cur = rolling.current()
        if rolling.reference is None:
            if len(cur) >= min_requests:
                rolling.set_reference(cur)
                events.append(WatchEvent(time.time(), "reference", {"requests": len(cur)}))
                campaign_id, noise = _optimise(rolling, make_evaluator, make_proposer, store, f"{name}-{rounds}",
                                               model, budget_s, wk, tiers, progress, events)
                rounds += 1
        elif len(cur) >= min_requests:
            verdict = rolling.check()
            if verdict.drift and verdict.reoptimize:
                detail = {"field": verdict.field, "direction": verdict.direction, "magnitude": verdict.magnitude,
                          "shifts": verdict.shifts, "requests": verdict.requests}
                events.append(WatchEvent(time.time(), "drift", detail))
                ev = make_evaluator(rolling.workload(**wk))
                rc = recheck_and_revert(store, campaign_id, ev, noise)
                events.append(WatchEvent(time.time(), "recheck", {"reverted": rc.reverted, "reason": rc.reason,
                                                                    "objectives": rc.objectives}))
                rolling.set_reference(cur)
                campaign_id, noise = _optimise(rolling, make_evaluator, make_proposer, store, f"{name}-{rounds}",
                                               model, budget_s, wk, tiers, progress, events)
                rounds += 1
            else:
                events.append(WatchEvent(time.time(), "quiet", {"requests": len(cur), "note": verdict.note}))
        if max_polls is None or polls < max_polls:
            if stop is not None:
                stop.wait(poll_s)
            else:
                time.sleep(poll_s)
    return events


def _optimise(rolling, make_evaluator, make_proposer, store, name, model, budget_s, wk, tiers, progress, events):
    workload = rolling.workload(**wk)
    cfg = CampaignConfig(name=name, model=model, budget_s=budget_s, tiers=tuple(tiers),
                         extra={"buckets": [b.__dict__ for b in workload.buckets], "objective": workload.objective})
    state = run_campaign(cfg, store, make_proposer(), make_evaluator(workload), progress=progress)
    events.append(WatchEvent(time.time(), "campaign", {"name": name, "shipped": state.shipped,
                                                        "evaluated": state.evaluated}))
    return state.campaign_id, state.noise
