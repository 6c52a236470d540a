"""MoE blocks: the norm before them, the router (softmax, top-k, renormalisation) and the routed experts.

The pattern is a sparse-MoE block as OLMoE / Qwen3-MoE / Mixtral write it (the top-k router,
then transformers' ``batched_mm`` experts over [E, 2I, H] / [E, H, I] weights), from the norm before it to
the residual add after it. It becomes ``tkcc.moe``: the router GEMV whose last program picks the top-k
once, then gate_up and down over the k selected experts only (every other expert's bytes stay unread),
with the residual in the down kernel's epilogue. Variants: renormalised top-k or not; routing weights
rounded to the model's dtype (OLMoE, Qwen3-MoE) or kept fp32 (Mixtral); the residual add in the region or
after it; the routed experts of an input normed already, whose norm also feeds a shared expert (Qwen2-MoE's
softmax router; DeepSeek-V3's sigmoid router with bias-corrected grouped top-k and scaled weights). The
shared experts themselves are ordinary gated MLPs, lowered by the projection rewrites.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tkcc.passes.lower.norms import EPS, rms_norm
from tkcc.passes.lower.pattern import Rewrite, at_one

TOP_K = 3  # sentinel (the example has 12 experts)


def topk_router(router_logits, router: str, norm_topk: bool, top_k: int):
    """The top-k router as the patterns write it, after the router's linear: (weights, expert ids). ``router``:
    "softmax" (softmax in fp32, weights rounded to the logits' dtype) or "softmax_fp32" (softmax of the upcast
    logits, weights kept fp32); renormalised over the k with ``norm_topk``."""
    if router == "softmax":
        router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    else:
        router_probs = F.softmax(router_logits.float(), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    if norm_topk:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    if router == "softmax":
        router_top_value = router_top_value.to(router_logits.dtype)
    return router_top_value, router_indices


def _moe_pattern(norm_topk: bool, residual: bool, router: str):
    """``router``: "softmax" (OLMoE, Qwen3-MoE: softmax in fp32, weights rounded to the dtype) or
    "softmax_fp32" (Mixtral: softmax of the upcast logits, renormalised, weights kept fp32)."""

    def pattern(h, nw, router_w, gate_up, down, *, eps, top_k):
        x = rms_norm(h, nw, eps=eps)
        batch_size, sequence_length, hidden_dim = x.shape
        hidden_states = x.view(-1, hidden_dim)
        # the router (OlmoeTopKRouter.forward, MixtralTopKRouter.forward)
        router_logits = F.linear(hidden_states.reshape(-1, hidden_dim), router_w)
        router_top_value, router_indices = topk_router(router_logits, router, norm_topk, top_k)
        # the experts (transformers.integrations.moe.batched_mm_experts_forward)
        final = experts(hidden_states, router_top_value, router_indices, gate_up, down, top_k)
        final = final.reshape(batch_size, sequence_length, hidden_dim)
        return h + final if residual else final

    def replacement(h, nw, router_w, gate_up, down, *, eps, top_k, count, configs, pdl):
        return torch.ops.tkcc.moe(h, nw, eps, router_w, gate_up, down, top_k, norm_topk, residual, count, configs,
                                  pdl, router)

    return pattern, replacement


def routed(xs, router_w, gate_up, down, *, top_k):
    """The routed experts alone, on the block's flattened input [T, H] (already normed: the norm also feeds a
    shared expert, as in Qwen2-MoE), to their [T, H] output (the shared expert and its gate are added after)."""
    hidden_dim = xs.shape[-1]
    router_logits = F.linear(xs.reshape(-1, hidden_dim), router_w)
    router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    router_top_value = router_top_value.to(router_logits.dtype)
    return experts(xs, router_top_value, router_indices, gate_up, down, top_k)


def _routed_replacement(xs, router_w, gate_up, down, *, top_k, count, configs, pdl):
    return torch.ops.tkcc.moe(xs, None, 1e-6, router_w, gate_up, down, top_k, False, False, count, configs, pdl)


def _routed_check(m) -> str | None:
    return routed_layout(*(m.val(i) for i in range(4)))


def routed_layout(xs, r, gu, dn) -> str | None:
    """Why a routed-experts match (its input, router and experts) is not one token over one MoE layout, or None."""
    E, I2, H = gu.shape
    if xs.dim() != 2 or xs.shape[0] != 1:
        return f"xs {tuple(xs.shape)} is not one token"
    if tuple(r.shape) != (E, H) or tuple(dn.shape) != (E, H, I2 // 2):
        return f"router {tuple(r.shape)} / experts {tuple(gu.shape)}, {tuple(dn.shape)} are not one MoE layout"
    if not (gu.is_contiguous() and dn.is_contiguous() and r.stride(-1) == 1):
        return "expert weights are not contiguous [E, 2I, H] / [E, H, I]"
    return None


def _example(dt):
    E, H, I = 12, 48, 20
    return ((torch.empty(1, 1, H, dtype=dt), torch.empty(H, dtype=dt), torch.empty(E, H, dtype=dt),
             torch.empty(E, 2 * I, H, dtype=dt), torch.empty(E, H, I, dtype=dt)), {"eps": EPS, "top_k": TOP_K})


def _check(m) -> str | None:
    h, nw, r, gu, dn = (m.val(i) for i in range(5))
    E, I2, H = gu.shape
    if h.numel() != h.shape[-1]:
        return f"h {tuple(h.shape)} is more than one token (the routed kernels are batch-1 decode)"
    if tuple(r.shape) != (E, H) or tuple(dn.shape) != (E, H, I2 // 2) or tuple(nw.shape) != (H,):
        return f"router {tuple(r.shape)} / experts {tuple(gu.shape)}, {tuple(dn.shape)} are not one MoE layout"
    if not (gu.is_contiguous() and dn.is_contiguous() and r.stride(-1) == 1):
        return (f"expert weights are not contiguous [E, 2I, H] / [E, H, I] (strides {tuple(gu.stride())}, "
                f"{tuple(dn.stride())})")
    return None


def _params(m, ctx):
    h = m.val(0)
    count = ctx.tensor("moe_count", torch.zeros(1, dtype=torch.int32, device=h.device), share_key=("moe", str(h.device)))
    return {"count": count, "configs": None, "pdl": bool(ctx.options.get("pdl"))}


def _rewrites():
    out = []
    variants = [("softmax", False), ("softmax", True), ("softmax_fp32", True)]
    for residual in (True, False):
        for router, norm_topk in variants:
            pattern, replacement = _moe_pattern(norm_topk, residual, router)
            name = f"moe[{router}{'+renorm' if norm_topk else ''}-top-k{'+residual' if residual else ''}]"
            out.append(Rewrite(name, pattern, replacement, _example, region="moe", check=_check, params=_params))
    return out


def experts(xs, router_top_value, router_indices, gate_up, down, top_k):
    """transformers' ``batched_mm_experts_forward`` (shared by the patterns)."""
    hidden_dim = xs.shape[-1]
    selected_hidden_states = xs.repeat_interleave(top_k, dim=0)
    sample_weights = router_top_value.reshape(-1)
    expert_ids = router_indices.reshape(-1)
    expert_ids = expert_ids.clamp(0, gate_up.shape[0] - 1)
    proj_out = torch.bmm(gate_up[expert_ids], selected_hidden_states.unsqueeze(-1)).squeeze(-1)
    gate, up = proj_out.chunk(2, dim=-1)
    proj_out = F.silu(gate) * up
    proj_out = torch.bmm(down[expert_ids], proj_out.unsqueeze(-1)).squeeze(-1)
    weighted_out = proj_out * sample_weights.unsqueeze(-1)
    final = weighted_out.view(xs.shape[0], top_k, hidden_dim).sum(dim=1)
    return final.to(xs.dtype)


