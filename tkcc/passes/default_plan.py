"""The default plan, and the plan a user gave (a PassPlan, JSON text or a JSON file) read into a PassPlan.

Every front door builds the same default (``tkcc.compile``, the torch.compile
backend, the HTTP server, the external agent's starting point) and reads a
user's plan the same way, so both live here, below all of them.
"""
from __future__ import annotations

from pathlib import Path

from tkcc.errors import PlanError
from tkcc.passes.general import DEFAULT_EXACT_PLAN
from tkcc.passes.plan import PassPlan

# fusion passes tried after the general ones, by mode (names as registered by tkcc.passes.fusion)
_FUSION = {"exact": ["fuse_elementwise_exact"], "tolerance": ["fuse_elementwise"]}


def default_plan(mode: str = "exact") -> PassPlan:
    """General exact passes, then the fusion pass for ``mode`` if it is registered, then a final cleanup."""
    from tkcc.passes.base import all_passes

    registered = all_passes()
    steps = list(DEFAULT_EXACT_PLAN)
    for name in _FUSION.get(mode, []):
        if name in registered and (mode == "tolerance" or registered[name].exact):
            steps.append((name, {}))
            steps.append(("dce", {}))
            break
    return PassPlan.of(*steps)


def resolve_plan(plan, mode: str) -> PassPlan:
    """The plan a user gave (None: the default plan for ``mode``; a PassPlan; JSON text; a JSON file)."""
    if plan is None:
        return default_plan(mode)
    if isinstance(plan, PassPlan):
        return plan
    if isinstance(plan, (str, Path)) and not str(plan).lstrip().startswith("[") and Path(str(plan)).is_file():
        text = Path(str(plan)).read_text()
        try:
            return PassPlan.from_json(text)
        except PlanError as e:
            raise PlanError(f"{plan}: {e}") from None
    if isinstance(plan, Path) or (isinstance(plan, str) and looks_like_path(plan)):
        raise PlanError(f"plan file {str(plan)!r}: no such file (a plan is a JSON file or JSON text such as "
                        '\'[{"name": "cse"}, {"name": "dce"}]\')')
    return PassPlan.from_json(plan)


def looks_like_path(text: str) -> bool:
    """Text that names a file rather than holding JSON: no bracket or brace first, a .json suffix or a slash."""
    t = text.strip()
    return bool(t) and t[0] not in "[{\"" and (t.endswith(".json") or "/" in t or "\\" in t)
