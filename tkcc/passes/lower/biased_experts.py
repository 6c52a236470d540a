"""gpt-oss's MoE block, recognised so that the pass log says why it stays in aten.

The block as gpt-oss writes it under transformers' ``batched_mm`` experts: the router linear *with a bias*, top-k of
the logits *then* a softmax over the k, each token's k experts over [E, H, 2I] / [E, I, H] weights (transposed:
``x @ W``) plus their biases, and a clamped SwiGLU over the interleaved gate / up columns (``gate = min(g, limit)``,
``up = clamp(u, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``). ``tkcc.moe``'s routed kernels take
none of those four (softmax then top-k, no biases, [E, 2I, H] weights with gate and up halves, ``silu(g) * u``), so
every match is refused with that reason and the region runs as captured, in the same step as the lowered attention.
The pattern is the plain reference a kernel for this block would be checked against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tkcc.passes.lower.pattern import Rewrite

TOP_K, ALPHA, LIMIT = 3, 1.4375, 6.625  # sentinels

WHY = ("gpt-oss's MoE (a router with a bias, top-k then softmax over the k, experts [E, H, 2I] with biases and a clamped "
       "SwiGLU over interleaved gate/up columns) has no routed-experts kernel (tkcc.moe: softmax then top-k, no "
       "biases, [E, 2I, H] experts, silu(g) * u); it stays in aten")


def biased_moe(xs, router_w, router_b, gate_up, gate_up_b, down, down_b, *, top_k, alpha, limit):
    """``GptOssMLP`` on the normed tokens ``xs`` [T, H] with ``batched_mm`` experts: the routed sum [T, H]."""
    router_logits = F.linear(xs, router_w, router_b)
    top_value, top_index = torch.topk(router_logits, top_k, dim=-1)
    scores = F.softmax(top_value, dim=1, dtype=top_value.dtype)
    selected = xs.repeat_interleave(top_k, dim=0)
    weights = scores.reshape(-1)
    ids = top_index.reshape(-1).clamp(0, gate_up.shape[0] - 1)
    gu = torch.bmm(selected.unsqueeze(1), gate_up[ids]).squeeze(1)
    gu.add_(gate_up_b[ids])
    gate, up = gu[..., ::2], gu[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    act = (up + 1) * glu
    out = torch.bmm(act.unsqueeze(1), down[ids]).squeeze(1)
    out.add_(down_b[ids])
    out = out * weights.unsqueeze(-1)
    return out.view(xs.shape[0], top_k, xs.shape[-1]).sum(dim=1).to(xs.dtype)


def _example(dt):
    E, H, I = 12, 48, 20
    return ((torch.empty(1, H, dtype=dt), torch.empty(E, H, dtype=dt), torch.empty(E, dtype=dt),
             torch.empty(E, H, 2 * I, dtype=dt), torch.empty(E, 2 * I, dtype=dt), torch.empty(E, I, H, dtype=dt),
             torch.empty(E, H, dtype=dt)), {"top_k": TOP_K, "alpha": ALPHA, "limit": LIMIT})


REWRITES = [Rewrite("moe[gpt-oss: biased router and experts, clamped SwiGLU]", biased_moe, biased_moe, _example,
                    region="moe", check=lambda m: WHY)]
