"""The backend's options: ``torch.compile(model, backend="tkcc", options={...})``, one typed record.

Keys (all optional):

- ``mode``: ``"exact"`` (default) or ``"tolerance"``: which of tkcc's own passes its candidates may use
  (``torch.compile(..., mode="exact")`` says the same). It does not make Inductor exact.
- ``search_s``: per-graph search budget in seconds (default 0, or ``$TKCC_BACKEND_SEARCH_S``). With a
  budget, each graph also tries tkcc's own plan (with and without CUDA-graph replay), the graph's own
  eager forward, and tuned Inductor configurations, and keeps the fastest by measurement. The budget
  is checked between candidates: one started inside it runs to the end.
- ``inductor``: ``True`` (default); ``False`` keeps every graph bit-exact: only tkcc's exact candidates
  and the eager graph, never Inductor.
- ``cudagraphs``: ``True`` (default): on CUDA, a CUDA-graph replay of the baseline is measured against
  it on the first call (beside the eager graph), and taken only where faster.
- ``plan``: the pass plan of tkcc's own candidate (a PassPlan or its JSON; default: the default plan
  of ``mode``).
- ``tolerance``: the bound for Inductor-compiled graphs, as a fraction of the output's scale (its
  largest magnitude); default: the dtype's row of ``tkcc.passes.lint.TOLERANCES`` (fp32 on CUDA with
  TF32 matmuls/convolutions allowed: ``tkcc.backend.graph.TF32_FLOOR``).
- ``inductor_options``: Inductor config patches for the baseline compile (``{"max_autotune": True}``).
- ``reps``: timed calls per candidate (default 30 on CUDA, 10 on CPU; fewer, at least 6, for a graph
  slower than 0.2 s / reps).
- ``min_gain``: the smallest relative gain that replaces the baseline (default 0.02; the 95 % intervals
  of the two medians must not overlap either).
- ``codegen``: ``True`` (default): tkcc's candidate runs its generated forward, else the rewritten graph.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from tkcc.errors import BackendError, PlanError

SEARCH_ENV = "TKCC_BACKEND_SEARCH_S"
MODES = ("exact", "tolerance")


@dataclass(frozen=True)
class BackendOptions:
    mode: str = "exact"
    search_s: float = 0.0
    inductor: bool = True
    cudagraphs: bool = True
    plan: Any = None            # a PassPlan, or None for default_plan(mode)
    tolerance: float | None = None
    inductor_options: dict = field(default_factory=dict)
    reps: int | None = None
    min_gain: float = 0.02
    codegen: bool = True

    @classmethod
    def parse(cls, options: Mapping | None = None, mode: str | None = None,
              env: Mapping | None = None) -> "BackendOptions":
        """Options from ``torch.compile``'s ``options`` and ``mode``, and the environment; BackendError if bad."""
        env = os.environ if env is None else env
        if options is not None and not isinstance(options, Mapping):
            raise BackendError(f"tkcc backend: options must be a dict, got {type(options).__name__}")
        opts = dict(options or {})
        known = [f.name for f in fields(cls)]
        for key in opts:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise BackendError(f"tkcc backend: unknown option {key!r}{hint}; known options: {', '.join(known)}")
        if mode is not None:
            if "mode" in opts and opts["mode"] != mode:
                raise BackendError(f"tkcc backend: torch.compile(mode={mode!r}) and options['mode']="
                                   f"{opts['mode']!r} disagree")
            opts["mode"] = mode
        out = {}
        m = opts.get("mode", "exact")
        if m not in MODES:
            raise BackendError(f"tkcc backend: mode {m!r} is not one of {list(MODES)} (Inductor's own modes go "
                               "through options={'inductor_options': {...}}, e.g. {'max_autotune': True})")
        out["mode"] = m
        if "search_s" in opts:
            out["search_s"] = _seconds(opts["search_s"], "options['search_s']")
        elif env.get(SEARCH_ENV, "").strip():
            out["search_s"] = _seconds(env[SEARCH_ENV], f"${SEARCH_ENV}")
        for key in ("inductor", "cudagraphs", "codegen"):
            if key in opts:
                if not isinstance(opts[key], bool):
                    raise BackendError(f"tkcc backend: options[{key!r}] must be True or False, got {opts[key]!r}")
                out[key] = opts[key]
        if opts.get("plan") is not None:
            out["plan"] = _plan(opts["plan"], m)
        if opts.get("tolerance") is not None:
            t = opts["tolerance"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < 1):
                raise BackendError(f"tkcc backend: options['tolerance'] must be a number in (0, 1) (a fraction "
                                   f"of the output's scale), got {t!r}")
            out["tolerance"] = float(t)
        if "inductor_options" in opts:
            out["inductor_options"] = _inductor_options(opts["inductor_options"])
        if opts.get("reps") is not None:
            r = opts["reps"]
            if isinstance(r, bool) or not isinstance(r, int) or r < 6:
                raise BackendError(f"tkcc backend: options['reps'] must be an integer >= 6 (a median's 95 % "
                                   f"interval needs 6 samples), got {r!r}")
            out["reps"] = r
        if "min_gain" in opts:
            g = opts["min_gain"]
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 <= g < 1):
                raise BackendError(f"tkcc backend: options['min_gain'] must be a number in [0, 1), got {g!r}")
            out["min_gain"] = float(g)
        return cls(**out)


def _seconds(value, where: str) -> float:
    """A duration in seconds: a non-negative finite number, or a string like "5" or "5s"."""
    v = value
    if isinstance(v, str):
        s = v.strip().lower()
        s = s[:-1] if s.endswith("s") else s
        try:
            v = float(s)
        except ValueError:
            raise BackendError(f"tkcc backend: {where}={value!r} is not a duration in seconds "
                               "(e.g. 5 or '5s')") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise BackendError(f"tkcc backend: {where}={value!r} must be a finite number of seconds >= 0")
    return float(v)


def _plan(plan, mode: str):
    from tkcc.passes.plan import PassPlan

    from tkcc.passes.manager import resolve_plan

    try:
        plan = plan if isinstance(plan, PassPlan) else PassPlan.from_json(plan)
        for i, (step, cls, _) in enumerate(resolve_plan(plan)):
            if mode == "exact" and not cls.exact:
                raise PlanError(f"plan step {i} ({step.name!r}): pass is not bit-exact and mode is 'exact'; "
                                "use mode='tolerance' to allow it")
            if not getattr(cls, "emits_source", True):
                raise PlanError(f"plan step {i} ({step.name!r}): the backend replays CUDA graphs itself "
                                "(option 'cudagraphs'); this pass runs in-process only")
    except PlanError as e:
        raise BackendError(f"tkcc backend: options['plan']: {e}") from None
    return plan


def _inductor_options(patches) -> dict:
    if not isinstance(patches, Mapping):
        raise BackendError(f"tkcc backend: options['inductor_options'] must be a dict of Inductor config "
                           f"patches, got {type(patches).__name__}")
    from torch._inductor import config

    known = config.get_config_copy()
    for key in patches:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise BackendError(f"tkcc backend: options['inductor_options']: {key!r} is not an Inductor config "
                               f"option{hint}")
    return dict(patches)
