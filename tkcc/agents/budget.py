"""A campaign's budget: a wall-clock bound on the whole command, and what each step costs.

Why a cost model: a step that has started cannot be cut short without
costing the engine a recovery, so the loop only starts a step that its
estimated cost lets finish before the deadline. The deadline counts from
when the command started (``started``), so the engine's start-up is paid
from the budget like everything else, and a ``reserve`` is kept for what
runs after the loop (stopping the engine, writing the summary).

Costs are learnt as the campaign runs (the slowest of the last few steps of
each kind, a conservative choice, leaving out the first once there are
more: it pays the one-time compiles) and, before a kind has run, estimated from
earlier campaigns in the store on the same model and device
(``cost_estimates``), or from the reference's cost on the same tier. A budget
too short to try one candidate is said to be so up front, with the minimum
that would (``too_short``).

Step kinds: ``reference:<tier>`` (the serving candidate measured: the first
reference, an A/A measurement), ``candidate:<tier>`` (build + validate +
measure a proposal) and ``ship`` (the slow tier's re-validation before it
serves).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

_RECENT = 5  # steps of one kind a cost estimate looks back on
_REFERENCE_KINDS = ("baseline", "aa", "start", "reference")


@dataclass
class Budget:
    total_s: float
    started: float  # clock() reading when the command started
    clock: object = time.monotonic
    reserve_s: float = 0.0
    prior: dict = field(default_factory=dict)  # kind -> seconds, from earlier campaigns
    prior_source: str = ""
    tier_scale: dict = field(default_factory=dict)  # tier -> cost relative to the screening tier, when known
    seen: dict = field(default_factory=dict)  # kind -> [seconds]

    def __post_init__(self):
        self.startup_s = max(0.0, self.clock() - self.started)

    # ---- the clock -------------------------------------------------------------------------------
    @property
    def deadline(self) -> float:
        return self.started + self.total_s

    def spent(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        """Seconds a step may still use (the reserve kept back)."""
        return self.deadline - self.reserve_s - self.clock()

    # ---- costs -----------------------------------------------------------------------------------
    def charge(self, kind: str, seconds: float) -> None:
        self.seen.setdefault(kind, []).append(float(seconds))

    def estimate(self, kind: str) -> float | None:
        """Seconds one step of ``kind`` is expected to take; None when nothing is known about it. The first step
        of a kind also pays what the engine does once (compiling kernels that later steps find cached: 16 s
        against 7 s for the serving plan's first fast-tier measurement on an H200), so once a later step is seen
        the first is left out."""
        seen = self.seen.get(kind)
        if seen:
            return max((seen[1:] or seen)[-_RECENT:])
        if self.prior.get(kind):
            return float(self.prior[kind])
        what, _, tier = kind.partition(":")
        if what == "candidate":  # a proposal also compiles: at least what the reference costs there
            ref = self.estimate(f"reference:{tier}")
            return None if ref is None else 1.5 * ref
        if what == "reference" and self.tier_scale.get(tier):
            base = min(self.tier_scale, key=self.tier_scale.get)
            if base != tier and self.seen.get(f"reference:{base}"):
                return self.estimate(f"reference:{base}") * self.tier_scale[tier] / self.tier_scale[base]
        if what == "ship":
            return self.estimate("candidate:slow")
        return None

    def cost(self, *kinds: str) -> float | None:
        """Estimated seconds of several steps; None if any of them is unknown."""
        est = [self.estimate(k) for k in kinds]
        return None if any(e is None for e in est) else sum(est)

    def fits(self, *kinds: str) -> bool:
        """Can these steps finish before the deadline? A step of unknown cost is tried while time is left."""
        c = self.cost(*kinds)
        return self.left() > (c if c is not None else 0.0)

    # ---- what to say -----------------------------------------------------------------------------
    def too_short(self, screen_tier: str, done: bool = False) -> str | None:
        """Why this budget cannot try one candidate (with the minimum that would), or None.

        Trying one candidate takes the reference on the screening tier, then the candidate there;
        ``done``: the reference is measured already."""
        kinds = (f"reference:{screen_tier}", f"candidate:{screen_tier}")
        need = self.cost(*kinds[1:] if done else kinds)
        total = self.cost(*kinds)
        if need is None or total is None or self.left() >= need:
            return None
        parts = " + ".join(f"{k.split(':')[0]} on the {screen_tier} tier ~{self.estimate(k):.1f} s" for k in kinds)
        src = f" (estimated from {self.prior_source})" if self.prior_source and not all(
            self.seen.get(k) for k in kinds) else ""
        return (f"the budget of {self.total_s:.0f} s is too short to try any candidate: start-up took "
                f"{self.startup_s:.1f} s, and one candidate needs {parts}{src}; "
                f"the minimum budget is ~{self.startup_s + total + self.reserve_s:.0f} s")

    def to_json(self) -> dict:
        return {"total_s": self.total_s, "startup_s": round(self.startup_s, 2), "spent_s": round(self.spent(), 2),
                "left_s": round(self.deadline - self.clock(), 2), "reserve_s": self.reserve_s,
                "step_costs_s": {k: round(max(v[-_RECENT:]), 2) for k, v in self.seen.items()},
                "prior_costs_s": {k: round(v, 2) for k, v in self.prior.items()}, "prior_source": self.prior_source}


def step_kind(proposer: str, tier: str) -> str:
    return f"{'reference' if proposer in _REFERENCE_KINDS else 'candidate'}:{tier}"


def cost_estimates(store, model: str, device: str | None = None, campaigns: int = 20) -> tuple[dict, str]:
    """Median seconds of each step kind (and of start-up) in the last ``campaigns`` campaigns of ``model``
    on ``device`` in ``store``; returns (costs, what they are from). Empty when the store knows nothing."""
    costs: dict[str, list[float]] = {}
    used = []
    for c in reversed(store.campaigns()):
        if len(used) >= campaigns:
            break
        if c["model"] != model:
            continue
        cfg = c["config"]
        if device is not None and cfg.get("device") not in (None, device):
            continue
        used.append(c["name"])
        for s in cfg.get("sessions", []):
            if s.get("startup_s"):
                costs.setdefault("startup", []).append(float(s["startup_s"]))
        for e in store.experiments(c["id"]):  # the campaign's device is its experiments' device
            if e.verdict in ("reused",) or e.finished <= e.started:
                continue
            costs.setdefault(step_kind(e.proposer, e.tier), []).append(e.finished - e.started)
        for s in store.ships(c["id"]):
            d = s.get("detail") or {}
            if d.get("ship_s"):
                costs.setdefault("ship", []).append(float(d["ship_s"]))
    if not costs:
        return {}, ""
    return ({k: statistics.median(v) for k, v in costs.items()},
            f"{len(used)} earlier campaign(s) of {model} in {store.path}")


def up_front(total_s: float, costs: dict, source: str, screen_tier: str, reserve_s: float = 0.0) -> str | None:
    """Before anything starts: why ``total_s`` cannot try one candidate, from earlier campaigns' costs, or None.

    One candidate needs start-up, the reference on the screening tier and the candidate there."""
    ref, start = costs.get(f"reference:{screen_tier}"), costs.get("startup")
    if not ref or not start:
        return None
    cand = costs.get(f"candidate:{screen_tier}") or 1.5 * ref
    need = start + ref + cand + reserve_s
    if total_s >= need:
        return None
    return (f"the budget of {total_s:.0f} s is too short to try any candidate: start-up ~{start:.1f} s + the "
            f"reference on the {screen_tier} tier ~{ref:.1f} s + one candidate ~{cand:.1f} s (estimated from "
            f"{source}); the minimum budget is ~{need:.0f} s")
