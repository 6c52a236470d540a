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


def gate_rows(gate, x) -> tuple[int, int] | None:
    """(stride between gate rows, rows of x per gate row) when the kernel can read ``gate`` as x's rows in place: its
    last dim holds whole rows of x, contiguous, and the dims before it flatten to one stride (Qwen3-Next's z, a
    strided slice of its projection); else None."""
    K = x.shape[-1]
    if gate.numel() != x.numel() or gate.dim() < 1 or gate.shape[-1] % K or gate.stride(-1) != 1:
        return None
    try:
        flat = gate.view(-1, gate.shape[-1])
    except RuntimeError:
        return None
    return (flat.stride(0) if flat.shape[0] > 1 else gate.shape[-1]), gate.shape[-1] // K


def rmsnorm(x, weight, eps=1e-5, residual=None, block_k=None, offset=0.0, cast_first=True, gate=None,
            gate_act="silu"):
    """``offset``, ``cast_first``, ``gate``, ``gate_act``: the forms of ``tkcc.kernels.lowered.rms_norm_ref`` (the
    kernel takes them without a residual; with one, the fallback normalises ``x + residual`` in that form and returns
    both)."""
    reason = fallback_reason(x, weight, residual, gate)
    if reason is None and not (x.is_contiguous() and weight.is_contiguous() and weight.numel() == x.shape[-1]
                               and (residual is None or (residual.shape == x.shape and residual.is_contiguous()))
                               and (gate is None or (residual is None and gate_rows(gate, x) is not None))):
        reason = f"non-contiguous or mismatched shapes x {tuple(x.shape)} w {tuple(weight.shape)}" + (
            "" if gate is None else f" gate {tuple(gate.shape)} {gate.stride()}")
    if reason is not None:
        note_fallback("rmsnorm", reason)
        if gate is not None or offset != 0.0 or not cast_first:
            from tkcc.kernels.lowered import rms_norm_ref

            if residual is None:
                return rms_norm_ref(x, weight, eps, offset, cast_first, gate, gate_act)
            h = x + residual
            return rms_norm_ref(h, weight, eps, offset, cast_first, gate, gate_act), h
        return rmsnorm_ref(x, weight, eps, residual)
    K = x.shape[-1]
    rows = x.numel() // K
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else y
    bk = block_k or min(triton.next_power_of_2(K), 4096)
    mod = load("rmsnorm.py.jinja", residual=residual is not None, cast_first=bool(cast_first), gated=gate is not None,
               **({"gate_act": "sigmoid"} if gate is not None and gate_act == "sigmoid" else {}))
    zs = (gate, *gate_rows(gate, x)) if gate is not None else ()
    mod.rmsnorm_kernel[(rows,)](x, residual if residual is not None else x, weight, y, h, K, eps, float(offset), *zs,
                                BLOCK_K=bk, num_warps=4)
    return (y, h) if residual is not None else y
