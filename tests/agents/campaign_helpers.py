"""Deterministic campaign parts for tests: test passes, a fake clock, and an evaluator whose steps cost
fake seconds (so budget decisions are tested without depending on machine load)."""
import random

from tkcc.agents.campaign import EvalResult
from tkcc.passes.base import Pass


class Fuse(Pass):
    name, params = "fuse_budget_test", {"block": [16, 64]}


class Slow(Pass):
    name, params = "slow_budget_test", {}


class Wide(Pass):
    """No effect on the objective; many values, so the proposer does not run out of new plans."""
    name, params = "wide_budget_test", {"k": list(range(64))}


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class TimedEvaluator:
    """Objective 100 x (2 with fuse) x (0.5 with slow) x (1 + noise); each step costs fake seconds."""

    def __init__(self, clock, cost=None, build_s=1.0, ship_s=None, noise=0.002, seed=0, conditions=None,
                 refuse=False):
        self.clock, self.cost, self.build_s = clock, cost or {"fast": 2.0, "slow": 6.0}, build_s
        self.ship_s = self.cost["slow"] if ship_s is None else ship_s
        self.noise, self.rng, self.cond, self.refuse = noise, random.Random(seed), conditions, refuse
        self.built, self.measured, self.shipped = {}, [], []
        self.tier_scale = dict(self.cost)  # what lets the budget estimate the slow tier from the fast one

    def workload_fingerprint(self):
        return "wl-budget"

    def conditions(self):
        return dict(self.cond or {})

    def build(self, cand, tier):
        if cand.plan.steps:
            self.clock.t += self.build_s
        h = f"{cand.key}-{tier}"
        self.built[h] = cand.plan
        return h

    def measure(self, ahash, tier):
        self.clock.t += self.cost[tier]
        self.measured.append((ahash, tier))
        names = {s.name for s in self.built[ahash].steps}
        v = 100.0 * (2 if "fuse_budget_test" in names else 1) * (0.5 if "slow_budget_test" in names else 1)
        return EvalResult("measured", v * (1 + self.rng.gauss(0, self.noise)), {"device": "fake"})

    def ship(self, ahash):
        self.clock.t += self.ship_s
        if self.refuse and self.built[ahash].steps:
            from tkcc.errors import TkccError

            raise TkccError(f"shipping {ahash} failed re-validation: bucket decode/b1/c900 differs by 3e-2")
        self.shipped.append(ahash)
