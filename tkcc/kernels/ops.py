"""Graph-callable ops the decode passes insert: fused kernel on the fast path, the eager reference otherwise.

Each op takes exactly what the region it replaces took (activations, the
module's weights, its constants). The fast path runs when the shapes are one
decode token on a device the kernels support; anything else (prefill, batch
> 1, CPU without the interpreter) runs the plain PyTorch reference, which is
the eager arithmetic op for op, so the rewritten graph stays bit-exact there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from tkcc.kernels.attention import attention
from tkcc.kernels.common import fallback_reason, note_fallback, rms_ref
from tkcc.kernels.gemv import gemv
from tkcc.kernels.moe import moe, moe_ref
from tkcc.kernels.rmsnorm import rmsnorm


def moe_block(x, router_w, gate_up, down, top_k: int, norm_topk_prob: bool, fused: bool = True):
    """A sparse-MoE block (router softmax/top-k + experts) on x [..., H] -> [..., H]."""
    H = x.shape[-1]
    xs = x.reshape(-1, H)
    if fused and xs.shape[0] == 1:
        reason = fallback_reason(x, router_w, gate_up, down)
        if reason is None:
            logits = gemv(xs[0].contiguous(), router_w)
            return moe(xs[0].contiguous(), logits, gate_up, down, top_k, norm_topk_prob).view(x.shape)
        note_fallback("moe_block", reason)
    logits = F.linear(xs, router_w)
    return moe_ref(xs, logits, gate_up, down, top_k, norm_topk_prob).view(x.shape)


def rms_norm(x, weight, eps: float, fused: bool = True):
    if fused and fallback_reason(x, weight) is None and x.is_contiguous():
        return rmsnorm(x, weight, eps)
    return rms_ref(x, weight, eps)


def add_rms_norm(a, b, weight, eps: float, fused: bool = True):
    """(rmsnorm(a + b), a + b): the residual add and the norm after it in one pass."""
    if fused and fallback_reason(a, b, weight) is None and a.is_contiguous() and b.is_contiguous() \
            and a.shape == b.shape:
        return rmsnorm(b, weight, eps, residual=a)
    h = a + b
    return rms_ref(h, weight, eps), h


def repeat_kv(k, n_rep: int):
    """HF's repeat_kv: [B, Hkv, S, D] -> [B, Hkv * n_rep, S, D]."""
    if n_rep == 1:
        return k
    B, H, S, D = k.shape
    return k[:, :, None].expand(B, H, n_rep, S, D).reshape(B, H * n_rep, S, D)


def split_kv_attention(q, k_cache, v_cache, cache_position, mask, scale: float, n_rep: int, chunk: int = 256,
                       sdpa_kwargs: dict | None = None):
    """Decode attention over a static cache [B, Hkv, S, D] at ``cache_position``.

    Fast path (one token, batch 1): split-KV kernel over positions [0, pos] only — the frontend's mask for a
    decode step is exactly 'positions <= pos', so it is not read. Otherwise: repeat_kv + sdpa as eager."""
    B, Hq, T, D = q.shape
    if T == 1 and B == 1:
        reason = fallback_reason(q, k_cache, v_cache)
        if reason is None:
            S = k_cache.shape[2]
            ch = min(chunk, S)
            splits = triton.cdiv(S, ch)
            seqlen = (cache_position.reshape(-1)[-1:] + 1).to(torch.int32)
            out = attention(q.reshape(Hq, D).contiguous(), k_cache[0], v_cache[0], seqlen, scale=scale,
                            splits=splits, chunk=ch if splits > 1 else S)
            return out.view(1, Hq, 1, D)
        note_fallback("split_kv_attention", reason)
    return F.scaled_dot_product_attention(q, repeat_kv(k_cache, n_rep), repeat_kv(v_cache, n_rep), attn_mask=mask,
                                          scale=scale, **(sdpa_kwargs or {}))
