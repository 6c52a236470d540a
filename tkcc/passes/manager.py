"""PassManager: apply a PassPlan to a Program, checking every step.

For each step of the plan, in order:

1. resolve the pass by name and check its parameters against its declared
   space (an unknown pass or an out-of-range value is a PlanError that names
   the step; the whole plan is checked before any pass runs);
2. give the pass a copy of every phase graph (fresh graph, the same
   parameter tensors: weights are shared, never copied) and time it;
3. lint each graph (FX lint, recompile, placeholders unchanged);
4. run each graph on the example inputs and compare with the previous
   graph's outputs: bit for bit if the pass declares ``exact``, within the
   dtype's tolerance otherwise; a mismatch is a PassError naming the pass,
   the phase and the first differing output;
5. write a PassLog: counts, node diff, provenance of every new node, time,
   readable code before and after.

A pass that raises is reported as a PassError naming the pass and phase; the
Program the caller passed in is never modified.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.fx

from tkcc.errors import PassError, PlanError, TkccError
from tkcc.passes.base import Pass, RewriteInfo, get_pass
from tkcc.passes.graph_pass import clone_graph_module
from tkcc.passes.lint import compare, lint_graph, placeholders, run_graph
from tkcc.passes.log import PassLog, PhaseLog
from tkcc.passes.plan import PassPlan, PassStep


def resolve_plan(plan: PassPlan) -> list[tuple[PassStep, type[Pass], dict]]:
    """Each step's pass class and full parameters; PlanError naming the step on bad input."""
    if isinstance(plan, (list, str)):
        plan = PassPlan.from_json(plan)
    out = []
    for i, step in enumerate(plan.steps):
        try:
            cls = get_pass(step.name)
            params = cls.check_params(step.params)
        except PlanError as e:
            raise PlanError(f"plan step {i} ({step.name!r}): {e}") from None
        out.append((step, cls, params))
    return out


def _as_plan(plan) -> PassPlan:
    if plan is None:
        return PassPlan()
    if isinstance(plan, PassPlan):
        return plan
    return PassPlan.from_json(plan)


def _example_inputs(program, example_inputs) -> dict[str, tuple]:
    if example_inputs is None:
        return dict(program.example_inputs)
    if isinstance(example_inputs, dict):
        return {**program.example_inputs, **example_inputs}
    if len(program.graphs) != 1:
        raise PlanError("example_inputs given as a tuple, but the program has phases "
                        f"{program.phases}; pass a dict phase -> inputs")
    return {program.phases[0]: tuple(example_inputs)}


def _provenance(node: torch.fx.Node, phase: str, info: RewriteInfo) -> list[str]:
    for key in (f"{phase}:{node.name}", node.name):
        if key in info.provenance:
            return [str(s) for s in info.provenance[key]]
    if node.meta.get("tkcc_from"):
        return [str(s) for s in node.meta["tkcc_from"]]
    srcs = []
    for src in node.meta.get("from_node", None) or []:
        name = getattr(src, "name", None)
        if name and name != node.name and name not in srcs:
            srcs.append(name)
    return srcs


