"""Built-in search over the registered passes' parameter spaces.

Method: Thompson sampling on a Bayesian linear model of log(objective).
A plan is encoded as features — one per pass (is it in the plan?) and one per
(pass, param, value) — and the model predicts the log objective as their
sum. Why this and not a plain grid or a genetic search: campaigns afford tens
to hundreds of measurements, the effects of independent passes are close to
additive in log time (each removes a share of the work), and measurements are
noisy; a Bayesian linear model learns from every result, shares what it learns
across plans that have features in common, and its posterior samples explore
where it is unsure instead of re-measuring what it already knows. Candidates
are drawn from a pool of random plans and single-step mutations of the best
measured ones, scored by one posterior sample each, and the best unseen ones
are proposed. Failed candidates teach a strong penalty on their features.

The first design points are each pass alone at its defaults (screening), proposed as one round whatever the batch
size: a campaign promotes (confirms on the slow tier, ships) the best of each round, so a screening cut into rounds
shipped the best of the passes that come first in the registry before the others were measured (on an H200,
olmoe-16l at the default 150 s budget shipped ``fuse_elementwise``, x1.34 eager, and never screened
``lowered_decode``, x3.6, eighth in the order). A campaign that starts from a tuned plan (a server's watcher starts
from what serves) alternates them with that plan's neighbours: a short budget spent only on single passes would
never try what could beat a plan that already combines them. Both follow the space's order, ``plan_order``: the
lowering rewrites come first (``lowered_decode`` is screened third, not eighth as in name order, which a watcher's
75 s campaign on the H200 never reached).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from tkcc.agents.proposer import Candidate, Outcome
from tkcc.passes.base import Pass
from tkcc.passes.plan import PassPlan, PassStep

FAILED_LOG_PENALTY = -2.0  # a failed candidate counts as e^-2 of the baseline objective


@dataclass
class SearchSpace:
    """Ordered passes a plan may include, each with its parameter space (in ``plan_order``: lowering rewrites,
    cleanups, fusion, wrappers)."""

    passes: list[type[Pass]]

    @classmethod
    def from_registry(cls, names: list[str] | None = None, exact_only: bool = True,
                      exclude: tuple[str, ...] = ("sharding",), device: str | None = None,
                      program=None) -> "SearchSpace":
        """Registered passes (by default every exact one, less those a single engine cannot run:
        sharding needs one engine per rank, ``tkcc serve --tp N``). With ``device``, kernel-target values
        that device cannot run (``target="cuda"`` on a CPU) are left out of the space; with ``program`` too,
        a pass prunes at that model's shapes only (fewer kernels to compile to find out)."""
        from tkcc.passes.base import all_passes, plan_order

        reg = all_passes()
        chosen = [reg[n] for n in names] if names else [p for n, p in reg.items() if n not in exclude]
        chosen = plan_order(chosen)  # every plan the search composes runs its passes in this order
        if exact_only:
            chosen = [p for p in chosen if p.exact]
        chosen = [p for p in chosen if getattr(p, "emits_source", True)]  # the engine loads artifacts
        space = cls(chosen)
        if device is not None and not str(device).startswith("cuda"):
            space.params_override = {p.name: {"target": [v for v in p.params["target"] if v != "cuda"]}
                                     for p in chosen if "target" in p.params}
        if device is not None:  # values a pass's kernels cannot run on this device, pruned (reason logged)
            over = dict(space.params_override or {})
            for p in chosen:
                params, pruned = p.space(device, program=program)
                if pruned:
                    over[p.name] = {**over.get(p.name, {}), **{k: v for k, v in params.items()
                                                               if v != p.params[k]}}
                    space.pruned[p.name] = pruned
            space.params_override = over or None
        return space

    params_override: dict = None  # pass name -> {param: allowed values}, narrowing a pass's own space
    pruned: dict = field(default_factory=dict)  # pass name -> {"param=value": why the device cannot run it}

    def space_of(self, p: type[Pass]) -> dict:
        over = (self.params_override or {}).get(p.name, {})
        return {k: over.get(k, v) for k, v in p.params.items()}

    def features(self) -> list[tuple]:
        out = []
        for p in self.passes:
            out.append((p.name,))
            for k, vals in self.space_of(p).items():
                out.extend((p.name, k, v) for v in vals)
        return out

    def random_plan(self, rng: random.Random) -> PassPlan:
        steps = []
        for p in self.passes:
            if rng.random() < 0.5:
                steps.append(PassStep(p.name, {k: rng.choice(v) for k, v in self.space_of(p).items()}))
        return PassPlan(tuple(steps))

    def neighbours(self, plan: PassPlan) -> list[PassPlan]:
        """Every plan one move from ``plan``: one parameter of one of its passes changed (to each other value
        of its space), one of its passes dropped, or one pass added at its defaults. Each move counts once,
        whatever the size of a pass's space (a random draw of mutations is mostly additions with random
        parameters: the parameters of what the plan already runs would rarely come up)."""
        present = {s.name: s for s in plan.steps}
        order = [q.name for q in self.passes]

        def of(steps: dict) -> PassPlan:
            return PassPlan(tuple(steps[n] for n in order if n in steps))

        out = []
        for p in self.passes:
            if p.name not in present:
                out.append(of({**present, p.name: PassStep(p.name, {})}))
                continue
            step = present[p.name]
            current = {**_defaults(p), **step.params}
            for k, values in self.space_of(p).items():
                for v in values:
                    if k in current and current[k] == v and type(current[k]) is type(v):
                        continue
                    out.append(of({**present, p.name: PassStep(p.name, {**step.params, k: v})}))
            out.append(of({n: st for n, st in present.items() if n != p.name}))
        return out

    def mutate(self, plan: PassPlan, rng: random.Random) -> PassPlan:
        """Toggle one pass in or out, or change one parameter of one included pass."""
        present = {s.name: s for s in plan.steps}
        p = rng.choice(self.passes)
        space = self.space_of(p)
        if p.name in present and space and rng.random() < 0.6:
            k = rng.choice(list(space))
            params = dict(present[p.name].params)
            params[k] = rng.choice(space[k])
            present[p.name] = PassStep(p.name, params)
        elif p.name in present:
            del present[p.name]
        else:
            present[p.name] = PassStep(p.name, {k: rng.choice(v) for k, v in space.items()})
        order = [q.name for q in self.passes]
        return PassPlan(tuple(present[n] for n in order if n in present))


