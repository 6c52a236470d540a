"""Pass: a named, parameterised graph rewrite, and the registry that names them.

A pass is a class with ``name``, ``version``, ``exact`` (does it keep outputs
bit-exact with the eager reference?), ``params`` (its search space: param name
-> list of allowed values; the first is the default) and
``apply(program, **params) -> (program, PassLogInfo)``. The ``@register``
decorator makes it available to plans, so a user's pass defined in their own
file is a first-class pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from tkcc.errors import PlanError

REGISTRY: dict[str, type["Pass"]] = {}

# Where a pass runs in a plan the search composes (``plan_order``): first the rewrites that lower regions by
# the ops of the captured graph (LOWER: their patterns are what capture writes), then the cleanups (CLEANUP and
# after: host syncs, no-op casts, duplicates, dead code, in that order), then fusion of what no rewrite took
# (FUSE), then wrappers of the whole forward (WRAP). Why: in name order a composed plan ran ``cse`` and
# ``fuse_elementwise_exact`` before ``lowered_decode``; ``cse`` merged each layer's ``cos.unsqueeze(1)`` into
# one node every layer read, the fusion merged the ops the patterns match, and no attention lowered.
LOWER, CLEANUP, FUSE, WRAP = 10, 20, 30, 40


@dataclass
class RewriteInfo:
    """What a pass reports about its own work; the PassManager adds the rest
    (node counts, timings, readable graphs before and after, provenance)."""

    matched: int = 0
    replaced: int = 0
    notes: list[str] = field(default_factory=list)
    # new node name -> names of the original nodes it came from (per phase: "phase:node")
    provenance: dict[str, list[str]] = field(default_factory=dict)
    kernels: dict[str, str] = field(default_factory=dict)  # generated kernel name -> source


class Pass:
    """Base class for graph rewrites. Subclass, set the class attributes, implement ``apply``."""

    name: ClassVar[str] = ""
    version: ClassVar[str] = "1"
    exact: ClassVar[bool] = True
    description: ClassVar[str] = ""
    params: ClassVar[dict[str, list[Any]]] = {}
    # False when the rewritten graph holds runtime objects (e.g. captured CUDA graphs) that codegen cannot
    # write into an artifact: such a pass serves in-process compiles (tkcc.compile), not the engine.
    emits_source: ClassVar[bool] = True
    # names in the caller's context (``PassManager(context=...)``) that ``apply`` takes as keywords: what a
    # pass needs from the layers above it (a workload's MoE routing), which it may not import. Not plan
    # parameters: not JSON, not in the plan's hash; ``tkcc.pipeline.pass_context()`` has the defaults.
    context_keys: ClassVar[tuple[str, ...]] = ()
    # where the pass goes in a composed plan (see LOWER above); a user's pass runs with the lowering rewrites
    stage: ClassVar[int] = LOWER

    def apply(self, program, **params):  # -> (Program, RewriteInfo)
        raise NotImplementedError

    @classmethod
    def space(cls, device=None, program=None) -> tuple[dict[str, list[Any]], dict[str, str]]:
        """(params, pruned): the parameter space less the values ``device`` cannot run (a kernel config
        that needs more shared memory than it has), and why each was pruned. By default nothing is."""
        return dict(cls.params), {}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {k: v[0] for k, v in cls.params.items()}

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Defaults filled in; unknown names and values outside the space rejected."""
        out = cls.defaults()
        for k, v in params.items():
            if k not in cls.params:
                raise PlanError(f"pass {cls.name!r} has no parameter {k!r}; it has: {sorted(cls.params) or 'none'}")
            allowed = cls.params[k]
            if v not in allowed and not cls.accepts(k, v):
                raise PlanError(f"pass {cls.name!r} parameter {k!r}={v!r} is out of range; allowed: {allowed}")
            out[k] = v
        return out

    @classmethod
    def accepts(cls, name: str, value: Any) -> bool:
        """Whether a plan may give ``value`` for ``name`` outside the searched space (a pass whose parameter
        is a format it parses, such as a tile or a list of spans, accepts every value it parses)."""
        return False


def register(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a Pass available to plans by its ``name``."""
    if not cls.name:
        raise PlanError(f"{cls.__qualname__} has no name; set `name = '...'` on the class")
    prev = REGISTRY.get(cls.name)
    if prev is not None and (prev.__module__, prev.__qualname__) != (cls.__module__, cls.__qualname__):
        raise PlanError(f"pass name {cls.name!r} is already registered by {prev.__module__}.{prev.__qualname__}")
    REGISTRY[cls.name] = cls
    return cls


def get_pass(name: str) -> type[Pass]:
    _load_builtin_passes()
    try:
        return REGISTRY[name]
    except KeyError:
        raise PlanError(f"unknown pass {name!r}; registered passes: {', '.join(sorted(REGISTRY)) or 'none'}") from None


def all_passes() -> dict[str, type[Pass]]:
    _load_builtin_passes()
    return dict(sorted(REGISTRY.items()))


def plan_order(passes) -> list:
    """Passes (classes) in the order a composed plan runs them: by ``stage``, then by name."""
    return sorted(passes, key=lambda p: (p.stage, p.name))


def _load_builtin_passes() -> None:
    """Import every module in tkcc.passes so built-in passes register themselves."""
    import importlib
    import pkgutil

    import tkcc.passes as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"tkcc.passes.{mod.name}")