class PassManager:
    """Apply a plan with lint and numerics checks after every pass.

    check_numerics: run each phase graph on example inputs after every pass.
    lint:           FX lint + recompile + signature check after every pass.
    mode:           None (each pass checked by its own exactness flag), "exact"
                    (refuse passes that are not exact) or "tolerance".
    rtol/atol:      override the dtype default tolerances for inexact passes.
    """

    def __init__(self, check_numerics: bool = True, lint: bool = True, mode: str | None = None,
                 rtol: float | None = None, atol: float | None = None):
        if mode not in (None, "exact", "tolerance"):
            raise PlanError(f"mode must be 'exact' or 'tolerance', got {mode!r}")
        self.check_numerics, self.lint, self.mode = check_numerics, lint, mode
        self.rtol, self.atol = rtol, atol

    def run(self, program, plan, example_inputs=None):
        """Return ``(program', [PassLog, ...])``; ``program`` itself is left unchanged."""
        plan = _as_plan(plan)
        steps = resolve_plan(plan)
        if self.mode == "exact":
            for i, (step, cls, _) in enumerate(steps):
                if not cls.exact:
                    raise PlanError(f"plan step {i} ({step.name!r}): pass is not bit-exact and mode is 'exact'; "
                                    "use mode='tolerance' to allow it")
        inputs = _example_inputs(program, example_inputs)
        signatures = {ph: placeholders(gm) for ph, gm in program.graphs.items()}
        reference = {}
        if self.check_numerics and steps:
            for ph, gm in program.graphs.items():
                if ph not in inputs:
                    raise PlanError(f"no example inputs for phase {ph!r}; cannot check numerics")
                reference[ph] = self._run(program, gm, inputs[ph], f"input program, phase {ph!r}")
        logs: list[PassLog] = []
        for i, (step, cls, params) in enumerate(steps):
            program, log = self._apply_one(i, step, cls, params, program, inputs, signatures, reference)
            logs.append(log)
        meta = dict(program.meta)
        meta["plan"] = plan.to_json()
        meta["plan_hash"] = plan.hash()
        return dataclasses.replace(program, meta=meta), logs

    # ---- one step --------------------------------------------------------------------------
    def _apply_one(self, i, step, cls, params, program, inputs, signatures, reference):
        where = f"pass {step.name!r} (plan step {i})"
        before_code = {ph: gm.code for ph, gm in program.graphs.items()}
        before_names = {ph: [n.name for n in gm.graph.nodes] for ph, gm in program.graphs.items()}
        copies = program.with_graphs({ph: clone_graph_module(gm) for ph, gm in program.graphs.items()})
        copies = dataclasses.replace(copies, meta=dict(program.meta))
        t0 = time.perf_counter()
        try:
            result = cls().apply(copies, **params)
        except TkccError:
            raise
        except Exception as e:
            raise PassError(f"{where} raised {type(e).__name__}: {e}") from e
        elapsed = time.perf_counter() - t0
        if not (isinstance(result, tuple) and len(result) == 2):
            raise PassError(f"{where}: apply() must return (program, RewriteInfo), got {type(result).__name__}")
        new_program, info = result
        info = info if isinstance(info, RewriteInfo) else RewriteInfo()
        if not hasattr(new_program, "graphs") or set(new_program.graphs) != set(program.graphs):
            got = sorted(getattr(new_program, "graphs", {}) or {})
            raise PassError(f"{where}: returned phases {got}, expected {sorted(program.graphs)}")

        log = PassLog(index=i + 1, name=step.name, version=str(cls.version), params=params, exact=bool(cls.exact),
                      matched=info.matched, replaced=info.replaced, time_s=elapsed, notes=list(info.notes),
                      kernels=dict(info.kernels))
        t1 = time.perf_counter()
        for ph, gm in new_program.graphs.items():
            if self.lint:
                lint_graph(gm, f"{where}, phase {ph!r}", signatures[ph])
            names_after = [n.name for n in gm.graph.nodes]
            old = set(before_names[ph])
            new = set(names_after)
            added = [n for n in names_after if n not in old]
            removed = [n for n in before_names[ph] if n not in new]
            by_name = {n.name: n for n in gm.graph.nodes}
            plog = PhaseLog(phase=ph, nodes_before=len(old), nodes_after=len(new), added=added, removed=removed,
                            provenance={n: _provenance(by_name[n], ph, info) for n in added},
                            code_before=before_code[ph], code_after=gm.code)
            if self.check_numerics and not added and not removed and gm.code == before_code[ph]:
                plog.check = "unchanged"  # same code, same nodes: nothing to run
            elif self.check_numerics:
                got = self._run(new_program, gm, inputs[ph], f"{where}, phase {ph!r}")
                cmp = compare(reference[ph], got, exact=cls.exact and self.mode != "tolerance",
                              rtol=self.rtol, atol=self.atol)
                if not cmp.ok:
                    raise PassError(f"{where} changed the outputs of phase {ph!r}: {cmp.reason}; "
                                    f"first difference at {cmp.first_diff}")
                plog.check = "exact" if cmp.exact else "tolerance"
                plog.max_abs_err, plog.max_rel_err = cmp.max_abs_err, cmp.max_rel_err
                reference[ph] = got
            log.phases[ph] = plog
        log.check_time_s = time.perf_counter() - t1
        return new_program, log

    def _run(self, program, gm, inputs, where):
        try:
            return run_graph(gm, inputs, program)
        except Exception as e:
            raise PassError(f"{where}: graph failed to run on the example inputs: {type(e).__name__}: {e}") from e


def apply_plan(program, plan, example_inputs=None, **kwargs):
    """Shorthand: ``PassManager(**kwargs).run(program, plan, example_inputs)``."""
    return PassManager(**kwargs).run(program, plan, example_inputs)


def load_pass_module(path) -> list[str]:
    """Import a user's Python file (or dotted module) so the passes it ``@register``s join the registry.

    Returns the names of the passes it registered. A missing file or an
    import error is a PlanError naming the file.
    """
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    from tkcc.passes.base import REGISTRY, _load_builtin_passes

    _load_builtin_passes()
    before = dict(REGISTRY)
    p = Path(str(path))
    try:
        if p.suffix == ".py" or p.exists():
            if not p.is_file():
                raise PlanError(f"pass module {str(path)!r}: file not found")
            mod_name = f"tkcc_user_passes_{abs(hash(str(p.resolve())))}"
            if mod_name not in sys.modules:
                spec = importlib.util.spec_from_file_location(mod_name, p)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = mod
                try:
                    spec.loader.exec_module(mod)
                except BaseException:
                    sys.modules.pop(mod_name, None)
                    raise
        else:
            importlib.import_module(str(path))
    except PlanError:
        raise
    except Exception as e:
        raise PlanError(f"pass module {str(path)!r} failed to import: {type(e).__name__}: {e}") from e
    return sorted(k for k, v in REGISTRY.items() if before.get(k) is not v)
