"""Argmax over the last dimension of [B, V] rows: the greedy choice of a decode step.

``torch.argmax`` over one 128k-vocabulary bf16 row runs as a single reduction kernel that took 37 us on an
H200, about 4% of llama-1b-16l's whole decode step (the graph-lowered step's greedy loop, ``--kernels``
profile). This splits each row into blocks folded in parallel, then folds the blocks' results: the same
index as torch.argmax, ties and NaN included (see the template's header).
"""
from __future__ import annotations

import torch
import triton

from tkcc.kernels.common import fallback_reason, note_fallback
from tkcc.kernels.render import load

MIN_V = 4096  # shorter rows: torch.argmax is one small kernel already


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(-1)


def block_size(V: int) -> int:
    """About 64 blocks a row, each 256-16384 values."""
    return max(256, min(16384, triton.next_power_of_2(triton.cdiv(V, 64))))


def argmax(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``x.argmax(-1)`` for a 2-D float ``x`` [B, V] whose rows are contiguous (any row stride)."""
    if block is None and x.shape[-1] < MIN_V:
        return argmax_ref(x)  # not a fallback: torch's kernel is as good here
    reason = fallback_reason(x)
    if reason is None and not (x.dim() == 2 and x.is_floating_point() and x.stride(-1) == 1):
        reason = f"not rows of floats with unit stride: shape {tuple(x.shape)}, stride {x.stride()}, {x.dtype}"
    if reason is not None:
        note_fallback("argmax", reason)
        return argmax_ref(x)
    B, V = x.shape
    if B == 0 or V == 0:
        return argmax_ref(x)  # torch's own error for an empty row, an empty result for no rows
    bs = block or block_size(V)
    P = triton.cdiv(V, bs)
    part = torch.empty((B, P), device=x.device, dtype=torch.int64)
    out = torch.empty((B,), device=x.device, dtype=torch.int64)
    mod = load("argmax.py.jinja")
    mod.argmax_blocks_kernel[(P, B)](x, part, V, x.stride(0), P, BLOCK=bs, num_warps=4)
    mod.argmax_rows_kernel[(B,)](part, out, P, BLOCK_P=max(16, triton.next_power_of_2(P)), num_warps=1)
    return out
