"""MoE router: softmax over expert logits (fp32), top-k, optional renormalisation.

The same routing code (``_route.jinja``) runs inside the MoE expert kernels'
prologue, so the fused path needs no separate router launch; this standalone
kernel serves graphs where routing feeds other ops, and the tests.
"""
from __future__ import annotations

import torch

from tkcc.kernels.common import fallback_reason, next_pow2, note_fallback
from tkcc.kernels.render import load


def router_ref(logits, top_k, norm_topk_prob=False):
    """(ids [T, k] int64, weights [T, k] in logits' dtype), as the HF OLMoE/Mixtral/Qwen3-MoE routers."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(logits.dtype)


def router(logits, top_k, norm_topk_prob=False):
    reason = fallback_reason(logits)
    if reason is None and not logits.is_contiguous():
        reason = "non-contiguous logits"
    if reason is not None:
        note_fallback("router", reason)
        return router_ref(logits, top_k, norm_topk_prob)
    E = logits.shape[-1]
    T = logits.numel() // E
    ids = torch.empty(*logits.shape[:-1], top_k, device=logits.device, dtype=torch.int64)
    w = torch.empty(*logits.shape[:-1], top_k, device=logits.device, dtype=logits.dtype)
    mod = load("router.py.jinja")
    mod.router_kernel[(T,)](logits, ids, w, E, TOPK=top_k, E_PAD=max(16, next_pow2(E)), NORM_TOPK=norm_topk_prob,
                            num_warps=1)
    return ids, w
