"""gpt-oss's MoE block: a router linear with a bias, top-k then a softmax over the k, biased experts and a clamped SwiGLU.

The block as gpt-oss writes it under transformers' ``batched_mm`` experts: the router linear *with a bias*, top-k of
the logits *then* a softmax over the k, each token's k experts over [E, H, 2I] / [E, I, H] weights (transposed:
``x @ W``) plus their biases, and a clamped SwiGLU over the interleaved gate / up columns (``gate = min(g, limit)``,
``up = clamp(u, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``). It becomes ``tkcc.moe_gptoss``: the
routed router (its bias in the GEMV, the top-k and the weights once), then only the k chosen experts' columns. The
softmax over the k is the softmax over all experts restricted to the k and renormalised, up to fp32 rounding, so the
rewrite is not exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tkcc.passes.lower.pattern import Rewrite

TOP_K, ALPHA, LIMIT = 3, 1.4375, 6.625  # sentinels


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


def _to_kernels(xs, router_w, router_b, gate_up, gate_up_b, down, down_b, *, top_k, alpha, limit, count, configs,
               pdl):
    return torch.ops.tkcc.moe_gptoss(xs, router_w, router_b, gate_up, gate_up_b, down, down_b, top_k, alpha, limit,
                                     count, configs, pdl)


def _params(m, ctx):
    """The arrival counters (router, gate_up and down column blocks: enough for any config), zero, one tensor the
    step's gpt-oss blocks share (they run one after another, and each launch's last program resets its own)."""
    from tkcc.kernels.moe_gptoss import counters_any

    E, H, I2 = m.val(3).shape
    n = counters_any(H, I2 // 2, m.scalars["top_k"])
    dev = m.val(0).device
    count = ctx.tensor("moe_gptoss_count", torch.zeros(n, dtype=torch.int32, device=dev),
                       share_key=("moe_gptoss", str(dev), n))
    return {"count": count, "configs": None, "pdl": bool(ctx.options.get("pdl"))}


def _check(m) -> str | None:
    from tkcc.kernels.lowered import moe_gptoss_layout

    return moe_gptoss_layout(*(m.val(i) for i in range(7)), m.scalars["top_k"])


REWRITES = [Rewrite("moe[gpt-oss, biased router and experts, clamped SwiGLU]", biased_moe, _to_kernels, _example,
                    region="moe", check=_check, params=_params)]
