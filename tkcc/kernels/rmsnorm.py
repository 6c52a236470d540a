"""RMSNorm over the last dimension, optionally fused with the residual add before it.

``rmsnorm(x, w, eps, residual=r)`` returns ``(norm(x + r), x + r)``: one pass
writes both the normalised activations and the new residual stream.
"""
from __future__ import annotations

import torch
import triton

from tkcc.kernels.common import fallback_reason, note_fallback, rms_ref
from tkcc.kernels.render import load


def rmsnorm_ref(x, weight, eps=1e-5, residual=None):
    if residual is not None:
        h = x + residual
        return rms_ref(h, weight, eps), h
    return rms_ref(x, weight, eps)


def rmsnorm(x, weight, eps=1e-5, residual=None, block_k=None, offset=0.0, cast_first=True):
    """``offset``, ``cast_first``: the weight's forms of ``tkcc.kernels.lowered.rms_norm_ref`` (without a
    residual: that reference has none)."""
    reason = fallback_reason(x, weight, residual)
    if reason is None and not (x.is_contiguous() and weight.is_contiguous() and weight.numel() == x.shape[-1]
                               and (residual is None or (residual.shape == x.shape and residual.is_contiguous()))):
        reason = f"non-contiguous or mismatched shapes x {tuple(x.shape)} w {tuple(weight.shape)}"
    if reason is not None:
        note_fallback("rmsnorm", reason)
        return rmsnorm_ref(x, weight, eps, residual)
    K = x.shape[-1]
    rows = x.numel() // K
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else y
    bk = block_k or min(triton.next_power_of_2(K), 4096)
    mod = load("rmsnorm.py.jinja", residual=residual is not None, cast_first=bool(cast_first))
    mod.rmsnorm_kernel[(rows,)](x, residual if residual is not None else x, weight, y, h, K, eps, float(offset),
                                BLOCK_K=bk, num_warps=4)
    return (y, h) if residual is not None else y
