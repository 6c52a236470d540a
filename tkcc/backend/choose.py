"""Which forward a graph keeps: candidates tried in order within a budget, the winner picked by measurement.

Pure logic: building, checking and timing a candidate is the caller's ``trial(candidate) -> Trial``;
time passes on the caller's ``clock``. So a test drives it with fake timings and a fake clock.

The rule (``pick``): the baseline (the first candidate, Inductor unless it is switched off) stays
unless a challenger that passed its numerics check is faster by more than ``min_gain`` *and* the 95 %
confidence intervals of the two medians (distribution-free, ``tkcc.runtime.measurement.median_ci``)
do not overlap. Among those, the lowest median wins. A challenger within noise never replaces the
baseline, so the choice does not flip between runs on the same machine.

The budget (``run``): candidates of tier ``"default"`` are always tried; those of tier ``"search"``
only while ``clock() - start < budget_s`` (``start``: when the first of them came up) and at least
``min_budget_s`` of it is left (a max-autotune compile is not started with a second to go). A candidate
started inside the budget runs to the end.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from tkcc.runtime.measurement import median_ci

TIERS = ("default", "search")


@dataclass
class Candidate:
    """One way to run a graph. ``build() -> fn`` is called only if the candidate is tried."""

    name: str
    kind: str                     # "inductor" | "tkcc" | "eager": who made the forward
    exact: bool                   # promises eager's bits (checked with torch.equal), else a tolerance
    build: Callable[[], Callable] = field(repr=False, default=None)
    tier: str = "default"
    min_budget_s: float = 0.0


@dataclass
class Trial:
    """What trying one candidate found. ``status``: ok | rejected (numerics) | failed (build/run) | skipped."""

    name: str
    kind: str
    exact: bool
    status: str
    why: str = ""
    samples_s: list = field(default_factory=list)
    error: float | None = None    # checked error vs eager, as a fraction of the output's scale
    build_s: float = 0.0
    fn: Callable | None = field(default=None, repr=False)

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.samples_s) if self.samples_s else None

    def interval(self) -> tuple[float, float]:
        lo, hi, _ = median_ci(self.samples_s)
        return lo, hi

    def to_json(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "exact": self.exact, "status": self.status, "why": self.why,
             "error": self.error, "build_s": self.build_s}
        d["median_ms"] = None if self.median_s is None else self.median_s * 1e3
        if self.samples_s:
            lo, hi = self.interval()
            d["ci_ms"] = [lo * 1e3, hi * 1e3]
            d["reps"] = len(self.samples_s)
        return d


def pick(trials: list[Trial], min_gain: float = 0.02) -> tuple[Trial | None, str]:
    """(winner, why): the baseline (first usable trial) unless a challenger clearly beats it (module doc)."""
    usable = [t for t in trials if t.status == "ok"]
    if not usable:
        return None, "no candidate passed: " + "; ".join(f"{t.name}: {t.why}" for t in trials)
    base = usable[0]
    if len(usable) == 1 or not base.samples_s:
        others = [t for t in trials if t is not base and t.status != "ok"]
        why = f"{base.name}: the only candidate that passed" if others else f"{base.name}: the only candidate"
        return base, why + ("" if not others else " (" + "; ".join(f"{t.name} {t.status}: {t.why}"
                                                                     for t in others) + ")")
    b_lo, _ = base.interval()
    best, why = base, ""
    for t in usable[1:]:
        if not t.samples_s:
            continue
        _, t_hi = t.interval()
        gain = base.median_s / t.median_s - 1.0
        if gain > min_gain and t_hi < b_lo and t.median_s < best.median_s:
            best = t
    ratios = ", ".join(f"{t.name} {t.median_s * 1e3:.4g} ms" for t in usable if t.samples_s)
    if best is base:
        why = f"{base.name} stays: no candidate beat it by more than {min_gain:.0%} outside noise ({ratios})"
    else:
        why = (f"{best.name} is x{base.median_s / best.median_s:.2f} faster than {base.name}, outside the 95 % "
               f"intervals of both medians ({ratios})")
    return best, why


def run(candidates: list[Candidate], trial: Callable[[Candidate], Trial], budget_s: float,
        clock: Callable[[], float] = time.monotonic) -> list[Trial]:
    """Try the candidates in order, search-tier ones only within the budget; one Trial per candidate.

    The budget runs from the first search-tier candidate: the default tier is not charged to it.
    """
    start = None
    out = []
    for c in candidates:
        if c.tier not in TIERS:
            raise ValueError(f"candidate {c.name}: tier {c.tier!r} is not one of {TIERS}")
        if c.tier == "search":
            start = clock() if start is None else start
            left = budget_s - (clock() - start)
            if left <= 0 or left < c.min_budget_s:
                why = (f"search budget {budget_s:g} s spent" if budget_s > 0 and left <= 0 else
                       "no search budget (options['search_s'])" if budget_s <= 0 else
                       f"needs {c.min_budget_s:g} s of budget, {left:.3g} s left")
                out.append(Trial(c.name, c.kind, c.exact, "skipped", why))
                continue
        out.append(trial(c))
    return out
