"""Rotary embedding for one decode token, fused with q/k RMSNorm (OLMoE) and the KV-cache write.

Input is the fused projection ``[q | k | v]`` (one GEMV wrote it). Output: the
rotated q, and k (rotated) and v written in place into the static caches
``[H_kv, S_max, D]`` at ``pos`` (a device tensor, so graph replays advance).
"""
from __future__ import annotations

import torch

from tkcc.kernels.common import fallback_reason, next_pow2, note_fallback, rms_ref
from tkcc.kernels.graph_replay import launch_pdl
from tkcc.kernels.render import load


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(qkv, k_cache, v_cache, pos, inv_freq, hq, hkv, q_norm=None, k_norm=None, eps=1e-5):
    """Eager: [norm] -> rotary with cos/sin computed in fp32 and rounded -> cache[:, pos] = k, v. Returns q [hq, D]."""
    D = k_cache.shape[-1]
    p = int(pos)
    q = qkv[: hq * D]
    k = qkv[hq * D: (hq + hkv) * D]
    v = qkv[(hq + hkv) * D:]
    if q_norm is not None:
        q = rms_ref(q, q_norm, eps)
        k = rms_ref(k, k_norm, eps)
    freqs = p * inv_freq.float()
    emb = torch.cat((freqs, freqs))
    cos, sin = emb.cos().to(qkv.dtype), emb.sin().to(qkv.dtype)
    q = q.view(hq, D)
    k = k.view(hkv, D)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k_cache[:, p] = k
    v_cache[:, p] = v.view(hkv, D)
    return q


def rope(qkv, k_cache, v_cache, pos, inv_freq, hq, hkv, q_norm=None, k_norm=None, eps=1e-5, q_out=None, pdl=None):
    D = k_cache.shape[-1]
    pos_t = pos if isinstance(pos, torch.Tensor) else torch.tensor([pos], device=qkv.device, dtype=torch.int32)
    reason = fallback_reason(qkv, k_cache, v_cache, q_norm, k_norm)
    if reason is None and (D % 2 or next_pow2(D // 2) != D // 2 or k_cache.stride(2) != 1
                           or k_cache.stride() != v_cache.stride() or qkv.numel() != (hq + 2 * hkv) * D):
        reason = f"unsupported layout D={D} strides {k_cache.stride()} qkv {qkv.numel()}"
    if reason is not None:
        note_fallback("rope", reason)
        q = rope_ref(qkv, k_cache, v_cache, int(pos_t.reshape(-1)[0]), inv_freq, hq, hkv, q_norm, k_norm, eps)
        if q_out is not None:
            q_out.copy_(q)
            return q_out
        return q
    if q_out is None:
        q_out = torch.empty(hq, D, device=qkv.device, dtype=qkv.dtype)
    pdl = launch_pdl(pdl)  # None: the enclosing pdl_scope's setting
    mod = load("rotary.py.jinja", pdl=pdl)
    qk_norm = q_norm is not None
    mod.qkv_rope_kernel[(hq + hkv,)](
        qkv, q_out, k_cache, v_cache, pos_t, inv_freq, q_norm if qk_norm else qkv, k_norm if qk_norm else qkv, eps,
        k_cache.stride(0), k_cache.stride(1), k_cache.shape[1], hq, hkv, D=D, HALF=D // 2, QK_NORM=qk_norm,
        BLOCK_K=min(4096, next_pow2(hq * D)), num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return q_out
