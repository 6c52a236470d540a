"""exact_regions: split a forward at its graph breaks and replay each piece from CUDA graphs.

Scientific libraries read tensor values on the host in the middle of a
forward: torchdiffeq's fixed-grid solver compares time points every step,
torch-geometric drops self-loops with a boolean mask (a data-dependent edge
count), e3nn's radius graph calls ``nonzero`` and pools with
``int(batch.max())``. One CUDA graph cannot hold such a forward. TorchDynamo
(``torch.compile`` with a tkcc backend) cuts it at exactly those points into
FX graphs of torch-level calls; this pass hands each piece to a
``GraphCache``, so every piece between two host reads is replayed from a CUDA
graph per input signature, and the host reads themselves run as in eager.

Which rewrites keep bits, and why:

- Splitting: each FX piece calls the same torch functions, in the same order,
  with the same arguments as the eager forward (TorchDynamo records calls; it
  does not decompose, fuse or reorder them, and no Inductor runs), so every
  kernel and its rounding is the eager one. The Python between pieces (loop
  control, host reads) runs unchanged.
- Capture of each piece: as in ``exact_cudagraph`` (same kernels replayed,
  capture key covers everything that picks a kernel, inputs written in place
  are copied back).
- Weights: pieces read parameters and buffers in place (never copied).

Pieces of fewer than ``min_ops`` operations (default 3) run eagerly: a
replay plus buffer copies costs more than launching one or two kernels.

Data-dependent sizes (an edge count after ``nonzero``) make a new signature
per size: a size is captured the second time it is seen (``capture_after``),
up to ``max_graphs`` per piece; other calls run that piece eagerly, which is
the reference itself. The report lists every piece, its graphs, replays,
eager calls and why anything was not captured, and every graph break with
TorchDynamo's reason: nothing is skipped silently.
"""
from __future__ import annotations

import collections

import torch
import torch.fx

from tkcc.passes.base import WRAP, Pass, RewriteInfo, register
from tkcc.passes.exact_cudagraph import weight_pointers, wrap_graph
from tkcc.kernels.graph_replay import GraphCache, new_pool


def _graph_break_counts() -> collections.Counter:
    from torch._dynamo.utils import counters

    return collections.Counter(dict(counters.get("graph_break", {})))


def short_reason(reason: str) -> str:
    """TorchDynamo's first line of a graph-break reason plus the user code it points at."""
    lines = [ln.strip() for ln in str(reason).splitlines() if ln.strip()]
    head = lines[0] if lines else "unknown"
    for ln in lines:
        if ln.startswith("# File") and "code:" in ln:
            return f"{head} at {ln[2:]}"
    return head


class RegionSplitForward(torch.nn.Module):
    """``target`` run through TorchDynamo with a backend that wraps every piece in a GraphCache."""

    def __init__(self, target, name: str = "forward", pool=None, capture_after: int = 2, max_graphs: int = 64,
                 static_ptrs=frozenset(), min_ops: int = 3):
        super().__init__()
        self.target = target
        self.min_ops = min_ops
        self.name = name
        self.pool = pool
        self.capture_after, self.max_graphs = capture_after, max_graphs
        self.static_ptrs = frozenset(static_ptrs)
        self.regions: list[GraphCache] = []
        self.region_ops: list[int] = []
        self.small: list[int] = []  # op counts of pieces left uncaptured because they are tiny
        self._breaks_before = _graph_break_counts()
        self._compiled = torch.compile(target, backend=self._backend, dynamic=None, fullgraph=False)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        if self.pool is None:
            self.pool = new_pool()
        idx = len(self.regions)
        ops = sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
        if ops < self.min_ops:  # a replay plus buffer copies costs more than launching one or two kernels
            self.small.append(ops)
            return gm.forward
        cache = GraphCache(gm.forward, name=f"{self.name}.region{idx}", capture_after=self.capture_after,
                           max_graphs=self.max_graphs, pool=self.pool, static_ptrs=self.static_ptrs)
        self.regions.append(cache)
        self.region_ops.append(ops)
        return cache

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)

    def graph_breaks(self) -> dict:
        """TorchDynamo's graph-break reasons (count each) seen since this wrapper was built."""
        now = _graph_break_counts()
        now.subtract(self._breaks_before)
        out: dict = {}
        for k, v in now.items():
            if v > 0:
                key = short_reason(k)
                out[key] = out.get(key, 0) + int(v)
        return out

    def report(self) -> dict:
        regions = []
        for cache, ops in zip(self.regions, self.region_ops):
            r = cache.report()
            r["ops"] = ops
            regions.append(r)
        return {"regions": regions, "uncaptured_small_pieces": list(self.small),
                "min_ops": self.min_ops, "graph_breaks": self.graph_breaks()}


def split_regions(module, name: str = "forward", pool=None, capture_after: int = 2, max_graphs: int = 64,
                  static_ptrs=None) -> RegionSplitForward:
    """Wrap ``module`` (any callable nn.Module) so each piece between graph breaks is CUDA-graph captured."""
    ptrs = weight_pointers(module) if static_ptrs is None else static_ptrs
    return RegionSplitForward(module, name=name, pool=pool, capture_after=capture_after, max_graphs=max_graphs,
                              static_ptrs=ptrs)


@register
class ExactRegions(Pass):
    name = "exact_regions"
    version = "1"
    exact = True
    stage = WRAP  # wraps the whole forward: after every rewrite
    emits_source = False  # holds CUDA graphs / region runners: in-process only
    description = ("Cut each phase at its graph breaks (host reads, data-dependent sizes) with TorchDynamo and "
                   "replay every piece from CUDA graphs per input signature; host reads run as in eager.")
    params = {"capture_after": [2, 1], "max_graphs": [64, 16, 256]}

    def apply(self, program, capture_after=2, max_graphs=64):
        info = RewriteInfo()
        pool = new_pool()
        ptrs = weight_pointers(program.model, *program.graphs.values())
        new = {}
        for phase, gm in program.graphs.items():
            runner = RegionSplitForward(gm, name=phase, pool=pool, capture_after=capture_after,
                                        max_graphs=max_graphs, static_ptrs=ptrs)
            new[phase] = wrap_graph(gm, "regions", runner, "RegionSplit")
            info.matched += 1
            info.replaced += 1
            info.notes.append(f"{phase}: split at graph breaks, each piece replayed from CUDA graphs per signature")
        return program.with_graphs(new), info
