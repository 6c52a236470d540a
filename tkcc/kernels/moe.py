"""MoE experts for one decode token, reading only the selected experts' weights.

Weights in transformers' 3-D layout: ``gate_up [E, 2I, H]``, ``down [E, H, I]``.
Two launches: gate_up (routing + RMSNorm prologue + silu*mul epilogue) and
down (weighted sum over the k experts + residual). ``forced_ids`` (k expert
ids) replaces the router's choice: a benchmark hook that replays a real
routing trace at the same cost.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from tkcc.kernels.common import fallback_reason, interpreting, next_pow2, note_fallback, rms_ref
from tkcc.kernels.graph_replay import launch_pdl
from tkcc.kernels.render import load

GATE_UP_CONFIGS = [(4, 512, 4), (8, 512, 4), (2, 1024, 4), (16, 256, 4), (4, 1024, 8), (8, 256, 2), (2, 2048, 4),
                   (4, 2048, 8), (1, 2048, 4), (8, 1024, 8)]
DOWN_CONFIGS = [(4, 512, 4), (8, 512, 4), (2, 1024, 4), (16, 256, 4), (4, 1024, 8), (8, 256, 2), (8, 1024, 8),
                (16, 1024, 8), (1, 1024, 2), (32, 512, 8)]


def moe_ref(x, router_logits, gate_up, down, top_k, norm_topk_prob=False, residual=None, norm_w=None, eps=1e-5,
            forced_ids=None):
    """transformers' batched_mm experts path for T tokens: x [T, H] (pre-norm if norm_w), logits [T, E]."""
    if norm_w is not None:
        x = rms_ref(x, norm_w, eps)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    if forced_ids is not None:
        ids = forced_ids.reshape(1, -1).expand(x.shape[0], -1).long()
        w = probs.gather(-1, ids)
    else:
        w, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    w = w.to(router_logits.dtype).reshape(-1)
    ids = ids.reshape(-1)
    xs = x.repeat_interleave(top_k, dim=0)
    h = torch.bmm(gate_up[ids], xs.unsqueeze(-1)).squeeze(-1)
    g, u = h.chunk(2, dim=-1)
    a = F.silu(g) * u
    y = torch.bmm(down[ids], a.unsqueeze(-1)).squeeze(-1)
    y = (y * w.unsqueeze(-1)).view(x.shape[0], top_k, -1).sum(1).to(x.dtype)
    return y if residual is None else residual + y


def moe(x, router_logits, gate_up, down, top_k, norm_topk_prob=False, residual=None, norm_w=None, eps=1e-5,
        forced_ids=None, act_buf=None, out=None, gate_up_config=None, down_config=None, pdl=None):
    """One token: x [H] (pre-norm when norm_w is given), router_logits [E] -> [H] (+ residual)."""
    E, I2, H = gate_up.shape
    I = I2 // 2
    reason = fallback_reason(x, router_logits, gate_up, down, residual, norm_w)
    if reason is None and (x.numel() != H or router_logits.numel() != E or not gate_up.is_contiguous()
                           or not down.is_contiguous() or tuple(down.shape) != (E, H, I)):
        reason = f"not a one-token MoE: x {tuple(x.shape)} logits {tuple(router_logits.shape)}"
    if reason is not None:
        note_fallback("moe", reason)
        y = moe_ref(x.reshape(-1, H), router_logits.reshape(-1, E), gate_up, down, top_k, norm_topk_prob,
                    None if residual is None else residual.reshape(-1, H), norm_w, eps, forced_ids)
        return y.reshape(x.shape)
    pdl = launch_pdl(pdl)  # None: the enclosing pdl_scope's setting
    mod = load("moe.py.jinja", pdl=pdl)
    launch = {"launch_pdl": True} if pdl else {}
    if act_buf is None:
        act_buf = torch.empty(top_k, I, device=x.device, dtype=x.dtype)
    if out is None:
        out = torch.empty(H, device=x.device, dtype=x.dtype)
    common = dict(TOPK=top_k, E_PAD=max(16, next_pow2(E)), NORM_TOPK=norm_topk_prob, FORCED=forced_ids is not None)
    fid = forced_ids if forced_ids is not None else router_logits
    interp = (64, 128, 4) if interpreting() else None
    bn, bk, nw = gate_up_config or interp or GATE_UP_CONFIGS[0]
    bk = min(bk, triton.next_power_of_2(H))
    mod.moe_gate_up_kernel[(triton.cdiv(I, bn), top_k)](
        x, norm_w if norm_w is not None else x, router_logits, fid, gate_up, act_buf, I, H, E, eps,
        gate_up.stride(0), gate_up.stride(1), BLOCK_N=bn, BLOCK_K=bk, NORM=norm_w is not None,
        EVEN_K=(H % bk == 0), num_warps=nw, **common, **launch)
    bn, bk, nw = down_config or interp or DOWN_CONFIGS[0]
    bk = min(bk, triton.next_power_of_2(I))
    mod.moe_down_kernel[(triton.cdiv(H, bn),)](
        act_buf, router_logits, fid, down, residual if residual is not None else x, out, I, H, E,
        down.stride(0), down.stride(1), BLOCK_N=bn, BLOCK_K=bk, RESIDUAL=residual is not None,
        EVEN_K=(I % bk == 0), num_warps=nw, **common, **launch)
    return out
