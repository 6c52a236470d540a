"""PassManager: apply a PassPlan to a Program, checking every step.

For each step of the plan, in order:

1. resolve the pass by name and check its parameters against its declared
   space (an unknown pass or an out-of-range value is a PlanError that names
   the step; the whole plan is checked before any pass runs);
2. give the pass the graphs to edit (the first pass: a copy of every phase
   graph, fresh graph, the same parameter tensors: weights are shared, never
   copied; later passes: the graphs the previous pass returned, which only
   the manager holds, copied again only if a pass returned graphs it did not
   get from the manager) and time it;
3. lint each graph (FX lint, recompile, placeholders unchanged);
4. run each graph on the example inputs and compare with the previous
   graph's outputs: bit for bit if the pass declares ``exact``, within the
   dtype's tolerance otherwise; a mismatch is a PassError naming the pass,
   the phase and the first differing output;
5. write a PassLog: counts, node diff, provenance of every new node, time,
   readable code before and after.

A pass that raises is reported as a PassError naming the pass and phase; the
Program the caller passed in is never modified.

Cost: FX turns a graph into Python on every ``recompile`` (on a 16-block MoE
graph of ~1800 nodes, about 0.1 s each, and a deep copy costs as much), and
a copy, the pass's own recompile and the lint's recompile would do it three
times per pass and phase. The graphs passes get are lazy GraphModules:
``recompile`` only marks them stale, and the manager generates the code once
per pass and phase, after the pass and the lint, where it is checked to
compile and read for the log (a pass or caller that reads ``.code`` or calls
the module gets it generated then). With ``check_numerics=False`` and
``log_code=False`` (the engine: its validation runs the whole rewritten
forward on fresh inputs of several shapes, and its codegen reads the graph,
not FX's Python), a step costs the pass and an FX lint; the final graphs
generate their Python lazily if anyone calls them.
"""
from __future__ import annotations

import dataclasses
import time
import weakref

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
            raise PlanError(f"plan step {i + 1} ({step.name!r}): {e}") from None
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


try:  # torch >= 2.3; without it every copy is generated eagerly (same results, slower)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _Lazy
except ImportError:  # pragma: no cover
    _Lazy = None


def _copy_for_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``clone_graph_module``, as a lazy GraphModule: no Python generated until the manager (or a reader) asks."""
    return clone_graph_module(gm, _Lazy) if _Lazy is not None else clone_graph_module(gm)


def _generate(gm: torch.fx.GraphModule, where: str) -> None:
    """Generate a lazy GraphModule's Python now (a no-op for one already generated); PassError if it cannot."""
    if _Lazy is not None and isinstance(gm, _Lazy):
        try:
            gm.real_recompile()
        except Exception as e:
            raise PassError(f"{where}: graph does not compile to Python: {type(e).__name__}: {e}") from e


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
    log_code:       generate each phase's Python after every pass (the log's
                    code_before/code_after, and a check that it compiles);
                    with check_numerics off, False skips that (see above).
    mode:           None (each pass checked by its own exactness flag), "exact"
                    (refuse passes that are not exact) or "tolerance".
    rtol/atol:      override the dtype default tolerances for inexact passes.
    context:        objects from the caller that passes name in ``Pass.context_keys`` (for example
                    ``routing`` for ``moe_regroup``); ``tkcc.pipeline.pass_context()`` has the defaults.
    """

    def __init__(self, check_numerics: bool = True, lint: bool = True, mode: str | None = None,
                 rtol: float | None = None, atol: float | None = None, log_code: bool = True,
                 context: dict | None = None):
        if mode not in (None, "exact", "tolerance"):
            raise PlanError(f"mode must be 'exact' or 'tolerance', got {mode!r}")
        self.check_numerics, self.lint, self.mode = check_numerics, lint, mode
        self.context = dict(context or {})
        self.log_code = log_code or check_numerics  # a checked graph is run, which generates its code anyway
        self.rtol, self.atol = rtol, atol

    def run(self, program, plan, example_inputs=None):
        """Return ``(program', [PassLog, ...])``; ``program`` itself is left unchanged."""
        plan = _as_plan(plan)
        steps = resolve_plan(plan)
        if self.mode == "exact":
            for i, (step, cls, _) in enumerate(steps):
                if not cls.exact:
                    raise PlanError(f"plan step {i + 1} ({step.name!r}): pass is not bit-exact and mode is 'exact'; "
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
        owned = weakref.WeakSet()  # the graph modules the manager made (no one else holds them)
        codes = {ph: gm.code for ph, gm in program.graphs.items()} if self.log_code and steps else {}
        for i, (step, cls, params) in enumerate(steps):
            program, log = self._apply_one(i, step, cls, params, program, inputs, signatures, reference, owned,
                                           codes)
            logs.append(log)
        meta = dict(program.meta)
        meta["plan"] = plan.to_json()
        meta["plan_hash"] = plan.hash()
        return dataclasses.replace(program, meta=meta), logs

    # ---- one step --------------------------------------------------------------------------
    def _apply_one(self, i, step, cls, params, program, inputs, signatures, reference, owned, codes):
        where = f"pass {step.name!r} (plan step {i + 1})"
        before_code = dict(codes)
        before_names = {ph: [n.name for n in gm.graph.nodes] for ph, gm in program.graphs.items()}
        mine = {}
        for ph, gm in program.graphs.items():
            if gm not in owned:  # the caller's graph, or one a pass made: copy before anyone edits it
                gm = _copy_for_pass(gm)
                owned.add(gm)
            mine[ph] = gm
        copies = dataclasses.replace(program.with_graphs(mine), meta=dict(program.meta))
        t0 = time.perf_counter()
        try:
            given = {k: self.context[k] for k in cls.context_keys if k in self.context}
            result = cls().apply(copies, **params, **given)
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
            if self.log_code:
                _generate(gm, f"{where}, phase {ph!r}")  # once per pass and phase: checked, then read below
                codes[ph] = gm.code
            names_after = [n.name for n in gm.graph.nodes]
            old = set(before_names[ph])
            new = set(names_after)
            added = [n for n in names_after if n not in old]
            removed = [n for n in before_names[ph] if n not in new]
            by_name = {n.name: n for n in gm.graph.nodes}
            plog = PhaseLog(phase=ph, nodes_before=len(old), nodes_after=len(new), added=added, removed=removed,
                            provenance={n: _provenance(by_name[n], ph, info) for n in added},
                            code_before=before_code.get(ph, ""), code_after=codes.get(ph, ""))
            if self.check_numerics and not added and not removed and codes[ph] == before_code[ph]:
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
