"""Time a sequence of kernel launches as a decode step runs it: replayed from a CUDA graph.

Launch gaps, programmatic-dependent-launch overlap and L2 state are those of the replayed step, and no host
overhead is counted. Used to pick kernel configs on the device (``tkcc.passes.lower.tune``); the picks are
written into the lowered graph, never into a process-global table.
"""
from __future__ import annotations

import torch


def graph_time(fn, reps: int = 7) -> float:
    """Median µs of one replay of ``fn``'s launches (``fn`` runs once eagerly first: compiles, warms up)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):  # other threads may launch meanwhile
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    del g
    return sorted(ts)[len(ts) // 2]
