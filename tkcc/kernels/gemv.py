"""Batch-1 linear layers (GEMV): y = W x, reading each weight byte once.

Variants (jinja hooks of ``gemv.py.jinja``): RMSNorm prologue (the norm before
a projection costs no extra launch), gated epilogue (``silu(g) * u`` from a
fused [gate; up] weight), residual epilogue (``r + W x``). The reference
beside it is the eager composition of the same ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from tkcc.kernels.common import fallback_reason, interpreting, note_fallback, rms_ref
from tkcc.kernels.render import load

# (BLOCK_N, BLOCK_K, num_warps) candidates the tuner times; the first fitting one is the default.
CONFIGS = [(4, 512, 4), (8, 512, 4), (16, 256, 4), (2, 1024, 4), (4, 1024, 8), (8, 256, 2), (1, 2048, 4), (16, 512, 8),
           (2, 2048, 4), (4, 2048, 4), (4, 2048, 8), (8, 2048, 8), (8, 1024, 4), (32, 256, 8), (1, 8192, 4), (2, 8192, 8)]
TUNED: dict[tuple, tuple] = {}
# the interpreter runs programs one by one in Python: few, large ones are fastest there
INTERP_CONFIG = (64, 128, 4)


def gemv_ref(x, w, norm_w=None, eps=1e-5, residual=None, gated=False):
    """Plain PyTorch: [rmsnorm] -> linear -> [silu(g)*u] -> [+ residual]."""
    if norm_w is not None:
        x = rms_ref(x, norm_w, eps)
    y = F.linear(x, w)
    if gated:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    if residual is not None:
        y = residual + y
    return y


def _key(N, K, norm, gated, residual, dtype):
    return (N, K, bool(norm), bool(gated), bool(residual), str(dtype))


def gemv(x, w, norm_w=None, eps=1e-5, residual=None, gated=False, out=None, config=None, pdl=False):
    """x: [K] (or [1, K]); w: [N_total, K] with unit stride along K. Returns [N] (N = N_total/2 if gated).

    ``pdl``: launch with programmatic dependent launch (Hopper+): the kernel starts while the previous one
    drains and, when one tile spans K, reads its weights before waiting for the previous kernel's output."""
    reason = fallback_reason(x, w, norm_w, residual)
    if reason is None and (x.numel() != w.shape[-1] or w.stride(-1) != 1 or not x.is_contiguous()):
        reason = f"shape/stride x {tuple(x.shape)} w {tuple(w.shape)} stride {w.stride()} is not a batch-1 GEMV"
    if reason is not None:
        note_fallback("gemv", reason)
        y = gemv_ref(x.reshape(1, -1), w, norm_w, eps, None if residual is None else residual.reshape(1, -1), gated)
        y = y.reshape(-1)
        if out is not None:
            out.copy_(y)
            return out
        return y
    N_total, K = w.shape
    N = N_total // 2 if gated else N_total
    if out is None:
        out = torch.empty(N, device=x.device, dtype=x.dtype)
    default = INTERP_CONFIG if interpreting() else CONFIGS[0]
    bn, bk, nw = config or TUNED.get(_key(N, K, norm_w is not None, gated, residual is not None, x.dtype)) or default
    bk = min(bk, triton.next_power_of_2(K))
    mod = load("gemv.py.jinja", norm=norm_w is not None, gated=gated, residual=residual is not None, pdl=pdl)
    grid = (triton.cdiv(N, bn),)
    mod.gemv_kernel[grid](x, w, out, norm_w if norm_w is not None else x, residual if residual is not None else x,
                          N, K, w.stride(0), eps, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=(K % bk == 0), FULL_K=bk >= K,
                          num_warps=nw, **({"launch_pdl": True} if pdl else {}))
    return out
