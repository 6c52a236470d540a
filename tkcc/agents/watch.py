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

import math
import time
from dataclasses import dataclass, field

from tkcc.agents.campaign import CampaignConfig, run_campaign
from tkcc.agents.proposer import Candidate
from tkcc.agents.ship import recheck_and_revert, shipped_chain
from tkcc.agents.store import ExperimentStore
from tkcc.errors import TkccError
from tkcc.passes.plan import PassPlan


@dataclass
class WatchEvent:
    time: float
    kind: str  # waiting | reference | drift | recheck | prefer | campaign | failed | quiet
    detail: dict = field(default_factory=dict)

    def line(self) -> str:
        """One line for the terminal: what happened at this poll, and why nothing more did."""
        d = self.detail
        when = time.strftime("%H:%M:%S", time.localtime(self.time))
        if self.kind in ("waiting", "quiet"):
            return f"{when} {self.kind}: {d.get('requests')} requests in the window; {d.get('note')}"
        if self.kind == "reference":
            return f"{when} reference: {d.get('requests')} requests; optimising for them"
        if self.kind == "drift":
            return (f"{when} drift: {d.get('field')} {d.get('direction')} x{d.get('magnitude', 0):.2f} over "
                    f"{d.get('requests')} requests; re-checking what ships, then re-optimising")
        if self.kind == "recheck":
            return f"{when} recheck: {'reverted' if d.get('reverted') else 'kept'}: {d.get('reason')}"
        if self.kind == "campaign":
            return (f"{when} campaign {d.get('name')}: serving {(d.get('shipped') or [None])[0]}; "
                    f"tried {d.get('tried')}; {d.get('stopped') or ''}")
        if self.kind == "prefer":
            return (f"{when} campaign {d.get('name')} screens first: "
                    f"{', '.join(f'{n} x{g:.2f}' for n, g in (d.get('gains') or {}).items())} ({d.get('note')})")
        if self.kind == "failed":
            return f"{when} failed: {d.get('stage')} {d.get('name') or ''}: {d.get('error')}; {d.get('note')}"
        return f"{when} {self.kind}: {d}"


def watch(rolling, make_evaluator, make_proposer, store: ExperimentStore, *, name: str, model: str,
          budget_s: float, min_requests: int = 200, poll_s: float = 5.0, max_polls: int | None = None,
          workload_kwargs: dict | None = None, tiers=("fast", "slow"), progress=False, on_event=None,
          sleep=time.sleep, events: list | None = None, stop=None, serving=None) -> list[WatchEvent]:
    """Run the watch loop (until ``max_polls`` polls, ``stop`` is set, or forever). Returns what happened.

    ``make_evaluator(workload)`` gives an Evaluator measuring on that workload; ``make_proposer()`` a
    fresh proposer. Each re-optimisation is its own campaign in the store, named ``{name}-{n}``.
    ``min_requests`` is the one threshold: the window needs that many requests for a reference, a drift
    verdict and a re-optimisation. Every poll adds one event (``on_event(event)`` is called with each, as it
    happens); pass ``events`` to keep them where an interrupt cannot lose them (or to follow a loop that
    runs in a thread). ``stop``: a ``threading.Event`` that ends the loop at its next poll (a server's
    ``--watch`` thread). ``serving``: a callable giving the PassPlan of what serves now (a server's current
    forward), which each campaign starts from; without it, the last campaign's ship still in force.
    """
    events = events if events is not None else []

    def emit(kind: str, detail: dict) -> None:
        ev = WatchEvent(time.time(), kind, detail)
        events.append(ev)
        if on_event is not None:
            on_event(ev)

    if min_requests < 1:
        raise TkccError(f"min_requests must be at least 1, got {min_requests}")
    if hasattr(rolling, "params"):
        rolling.params["min_reopt_requests"] = min_requests  # the flag decides, not a default inside
    polls, rounds, campaign_id, noise = 0, 0, None, None
    wk = dict(workload_kwargs or {})
    while (max_polls is None or polls < max_polls) and not (stop is not None and stop.is_set()):
        polls += 1
        arrived = rolling.update()
        cur = rolling.current()
        if len(cur) < min_requests:
            what = "a reference" if rolling.reference is None else "a drift verdict"
            emit("waiting", {"requests": len(cur), "arrived": arrived, "min_requests": min_requests,
                             "note": f"fewer than --min-requests {min_requests}, needed for {what}"})
        elif rolling.reference is None:
            rolling.set_reference(cur)
            emit("reference", {"requests": len(cur)})
            campaign_id, noise = _optimise(rolling, make_evaluator, make_proposer, store, f"{name}-{rounds}",
                                           model, budget_s, wk, tiers, progress, emit, campaign_id, noise, serving, stop)
            rounds += 1
        else:
            verdict = rolling.check()
            if verdict.drift and verdict.reoptimize:
                detail = {"field": verdict.field, "direction": verdict.direction, "magnitude": verdict.magnitude,
                          "shifts": verdict.shifts, "requests": verdict.requests}
                emit("drift", detail)
                try:
                    ev = make_evaluator(rolling.workload(**wk))
                    rc = recheck_and_revert(store, campaign_id, ev, noise, serving=serving is not None)
                    emit("recheck", {"reverted": rc.reverted, "reason": rc.reason, "objectives": rc.objectives})
                except TkccError as e:
                    _failed(emit, "recheck", "", e)
                rolling.set_reference(cur)
                campaign_id, noise = _optimise(rolling, make_evaluator, make_proposer, store, f"{name}-{rounds}",
                                               model, budget_s, wk, tiers, progress, emit, campaign_id, noise,
                                               serving, stop)
                rounds += 1
            else:
                note = quiet_note(verdict, rolling.params)
                if not arrived:
                    note = f"no new requests since the last poll; {note}"
                emit("quiet", {"requests": len(cur), "arrived": arrived, "note": note, "ratios": verdict.ratios,
                               "ks": verdict.ks})
        if max_polls is None or polls < max_polls:
            if stop is not None:
                stop.wait(poll_s)
            else:
                sleep(poll_s)
    return events


