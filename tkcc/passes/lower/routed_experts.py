"""Routed experts of an input normed already, for the router variants ``moe.py``'s normed-input rewrite lacks.

A block whose norm output has other users than the MoE (MiniMax: the normed hidden state is also the residual,
scaled; a shared expert) cannot take the norm into its region, so the region starts at the flattened normed
input [T, H]: the top-k router (softmax in fp32 of the upcast logits, Mixtral/MiniMax, or with ``dtype=float``,
OLMoE/Qwen; renormalised or not; weights kept fp32 or rounded to the dtype) and transformers' ``batched_mm``
experts. It becomes ``tkcc.moe`` without the norm prologue: the routed kernels read only the k selected experts.
MiniMax's residual, that normed input times alpha, added after the block, is taken with it (``scaled_residual``).

GraniteMoE's router takes the top k of the fp32 logits and a softmax over those k: the same experts and, in exact
arithmetic, the same weights as a softmax over all, its top k, renormalised (``tkcc.moe``'s softmax router with
``norm_topk``); the two round differently in fp32 before the weights are rounded to the dtype, so that rewrite is
not exact.

Ernie 4.5-MoE's router upcasts its input and weight, takes the softmax of those fp32 logits, chooses on the
probabilities plus a correction bias, and renormalises the chosen probabilities over ``max(sum, norm_min)``:
``tkcc.moe``'s ``softmax_biased`` router (fp32 logits summed in another order, so not exact).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tkcc.passes.lower.moe import TOP_K, _params, _routed_check, _routed_example, experts, routed_layout, \
    routed_pattern
from tkcc.passes.lower.pattern import Rewrite


def _routed_pattern(router: str, norm_topk: bool):
    pattern = routed_pattern(router, norm_topk)

    def replacement(xs, router_w, gate_up, down, *, top_k, count, configs, pdl):
        return torch.ops.tkcc.moe(xs, None, 1e-6, router_w, gate_up, down, top_k, norm_topk, False, count, configs,
                                  pdl, router)

    return pattern, replacement


ALPHA = 1.4375  # sentinel: the residual's scale


def scaled_residual(router: str, norm_topk: bool):
    """MiniMax's MoE block and the residual after it: its input h (the normed hidden state, so the region starts
    there) flattened, ``routed_pattern``, the output shaped back, plus ``h * alpha`` -> one ``tkcc.moe`` whose down
    kernel adds the scaled residual (``residual_scale``)."""
    inner = routed_pattern(router, norm_topk)

    def pattern(h, router_w, gate_up, down, *, top_k, alpha):
        batch_size, sequence_length, hidden_dim = h.shape
        y = inner(h.view(-1, h.shape[-1]), router_w, gate_up, down, top_k=top_k)
        return h * alpha + y.reshape(batch_size, sequence_length, hidden_dim)

    def replacement(h, router_w, gate_up, down, *, top_k, alpha, count, configs, pdl):
        return torch.ops.tkcc.moe(h, None, 1e-6, router_w, gate_up, down, top_k, norm_topk, True, count, configs,
                                  pdl, router, None, 1, 1, 1.0, None, 0.0, float(alpha))

    pattern.__qualname__ = f"scaled_residual[{router}{'+renorm' if norm_topk else ''}]"
    return pattern, replacement


def _scaled_example(dt):
    E, H, I = 12, 48, 20
    return ((torch.empty(1, 1, H, dtype=dt), torch.empty(E, H, dtype=dt), torch.empty(E, 2 * I, H, dtype=dt),
             torch.empty(E, H, I, dtype=dt)), {"top_k": TOP_K, "alpha": ALPHA})


def _scaled_check(m) -> str | None:
    h = m.val(0)
    if h.dim() != 3 or h.numel() != h.shape[-1]:
        return f"h {tuple(h.shape)} is not one token"
    return routed_layout(torch.empty(1, h.shape[-1], device="meta"), *(m.val(i) for i in range(1, 4)))


# before moe.py's rewrites: their routed-experts pattern would take the block without its residual
SCALED = [Rewrite(f"moe[{router}{'+renorm' if renorm else ''}-top-k, routed experts of a normed input, "
                  "+ the input scaled]", *scaled_residual(router, renorm), _scaled_example, region="moe",
                  check=_scaled_check, params=_params)
          for router, renorm in (("softmax_fp32", True), ("softmax_fp32", False), ("softmax", True),
                                 ("softmax", False))]


# (moe.py has the softmax router without renormalisation, Qwen2-MoE's)
REWRITES = [Rewrite(f"moe[{router}{'+renorm' if renorm else ''}-top-k, routed experts of a normed input]",
                    *_routed_pattern(router, renorm), _routed_example, region="moe", check=_routed_check,
                    params=_params)
            for router, renorm in (("softmax_fp32", True), ("softmax_fp32", False), ("softmax", True))]


def topk_softmax_routed(xs, router_w, gate_up, down, *, top_k):
    """GraniteMoE's block on its flattened normed input (``GraniteMoeTopKRouter``, then the ``batched_mm``
    experts): the top k of the fp32 logits, softmax over those k, the weights in the input's dtype."""
    router_logits = F.linear(xs, router_w).float()
    top_k_logits, top_k_index = router_logits.topk(top_k, dim=-1)
    top_k_weights = torch.softmax(top_k_logits, dim=-1).type_as(xs)
    return experts(xs, top_k_weights, top_k_index, gate_up, down, top_k)