def _defaults(p: type[Pass]) -> dict:
    """A pass's parameter defaults, as its ``rewrite`` (graph passes) or ``apply`` declares them."""
    import inspect

    fn = getattr(p, "rewrite", None) or p.apply
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}
    return {k: v.default for k, v in sig.parameters.items() if v.default is not inspect.Parameter.empty}


class BayesianSearch:
    """Proposer: Thompson sampling over plans (see module docstring)."""

    name = "search"

    def __init__(self, space: SearchSpace, seed: int = 0, prior_var: float = 0.25, noise_var: float = 0.01,
                 pool: int = 256):
        self.space, self.rng = space, random.Random(seed)
        self.prior_var, self.noise_var, self.pool = prior_var, noise_var, pool
        self.feats = space.features()
        self.index = {f: i for i, f in enumerate(self.feats)}
        self.first_names: list[str] = []  # screened first, in this order (``prefer``)

    def encode(self, plan: PassPlan) -> np.ndarray:
        x = np.zeros(len(self.feats))
        for s in plan.steps:
            if (s.name,) in self.index:
                x[self.index[(s.name,)]] = 1.0
            for k, v in s.params.items():
                i = self.index.get((s.name, k, v))
                if i is not None:
                    x[i] = 1.0
        return x

    def posterior(self, history: list[Outcome]) -> tuple[np.ndarray, np.ndarray, float]:
        """Mean and covariance of the weights, and the baseline log objective (intercept)."""
        # references (eager) are not plans, and queued candidates have no result yet: nothing to learn
        history = [h for h in history if not h.start and not h.pending]
        d = len(self.feats)
        ok = [h for h in history if h.objective is not None and h.objective > 0]
        base = float(np.median([math.log(h.objective) for h in ok if len(h.plan) == 0] or
                               [math.log(h.objective) for h in ok] or [0.0]))
        if not history:
            return np.zeros(d), np.eye(d) * self.prior_var, base
        X = np.stack([self.encode(h.plan) for h in history])
        y = np.array([(math.log(h.objective) - base) if (h.objective and h.objective > 0) else FAILED_LOG_PENALTY
                      for h in history])
        precision = np.eye(d) / self.prior_var + X.T @ X / self.noise_var
        cov = np.linalg.inv(precision)
        mean = cov @ X.T @ y / self.noise_var
        return mean, cov, base

    def screening(self, history: list[Outcome]) -> list[PassPlan]:
        """Each pass alone, at its own defaults, not yet measured: the first design points, so that a short
        budget learns every pass's own effect before it combines them (one-factor-at-a-time screening)."""
        seen = {h.plan.hash() for h in history}
        return [p for p in self._screening_plans() if p.hash() not in seen]

    def incumbent(self, history: list[Outcome]) -> Outcome | None:
        """The best measured plan the screening did not propose (what serves, when a campaign starts from it), or
        None: a campaign that starts from a tuned plan has its neighbours to try before the screening is done."""
        points = {p.hash() for p in self._screening_plans()}
        given = [h for h in history if h.objective and not h.start and not h.pending and len(h.plan)
                 and h.plan.hash() not in points]
        return max(given, key=lambda h: h.objective, default=None)

    def prefer(self, names: list[str]) -> None:
        """Screen these passes first, in this order; the rest follow in the space's order. A re-optimisation
        passes what the campaign before it measured to gain most over what served (``watch.screened_gains``):
        after a drift the gains change size, but beside live traffic a campaign reaches only its first few
        screening points (H100, twenty-eighth session: the campaign after the drift screened again from the
        space's order and the traffic ended before ``lowered_decode``, which the campaign before had measured at
        +74% over what served)."""
        self.first_names = [n for n in names if any(p.name == n for p in self.space.passes)]

    def _screening_plans(self) -> list[PassPlan]:
        rank = {n: i for i, n in enumerate(self.first_names)}
        passes = sorted(self.space.passes, key=lambda p: rank.get(p.name, len(rank)))  # stable: the space's order
        return [PassPlan((PassStep(p.name, {}),)) for p in passes]

    def propose(self, n: int, history: list[Outcome]) -> list[Candidate]:
        first = self.screening(history)
        inc = self.incumbent(history) if first else None
        if first and inc is None:  # the whole screening is one round (module docstring), not the first n of it
            return [Candidate(self.name, p, note="screening: one pass at its defaults") for p in first]
        seen = {h.plan.hash() for h in history}
        mean, cov, _ = self.posterior(history)
        if inc is not None:  # screening not done: its points alternate with neighbours of the incumbent
            pool = self.space.neighbours(inc.plan)
            points = {p.hash() for p in self._screening_plans()}
            screened = sum(h.plan.hash() in points for h in history)
            around = sum(1 for h in history if not h.start and len(h.plan) and h.plan.hash() not in points) - 1
        else:
            ranked = sorted((h for h in history if h.objective and not h.start), key=lambda h: -h.objective)[:4]
            pool = [PassPlan()] + [self.space.random_plan(self.rng) for _ in range(self.pool // 2)]
            for h in ranked:
                pool += [self.space.mutate(h.plan, self.rng) for _ in range(self.pool // (2 * max(1, len(ranked))))]
        nrng = np.random.default_rng(self.rng.randrange(2**32))
        out, taken = [], set(seen)
        while len(out) < n:
            if inc is not None and first and around > screened:
                plan = first.pop(0)
                taken.add(plan.hash())
                screened += 1
                out.append(Candidate(self.name, plan, note="screening: one pass at its defaults"))
                continue
            w = nrng.multivariate_normal(mean, cov, method="cholesky")
            best = max((p for p in pool if p.hash() not in taken), key=lambda p: float(self.encode(p) @ w),
                       default=None)
            if best is None:
                if inc is not None and first:  # no neighbour left: the screening goes on
                    around = screened + 1
                    continue
                break
            taken.add(best.hash())
            first = [p for p in first if p.hash() != best.hash()]
            around = around + 1 if inc is not None else 0
            note = f"predicted log-gain {float(self.encode(best) @ mean):+.3f}"
            out.append(Candidate(self.name, best, note=note + (f", a neighbour of {inc.plan.hash()[:8]}"
                                                              if inc is not None else "")))
        return out
