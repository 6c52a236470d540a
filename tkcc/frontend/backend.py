"""``torch.compile(model, backend="tkcc")``: tkcc as a dynamo backend.

Dynamo hands over each captured region as a Torch-level GraphModule;
``aot_autograd`` lowers it to an ATen graph (the level tkcc's passes and
codegen work on; parameters become graph inputs, so nothing is copied). The
ATen graph becomes a one-phase Program (``"forward"``) and gets the default
exact plan through the PassManager.

Compilation happens on the first real call: dynamo's example inputs may be
fake tensors, and the PassManager checks numerics on real ones (each pass
must reproduce the previous graph bit for bit on the call's own inputs).
The result is the generated forward from the codegen artifact where codegen
can lower the graph, else the rewritten FX graph (logged once).
"""
from __future__ import annotations

import hashlib
import logging

import torch

log = logging.getLogger("tkcc.backend")


def _program(gm: torch.fx.GraphModule, inputs: list):
    from tkcc.frontend.program import Program

    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    fp = hashlib.sha256(gm.code.encode()).hexdigest()[:16]
    meta = {"kind": "dynamo", "name": "dynamo-graph", "dtype": str(first.dtype).replace("torch.", "") if first is not None
            else None, "device": str(first.device) if first is not None else "cpu", "exact": True}
    return Program(graphs={"forward": gm}, example_inputs={"forward": tuple(inputs)}, layer_map={"forward": {}},
                   num_blocks=0, model=gm, fingerprint=fp, meta=meta)


class _LazyCompiled:
    """Compiles on the first call (real inputs), then runs the compiled forward."""

    def __init__(self, gm: torch.fx.GraphModule, plan, mode: str, codegen: bool):
        self.gm, self.plan, self.mode, self.codegen = gm, plan, mode, codegen
        self.fn = None
        self.logs = []
        self.artifact = None

    def _compile(self, args):
        from tkcc.passes.manager import PassManager

        program = _program(self.gm, list(args))
        compiled, self.logs = PassManager(mode=self.mode).run(program, self.plan)
        fn = compiled.graphs["forward"]
        if self.codegen:
            try:
                from tkcc.codegen.artifact import Artifact, build_artifact

                from tkcc.scratch import scratch_dir

                out = str(scratch_dir("tkcc-dynamo-"))  # removed at exit (TKCC_KEEP_TEMP keeps it)
                build_artifact(compiled, self.plan, f"{out}/artifact")
                self.artifact = Artifact.open(f"{out}/artifact")
                fn = self.artifact.load(compiled)["forward"]
            except ImportError:
                pass
            except Exception as e:  # noqa: BLE001 - a graph codegen cannot lower still runs as the checked FX graph
                log.warning("tkcc backend: codegen could not lower this graph (%s: %s); running the rewritten "
                            "FX graph", type(e).__name__, e)
        self.fn = fn

    def __call__(self, *args):
        if self.fn is None:
            with torch.no_grad():
                self._compile(args)
        return self.fn(*args)


def make_backend(plan=None, mode: str = "exact", codegen: bool = True):
    """A dynamo backend applying ``plan`` (default: the exact default plan) to every graph."""
    from torch._dynamo.backends.common import aot_autograd

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs):
        from tkcc.compiler import default_plan

        p = plan if plan is not None else default_plan(mode)
        return _LazyCompiled(gm, p, mode, codegen)

    def bw_compiler(gm, example_inputs):
        return gm  # training graphs run as traced; tkcc compiles inference forwards

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)


def tkcc_backend(gm: torch.fx.GraphModule, example_inputs):
    """The ``"tkcc"`` backend: default exact plan, codegen'd forward."""
    return make_backend()(gm, example_inputs)


def register() -> None:
    """Register ``"tkcc"`` with dynamo (idempotent)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "tkcc" not in _BACKENDS:
        register_backend(name="tkcc")(tkcc_backend)