def _to_renormalised(xs, router_w, gate_up, down, *, top_k, count, configs, pdl):
    return torch.ops.tkcc.moe(xs, None, 1e-6, router_w, gate_up, down, top_k, True, False, count, configs, pdl,
                              "softmax")


REWRITES.append(Rewrite("moe[top-k then softmax, routed experts of a normed input]", topk_softmax_routed,
                        _to_renormalised, _routed_example, region="moe", check=_routed_check, params=_params))



def biased_softmax_routed(xs, router_w, bias, gate_up, down, *, top_k, norm_min):
    """Ernie 4.5-MoE's block on its flattened normed input (``Ernie4_5_MoeTopKRouter`` with its
    ``moe_statics`` bias, then the ``batched_mm`` experts)."""
    router_logits = F.linear(xs.float(), router_w.float())
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    _, selected_experts = torch.topk(routing_weights + bias.squeeze(), top_k, dim=-1)
    routing_weights = torch.gather(routing_weights, dim=-1, index=selected_experts)
    routing_weights = routing_weights / torch.clamp(routing_weights.sum(dim=-1, keepdim=True), min=norm_min)
    routing_weights = routing_weights.to(xs.dtype)
    return experts(xs, routing_weights, selected_experts, gate_up, down, top_k)


def _to_biased(xs, router_w, bias, gate_up, down, *, top_k, norm_min, count, configs, pdl):
    return torch.ops.tkcc.moe(xs, None, 1e-6, router_w, gate_up, down, top_k, True, False, count, configs, pdl,
                              "softmax_biased", bias, norm_min=norm_min)


def _biased_example(dt):
    E, H, I = 12, 48, 20
    return ((torch.empty(1, H, dtype=dt), torch.empty(E, H, dtype=dt), torch.empty(1, E, dtype=torch.float32),
             torch.empty(E, 2 * I, H, dtype=dt), torch.empty(E, H, I, dtype=dt)),
            {"top_k": TOP_K, "norm_min": 1.25e-11})


def _biased_check(m) -> str | None:
    xs, r, b, gu, dn = (m.val(i) for i in range(5))
    if b.numel() != gu.shape[0] or not b.is_contiguous():
        return f"bias {tuple(b.shape)} is not one contiguous value for each of {gu.shape[0]} experts"
    return routed_layout(xs, r, gu, dn)


REWRITES.append(Rewrite("moe[softmax+bias choice, clamped renorm, routed experts of a normed input]",
                        biased_softmax_routed, _to_biased, _biased_example, region="moe", check=_biased_check,
                        params=_params))
