"""Experiments per hour, and where each experiment's time went: on the engine's critical path, or in parallel.

An engine experiment spends time in phases:

* ``render``: the candidate's build (passes, codegen, loading the artifact), and its discovery ahead
  (``prepare``), both done by the engine;
* ``compile``: on the critical path, the wait for the candidate's own kernel compiles (compiled ahead by
  the pool) plus any compile the engine's JIT still ran itself; in parallel, the pool's worker-seconds on
  the candidate's kernels (they overlap with the engine's work on other candidates);
* ``validate``, ``capture`` (swap and CUDA-graph capture, also where a measurement captured first),
  ``measure``: the engine's, minus the JIT compiles inside them (counted under compile);
* ``check``: inside a measurement, the sampled checks of timed calls against the reference (and the fp32
  reference's opinion where a candidate is past the scaled bound), counted apart from the timing itself;
* ``other``: the rest of the experiment's wall time (RPC, revert, journal).

``phases_of`` reads them from the engine's record of one tier; ``Throughput`` adds up a campaign's, and
says experiments per hour over the whole wall time, start-up included.
"""
from __future__ import annotations

PHASES = ("render", "compile", "validate", "capture", "measure", "check", "other")


def _f(x) -> float:
    try:
        return max(0.0, float(x or 0.0))
    except (TypeError, ValueError):
        return 0.0


def _jit(d) -> float:
    return _f(((d or {}).get("jit") or {}).get("compile_s"))


def phases_of(rec: dict, build: dict | None = None, prepared: dict | None = None) -> dict:
    """{"critical": {phase: s}, "parallel": {"compile": s}} of one engine experiment on one tier.

    ``rec``: the experiment's tier record (``Supervisor.experiment``); ``build``: the ``load`` result of the
    separate build that preceded it, if any (the experiment's own load then found the candidate built);
    ``prepared``: what ``prepare`` said of it (its discovery's render time)."""
    crit = dict.fromkeys(PHASES, 0.0)
    par = {"compile": 0.0}
    load, val, swap, meas = (rec.get(k) or {} for k in ("load", "validation", "swap", "measurement"))
    built = build if build else load  # the build's own record: a separate load, or the experiment's
    waited = [_f((k or {}).get("wait_s")) for k in ((build or {}).get("kernels"), rec.get("kernels"))]
    jits = [_jit(x) for x in (val, swap, meas)] + [_jit(build)] * bool(build) + [_jit(load)]
    crit["render"] = max(0.0, _f(built.get("compile_s")) - _jit(built)) + _f((prepared or {}).get("render_s"))
    crit["compile"] = sum(waited) + sum(jits)
    par["compile"] = sum(_f((k or {}).get("compile_s")) for k in ((build or {}).get("kernels"), rec.get("kernels")))
    crit["validate"] = max(0.0, _f(val.get("seconds")) - _jit(val))
    crit["capture"] = max(0.0, _f(swap.get("swap_s")) + _f(swap.get("capture_s")) - _jit(swap)) \
        + _f(meas.get("capture_s"))
    crit["check"] = sum(_f(v) for v in ((meas.get("checks") or {}).get("seconds") or {}).values())
    crit["measure"] = max(0.0, _f(meas.get("supervisor_wall_s")) - _jit(meas) - _f(meas.get("capture_s"))
                          - crit["check"])
    # what of that ran inside the experiment's own wall time (a separate build and prepare ran before it)
    inside = (crit["validate"] + crit["capture"] + crit["measure"] + crit["check"] + waited[1] + _jit(load)
              + sum(jits[:3])
              + (0.0 if build else max(0.0, _f(load.get("compile_s")) - _jit(load))))
    crit["other"] = max(0.0, _f(rec.get("seconds")) - inside)
    return {"critical": {k: round(v, 4) for k, v in crit.items()}, "parallel": {k: round(v, 4) for k, v in par.items()}}


class Throughput:
    """A campaign session's experiments and their phases (see the module docstring)."""

    def __init__(self):
        self.experiments = 0
        self.by_tier: dict[str, int] = {}
        self.critical = dict.fromkeys(PHASES, 0.0)
        self.parallel = {"compile": 0.0}

    def add(self, tier: str, timing: dict | None, seconds: float) -> None:
        """One experiment (not a reused result) that took ``seconds`` of the campaign's wall time."""
        self.experiments += 1
        self.by_tier[tier] = self.by_tier.get(tier, 0) + 1
        if not timing:
            self.critical["other"] += max(0.0, seconds)
            return
        for k, v in (timing.get("critical") or {}).items():
            self.critical[k] = self.critical.get(k, 0.0) + _f(v)
        for k, v in (timing.get("parallel") or {}).items():
            self.parallel[k] = self.parallel.get(k, 0.0) + _f(v)

    def to_json(self, wall_s: float, startup_s: float = 0.0) -> dict:
        per_hour = 3600.0 * self.experiments / wall_s if wall_s > 0 else None
        return {"experiments": self.experiments, "by_tier": dict(self.by_tier), "wall_s": round(wall_s, 2),
                "startup_s": round(startup_s, 2),
                "experiments_per_hour": round(per_hour, 1) if per_hour is not None else None,
                "critical_s": {k: round(v, 2) for k, v in self.critical.items()},
                "parallel_s": {k: round(v, 2) for k, v in self.parallel.items()}}


def describe(t: dict) -> list[str]:
    """Terminal lines for a ``Throughput.to_json()``."""
    if not t or not t.get("experiments"):
        return ["throughput: no experiment ran"]
    tiers = ", ".join(f"{n} {k}" for k, n in sorted(t.get("by_tier", {}).items()))
    crit = t.get("critical_s") or {}
    par = t.get("parallel_s") or {}
    total = sum(crit.values())
    parts = ", ".join(f"{k} {crit.get(k, 0.0):.1f}" for k in PHASES)
    return [f"throughput: {t['experiments']} experiments ({tiers}) in {t['wall_s']:.0f} s, start-up "
            f"{t.get('startup_s', 0):.0f} s included: {t['experiments_per_hour']:.0f} experiments/hour",
            f"  engine's critical path {total:.1f} s: {parts} (s)",
            f"  in parallel: kernel compiles {par.get('compile', 0.0):.1f} worker-s"]