def quiet_note(verdict, params: dict) -> str:
    """Why a window that was checked does not lead to a re-optimisation, with the numbers."""
    if verdict.drift:
        return (f"drift ({verdict.field} x{verdict.magnitude:.2f}), but only {verdict.requests} requests, fewer than "
                f"{params.get('min_reopt_requests')} to re-optimise on")
    if verdict.note:
        return verdict.note
    ratio, alpha = params.get("ratio", 1.5), params.get("alpha", 1e-3)
    if not verdict.ratios:
        return "no drift"
    key, r = max(verdict.ratios.items(), key=lambda kv: abs(math.log(kv[1])) if 0 < kv[1] < math.inf else math.inf)
    p = min((v.get("p", 1.0) for v in verdict.ks.values()), default=1.0)
    return (f"no drift: largest shift {key} x{r:.2f}, KS p={p:.2g} (drift needs a shift of x{ratio:g} with "
            f"p < {alpha:g})")


def serving_starts(store, campaign_id, serving=None) -> list[Candidate] | None:
    """What a re-optimisation starts from; None (the campaign's own default, the empty plan) when the empty plan
    serves. A campaign that started from the empty plan alone shipped it when it found nothing better in its
    budget, and the server swapped a faster forward out for it: its own default plan before the watcher's first
    ship (the H200 serve run, 2.49 -> 3.04 ms TPOT).

    - A server's watcher (``serving()``, the current forward's plan) starts from what serves alone. It was
      compared with the empty plan when it shipped (by the compile, or an earlier campaign), and after a drift
      the recheck compares it with the empty plan on the new traffic, reverting if that wins, just before this
      campaign. Measured again here, the empty plan took a third of a 50 s campaign beside live traffic on the
      H200, and no candidate fitted in the rest.
    - Without a server: the last campaign's ship still in force (after any revert), beside the empty plan."""
    if serving is not None:
        plan = serving() or PassPlan()
        return [Candidate("serving", plan, serving=True)] if plan.steps else None
    chain = shipped_chain(store, campaign_id) if campaign_id is not None else []
    plan = PassPlan.from_json(chain[-1]["plan"]) if chain else PassPlan()
    if not plan.steps:
        return None
    return [Candidate("serving", plan), Candidate("baseline", PassPlan())]


def screened_gains(store, campaign_id) -> list[tuple[str, float]]:
    """(pass, gain) for each pass a campaign measured alone that beat what served on the same tier, best first:
    the gain is the pass's best objective over the median of the serving candidate's on that tier (a watcher's
    campaign measures what serves as its reference, proposer ``start`` or ``baseline``). [] for no campaign."""
    if campaign_id is None:
        return []
    exps = [e for e in store.experiments(campaign_id) if e.objective]
    refs: dict[str, list[float]] = {}
    for e in exps:
        if e.proposer in ("start", "baseline", "eager"):
            refs.setdefault(e.tier, []).append(e.objective)
    best: dict[str, float] = {}
    for e in exps:
        if e.proposer in ("start", "baseline", "eager") or len(e.plan) != 1 or e.tier not in refs:
            continue
        ref = sorted(refs[e.tier])[len(refs[e.tier]) // 2]
        name, gain = e.plan[0]["name"], e.objective / ref
        if gain > 1.0 and gain > best.get(name, 0.0):
            best[name] = gain
    return sorted(best.items(), key=lambda kv: -kv[1])


def _failed(emit, stage: str, name: str, e: Exception) -> None:
    emit("failed", {"stage": stage, "name": name, "error": f"{type(e).__name__}: {e}",
                    "note": "what serves keeps serving; the next drift verdict tries again"})


def _optimise(rolling, make_evaluator, make_proposer, store, name, model, budget_s, wk, tiers, progress, emit,
              previous=None, noise=None, serving=None, stop=None):
    """One re-optimisation campaign; (its id, its noise). One that fails is an event, and the loop goes on
    from the last campaign that ran (a watcher in a server must outlive a failed campaign)."""
    workload = rolling.workload(**wk)
    cfg = CampaignConfig(name=name, model=model, budget_s=budget_s, tiers=tuple(tiers),
                         extra={"buckets": [b.__dict__ for b in workload.buckets], "objective": workload.objective})
    proposer = make_proposer()
    gains = screened_gains(store, previous)
    if gains and hasattr(proposer, "prefer"):
        proposer.prefer([n for n, _ in gains])
        emit("prefer", {"name": name, "gains": {n: round(g, 3) for n, g in gains},
                        "note": "screened first: what the campaign before measured to beat what served"})
    try:
        state = run_campaign(cfg, store, proposer, make_evaluator(workload), progress=progress,
                             starts=serving_starts(store, previous, serving), stop=stop,
                             screen_only=serving is None)  # beside a server's live traffic: only what can ship
    except TkccError as e:
        _failed(emit, "campaign", name, e)
        return previous, noise
    emit("campaign", {"name": name, "shipped": state.shipped, "evaluated": state.evaluated, "tried": state.tried,
                      "stopped": state.stopped, "decisions": [d.get("why") for d in state.decisions]})
    return state.campaign_id, state.noise
