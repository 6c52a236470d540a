"""exact_cudagraph: launch elimination — replay a whole forward as CUDA graphs, one per input signature.

Which rewrites keep bits, and why:

- Graph capture/replay (launch elimination): a CUDA graph replays the very
  kernels the eager forward launched, with the same launch parameters; no
  kernel is replaced, fused or reordered, so each arithmetic operation rounds
  exactly as in eager. What could change a kernel choice (shapes, strides,
  dtypes, 16-byte alignment, host-side scalars) is part of the capture key
  (``tkcc.kernels.graph_replay.signature``), so a call that differs in any of
  them gets its own graph or runs eagerly.
- Static input/output buffers: inputs are copied into, and outputs cloned out
  of, fixed buffers; ``copy_`` and ``clone`` move bits unchanged.
- Static allocation reuse (``share_pool``): all graphs of the forward share
  one memory pool; buffers only change address, never contents or kernels
  (graphs run one at a time and outputs leave the pool before the next one).

- Host-read speculation (``speculate_host_reads``): a forward that reads
  values on the host (``bool(t1 >= t[j])``) is captured with each read
  returning the value it had when recorded, but only for reads that do not
  depend on the inputs (``tkcc.kernels.host_reads.HostReads`` tracks that);
  the graph also computes every read value, and after each replay they are
  compared with the recorded ones; on any difference the replay is discarded
  and the eager forward runs. So a returned output always took eager's path.

What is not captured: a forward that synchronises with the host (``.item()``,
``nonzero``, a blocking copy) cannot live in one graph; the sync probe finds
that before capture and the forward runs eagerly for that signature, with the
reason in the report (use ``speculate_host_reads`` or ``exact_regions``). On
CPU nothing is captured: the graph runs as is.
"""
from __future__ import annotations

import torch
import torch.fx

from tkcc.passes.base import WRAP, Pass, RewriteInfo, register
from tkcc.kernels.graph_replay import GraphCache, new_pool


def weight_pointers(*modules) -> frozenset:
    """Data pointers of every parameter and buffer: tensors a graph may read in place."""
    ptrs = set()
    for m in modules:
        if m is None:
            continue
        for t in list(m.parameters()) + list(m.buffers()):
            ptrs.add(t.data_ptr())
    return frozenset(ptrs)


class CudaGraphForward(torch.nn.Module):
    """``target(*args)``, replayed from a CUDA graph per input signature (eager where impossible)."""

    def __init__(self, target, name: str = "forward", pool=None, capture_after: int = 1, max_graphs: int = 64,
                 static_ptrs=frozenset(), speculate: bool = False):
        super().__init__()
        self.target = target
        self.cache = GraphCache(self._run, name=name, capture_after=capture_after, max_graphs=max_graphs,
                                pool=pool, static_ptrs=static_ptrs, speculate=speculate)

    def _run(self, *args, **kwargs):
        return self.target(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.cache(*args, **kwargs)

    def report(self) -> dict:
        return self.cache.report()


def wrap_graph(gm: torch.fx.GraphModule, attr: str, runner: torch.nn.Module, class_name: str) -> torch.fx.GraphModule:
    """A GraphModule with ``gm``'s placeholders whose body is one call to ``runner`` (which runs ``gm``), held
    as the submodule ``attr``; every node of ``gm`` is recorded as where that call came from."""
    graph = torch.fx.Graph()
    old = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ins = [graph.placeholder(n.target, type_expr=n.type) for n in old]
    for a, b in zip(ins, old):
        a.meta = dict(b.meta)
    root = torch.nn.Module()
    root.add_module(attr, runner)
    call = graph.call_module(attr, tuple(ins))
    call.meta["tkcc_from"] = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    graph.output(call)
    out = torch.fx.GraphModule(root, graph, class_name=class_name)
    out.meta = dict(getattr(gm, "meta", {}))
    return out


@register
class ExactCudaGraph(Pass):
    name = "exact_cudagraph"
    version = "1"
    exact = True
    stage = WRAP  # wraps the whole forward: after every rewrite
    emits_source = False  # holds CUDA graphs / region runners: in-process only
    description = ("Replay each phase graph from CUDA graphs captured per input signature (launch elimination, "
                   "static buffers, one shared memory pool); eager where the graph synchronises with the host.")
    params = {"share_pool": [True, False], "capture_after": [1, 2], "speculate_host_reads": [False, True]}

    def apply(self, program, share_pool=True, capture_after=1, speculate_host_reads=False):
        info = RewriteInfo()
        pool = new_pool() if share_pool else None
        ptrs = weight_pointers(program.model, *program.graphs.values())
        new = {}
        for phase, gm in program.graphs.items():
            runner = CudaGraphForward(gm, name=phase, pool=pool, static_ptrs=ptrs, capture_after=capture_after,
                                      speculate=speculate_host_reads)
            new[phase] = wrap_graph(gm, "cudagraph", runner, "CudaGraphWrapped")
            info.matched += 1
            info.replaced += 1
            info.notes.append(f"{phase}: whole graph replayed from CUDA graphs per input signature "
                              f"(shared pool: {pool is not None}); bit-exact: same kernels, same order")
        return program.with_graphs(new), info
