"""The forwards a graph can run as, each built from a pristine copy of dynamo's graph.

- ``inductor``: ``torch._inductor.compile_fx.compile_fx`` (Inductor's own entry for a dynamo graph; it
  runs AOT Autograd itself), with optional config patches (tuned variants).
- ``plan_forward``: tkcc's own: AOT Autograd lowers the graph to ATen, the PassManager applies the
  plan on the first real call (its numerics checks need real tensors), and codegen's generated forward
  runs it (the rewritten FX graph where codegen cannot lower it, logged).
- ``replayed``: any of them replayed from CUDA graphs, one per input signature
  (``tkcc.kernels.graph_replay.GraphCache``: static input buffers, outputs cloned out, weights read in
  place). A replay launches the very kernels the forward launched, so it keeps that forward's bits.

Every builder takes the dynamo graph's calling convention (``fn(*args)``, parameters lifted to
inputs) and returns a callable with the same one.
"""
from __future__ import annotations

import copy
import hashlib
import logging

import torch

from tkcc.errors import ArtifactError

log = logging.getLogger("tkcc.backend")


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph, sharing its attributes (weights are never copied).

    Inductor's pre-grad passes rewrite the graph they are given in place; every builder gets its own copy
    so the reference stays the graph dynamo captured.
    """
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    out.meta = dict(getattr(gm, "meta", {}))
    return out


def inductor(gm: torch.fx.GraphModule, example_inputs, patches: dict | None = None):
    """Inductor's compile of ``gm`` (default config, plus ``patches``)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, list(example_inputs), config_patches=dict(patches) if patches else None)


def is_static_input(x) -> bool:
    """A weight or buffer: dynamo marks them static (their address does not change between calls)."""
    return isinstance(x, torch.Tensor) and (isinstance(x, torch.nn.Parameter)
                                            or getattr(x, "_dynamo_static_input_type", None) is not None)


class Replayed:
    """``fn`` replayed from CUDA graphs per input signature; eager where a capture is refused."""

    def __init__(self, fn, static_ptrs: frozenset, name: str, capture_after: int = 1):
        from tkcc.kernels.graph_replay import GraphCache

        self.cache = GraphCache(fn, name=name, capture_after=capture_after, static_ptrs=static_ptrs)

    def __call__(self, *args):
        return self.cache(*args)

    def refused(self) -> str | None:
        """Why no graph could be captured (None once one is)."""
        if self.cache.graphs:
            return None
        return "; ".join(sorted(set(self.cache.refused.values()))) or None


def replayed(fn, args, name: str, dynamic: bool) -> Replayed:
    """``fn`` behind a GraphCache whose static pointers are this call's weights and buffers."""
    ptrs = frozenset(a.data_ptr() for a in args if is_static_input(a) and a.is_cuda)
    # a dynamic graph sees sizes that may come once: capture a signature the second time it is seen
    return Replayed(fn, ptrs, name, capture_after=2 if dynamic else 1)


# ---- tkcc's own plan ------------------------------------------------------------------------------

def _program(gm: torch.fx.GraphModule, inputs: list):
    from tkcc.frontend.program import Program

    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    fp = hashlib.sha256(gm.code.encode()).hexdigest()[:16]
    meta = {"kind": "dynamo", "name": "dynamo-graph",
            "dtype": str(first.dtype).replace("torch.", "") if first is not None else None,
            "device": str(first.device) if first is not None else "cpu", "exact": True}
    return Program(graphs={"forward": gm}, example_inputs={"forward": tuple(inputs)}, layer_map={"forward": {}},
                   num_blocks=0, model=gm, fingerprint=fp, meta=meta)


class PlanForward:
    """An ATen forward graph with ``plan`` applied on the first call (real inputs), then run compiled."""

    def __init__(self, gm: torch.fx.GraphModule, plan, mode: str, codegen: bool):
        self.gm, self.plan, self.mode, self.codegen = gm, plan, mode, codegen
        self.fn = None
        self.logs = []
        self.artifact = None
        self.note = ""

    def _compile(self, args):
        from tkcc.pipeline import build

        program = _program(self.gm, list(args))
        if self.codegen:
            try:  # the one build pipeline: plan -> passes -> artifact -> forward
                from tkcc.scratch import scratch_dir

                b = build(program, self.plan, scratch_dir("tkcc-dynamo-") / "artifact",  # removed at exit
                          mode=self.mode)
                self.logs, self.artifact, fn = b.logs, b.artifact, b.forwards["forward"]
                self.note = "generated forward"
            except (ImportError, ArtifactError) as e:  # a graph codegen cannot lower runs as the checked FX graph
                b = build(program, self.plan, mode=self.mode, codegen=False)
                self.logs, fn = b.logs, b.forwards["forward"]
                self.note = f"rewritten FX graph (codegen could not lower it: {type(e).__name__}: {e})"
                log.warning("tkcc backend: codegen could not lower this graph (%s: %s); running the rewritten "
                            "FX graph", type(e).__name__, e)
        else:
            b = build(program, self.plan, mode=self.mode, codegen=False)
            self.logs, fn = b.logs, b.forwards["forward"]
            self.note = "rewritten FX graph"
        self.fn = fn

    def __call__(self, *args):
        if self.fn is None:
            with torch.no_grad():
                self._compile(args)
        return self.fn(*args)


def plan_forward(gm: torch.fx.GraphModule, example_inputs, plan, mode: str, codegen: bool, built: list | None = None):
    """tkcc's forward of a dynamo graph: AOT Autograd to ATen, then ``plan`` (backward graphs run as traced).

    ``built`` (a list) receives the PlanForward, so the caller can read its pass logs and notes.
    """
    from torch._dynamo.backends.common import aot_autograd

    def fw_compiler(g: torch.fx.GraphModule, _example_inputs):
        f = PlanForward(g, plan, mode, codegen)
        if built is not None:
            built.append(f)
        return f

    def bw_compiler(g, _example_inputs):
        return g  # training graphs run as traced; tkcc compiles inference forwards

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)(gm, list(example_inputs))