def routed_pattern(router: str, norm_topk: bool):
    """The routed part of a sparse-MoE block on its flattened input xs [T, H] to its [T, H] output: the router
    linear, ``topk_router`` (``router``, renormalised with ``norm_topk``) and the ``batched_mm`` experts. The
    pattern of the routed-experts rewrite (a normed input) and of ``moe_regroup``."""

    def pattern(xs, router_w, gate_up, down, *, top_k):
        hidden_dim = xs.shape[-1]
        router_logits = F.linear(xs.reshape(-1, hidden_dim), router_w)
        router_top_value, router_indices = topk_router(router_logits, router, norm_topk, top_k)
        return experts(xs, router_top_value, router_indices, gate_up, down, top_k)

    pattern.__qualname__ = f"routed[{router}{'+renorm' if norm_topk else ''}]"
    return pattern


def _grouped_pattern(norm_topk: bool):
    """DeepSeek-V3's routed experts (``DeepseekV3TopkRouter`` + the experts), on the normed input that its
    shared experts also read: sigmoid scores of fp32 logits, the choice on scores plus the correction bias
    within the best groups, weights from the scores [renormalised], times the routed scaling factor."""

    def pattern(h, router_w, bias, gate_up, down, *, top_k, n_group, topk_group, scaling):
        hidden_dim = h.shape[-1]
        num_experts = router_w.shape[0]
        hidden_states = h.view(-1, hidden_dim)
        router_logits = F.linear(hidden_states.type(torch.float32), router_w.type(torch.float32))
        scores = router_logits.sigmoid()
        scores_for_choice = scores + bias
        group_scores = (scores_for_choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0]
                        .sum(dim=-1))
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group)
                      .reshape(-1, num_experts))
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
        topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        if norm_topk:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        topk_weights = topk_weights * scaling
        xs = h.view(-1, hidden_dim)
        return experts(xs, topk_weights, topk_indices, gate_up, down, top_k).view(*h.shape)

    def replacement(h, router_w, bias, gate_up, down, *, top_k, n_group, topk_group, scaling, count, configs, pdl):
        return torch.ops.tkcc.moe(h, None, 1e-6, router_w, gate_up, down, top_k, norm_topk, False, count, configs,
                                  pdl, "sigmoid_grouped", bias, n_group, topk_group, scaling)

    return pattern, replacement


