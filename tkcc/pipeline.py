"""The one build: plan -> passes -> artifact -> loaded forwards. Every caller uses it.

``tkcc.compile`` (its plan, and the winner it ships), the engine's plan
candidates (``tkcc.runtime.candidates``), the ``torch.compile`` backend and
the tensor-parallel ranks all turn a plan into forwards here, so a candidate
the engine measured is built by exactly the code that builds what the user
gets. What differs between callers is a setting, not a copy of the steps:

- ``check_numerics`` / ``log_code``: the PassManager compares every pass's
  output with the previous graph's and keeps each graph's code for the pass
  log (off in the engine, which validates the whole forward on fresh inputs
  and several shapes before anything is measured);
- ``codegen``: off only where a forward's tensors are not the model's by name
  (a rank's weight shards), where the rewritten FX graphs are the forwards;
- ``context``: what passes take from the layers above them (``pass_context``:
  by default the bundled MoE routing that ``moe_regroup``'s ``hot_first``
  orders experts by; a caller with a workload may give its own).

A rewritten graph that codegen cannot emit is a build failure: every
candidate that can be served is an artifact that loads in another process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Build:
    """What one plan became: the rewritten Program, its pass logs, its artifact and the forwards to call."""

    program: object                 # the rewritten Program
    logs: list
    forwards: dict                  # phase -> callable
    artifact: object | None = None  # tkcc.codegen.artifact.Artifact (None when codegen is off)
    seconds: dict = field(default_factory=dict)
    meta_launches: int = 0          # with list_kernels: generated kernels launched on meta tensors


def pass_context(**given) -> dict:
    """The PassManager's context (``Pass.context_keys``), ``given`` overriding the defaults:

    - ``routing``: ``(layers, experts, k) -> Routing``, the MoE routing distribution ``moe_regroup``'s
      ``expert_order="hot_first"`` orders experts by (default ``tkcc.traffic.routing.Routing.for_model``,
      real skew fitted to the graph's shape)."""
    from tkcc.traffic.routing import Routing

    return {"routing": Routing.for_model, **given}


def build(program, plan, out_dir=None, *, mode: str | None = None, check_numerics: bool = True, log_code: bool = True,
          codegen: bool = True, tier: int | None = None, aot_targets: tuple[str, ...] = (),
          list_kernels: bool = False, context: dict | None = None) -> Build:
    """Apply ``plan`` to ``program`` and lower the result to an artifact at ``out_dir`` (required with codegen).

    ``mode``: the PassManager's: "exact" refuses passes that are not bit-exact, "tolerance" allows them, None
    (the engine) checks each pass by its own flag and leaves the verdict to the engine's validation.
    ``list_kernels``: also launch every generated kernel once at its captured shapes, on meta tensors, so a
    surrounding ``tkcc.kernels.discovery.deferring`` block lists the compiles the artifact needs (with the
    compiles its passes asked for while they ran: a kernel tuner's configs). The engine's ``discover``.
    ``context``: the passes' context (default ``pass_context()``)."""
    from tkcc.passes.manager import PassManager

    t0 = time.perf_counter()
    manager = PassManager(mode=mode, check_numerics=check_numerics, log_code=log_code,
                          context=pass_context() if context is None else context)
    rewritten, logs = manager.run(program, plan)
    t1 = time.perf_counter()
    if not codegen:
        return Build(rewritten, logs, dict(rewritten.graphs), None, {"passes_s": t1 - t0})
    from tkcc.codegen.artifact import build_artifact

    if out_dir is None:
        raise ValueError("pipeline.build: codegen needs out_dir")
    art = build_artifact(rewritten, plan, Path(out_dir), tier=tier, aot_targets=aot_targets)
    t2 = time.perf_counter()
    forwards = dict(art.load(rewritten))
    seconds = {"passes_s": t1 - t0, "codegen_s": t2 - t1, "load_s": time.perf_counter() - t2}
    if list_kernels:
        t3 = time.perf_counter()
        meta = art.launch_generated()
        seconds["list_kernels_s"] = time.perf_counter() - t3
        return Build(rewritten, logs, forwards, art, seconds, meta)
    return Build(rewritten, logs, forwards, art, seconds)
