"""Gated activation: ``silu(gate) * up`` over a [.., 2N] tensor laid out [gate | up]."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from tkcc.kernels.common import fallback_reason, note_fallback
from tkcc.kernels.render import load


def silu_mul_ref(x):
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


def silu_mul(x, block=1024):
    reason = fallback_reason(x)
    if reason is None and not x.is_contiguous():
        reason = "non-contiguous input"
    if reason is not None:
        note_fallback("silu_mul", reason)
        return silu_mul_ref(x)
    N = x.shape[-1] // 2
    rows = x.numel() // (2 * N)
    y = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    mod = load("silu_mul.py.jinja")
    mod.silu_mul_kernel[(rows, triton.cdiv(N, block))](x, y, N, BLOCK=block, num_warps=4)
    return y