def _grouped_example(dt):
    E, H, I = 24, 48, 20  # 6 groups of 4
    return ((torch.empty(1, 1, H, dtype=dt), torch.empty(E, H, dtype=dt), torch.empty(E, dtype=torch.float32),
             torch.empty(E, 2 * I, H, dtype=dt), torch.empty(E, H, I, dtype=dt)),
            {"top_k": TOP_K, "n_group": 6, "topk_group": 5, "scaling": 2.375})


def _grouped_check(m) -> str | None:
    h, r, b, gu, dn = (m.val(i) for i in range(5))
    E, I2, H = gu.shape
    if h.numel() != h.shape[-1]:
        return f"h {tuple(h.shape)} is more than one token"
    if tuple(r.shape) != (E, H) or tuple(dn.shape) != (E, H, I2 // 2) or tuple(b.shape) != (E,):
        return f"router {tuple(r.shape)} / bias {tuple(b.shape)} / experts {tuple(gu.shape)} are not one MoE layout"
    if not (gu.is_contiguous() and dn.is_contiguous() and r.stride(-1) == 1):
        return "expert weights are not contiguous [E, 2I, H] / [E, H, I]"
    return None


def _routed_example(dt):
    E, H, I = 12, 48, 20
    return ((torch.empty(1, H, dtype=dt), torch.empty(E, H, dtype=dt), torch.empty(E, 2 * I, H, dtype=dt),
             torch.empty(E, H, I, dtype=dt)), {"top_k": TOP_K})


GROUPED = [Rewrite(f"moe[sigmoid grouped top-k{'+renorm' if renorm else ''}, routed experts of a normed input]",
                   *_grouped_pattern(renorm), _grouped_example, region="moe", check=_grouped_check, params=_params)
           for renorm in (True, False)]
# a routed scaling factor of 1 (its product dropped by canonicalize) is the same router
REWRITES = _rewrites() + GROUPED + [at_one(rw, "scaling") for rw in GROUPED] + [
    Rewrite("moe[routed experts of a normed input]", routed, _routed_replacement, _routed_example, region="moe",
            check=_routed_check, params=_params)]
