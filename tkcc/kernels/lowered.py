"""The ops of the lowered decode step: ``torch.ops.tkcc.*``, each a fused kernel beside its plain reference.

``tkcc.passes.lower`` rewrites the captured aten decode graph region by region into these ops. They are
PyTorch custom ops, so that

- a rewritten graph holds each as one node, and a later rewrite's pattern can name it (a GEMV's gated
  epilogue is a pattern over ``tkcc.gemv`` and ``aten.split_with_sizes``), as TorchInductor's patterns name
  aten ops;
- ``torch.export`` traces a pattern or a replacement that calls one without entering it (the fake
  implementations give shapes), and a CUDA-graph capture records the kernels it launches;
- codegen writes each as ``torch.ops.tkcc.<op>.default(...)``, and an artifact registers them by importing
  this module (it needs torch and triton; never the compiler).

Every op takes exactly what its region computed from (activations, the model's own weights, the static
cache, scalars read off the graph) plus its kernel configs, which the artifact's source holds as literals
(never a process-global table). Each runs its kernel when the call is one decode token of one sequence on
a device the kernel supports (CUDA, or CPU under ``TRITON_INTERPRET=1`` in fp32/fp16); anything else runs
the reference, which is the region's eager arithmetic op for op, so off the kernel path a lowered graph
computes what the captured graph computed, bit for bit. A kernel that cannot take a call (a shape, a
stride, a dtype) says why once (``tkcc.kernels.common.fallbacks``) and the reference runs: never a wrong
result.

Scratch: buffers a kernel only writes before it reads (split-KV partials, router logits) are allocated per
call (from the CUDA graph's pool when the step is captured); arrival counters, which must start at zero
and which each kernel leaves at zero, are tensors of the graph (``count``) that the op mutates.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from tkcc.kernels.common import fallback_reason, next_pow2, note_fallback, split_heads_ref

NS = "tkcc"
ACTS = ("", "silu", "gelu", "gelu_tanh")  # gated epilogues of tkcc.gemv: none, act(g) * u
UP_ACTS = ("", "gelu", "gelu_tanh", "relu2")  # activations over a plain (not gated) output: an MLP's up projection


def up_act_ref(y: Tensor, up_act: str) -> Tensor:
    """The activation of a non-gated MLP as transformers' ``ACT2FN`` computes it (one eager op, or relu then square)."""
    if up_act == "relu2":
        return torch.square(F.relu(y))
    return F.gelu(y, approximate="tanh" if up_act == "gelu_tanh" else "none")

_PDL: dict[int, bool] = {}  # device index -> programmatic dependent launch available (a property of the device)


def _pdl_ok(device: torch.device) -> bool:
    """PDL needs Hopper or later; a config asking for it on an older GPU (or the interpreter) launches without."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL:
        _PDL[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL[idx]


def _one_token(x: Tensor) -> bool:
    return x.dim() >= 1 and x.numel() == x.shape[-1]


# ---- references: the eager arithmetic of each region, as Hugging Face writes it ---------------------------

def rms_norm_ref(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0, cast_first: bool = True,
                 gate: Optional[Tensor] = None, gate_act: str = "silu") -> Tensor:
    """RMSNorm with its fp32 statistic. ``cast_first`` (Llama, OLMoE, Qwen): the normalised x is rounded to
    x's dtype, then times ``weight`` (+ ``offset``); else (Gemma's ``1 + w``): times ``offset + weight`` in
    fp32, rounded once. ``gate`` (Qwen3-Next's ``RMSNormGated``): that, times ``silu(gate)`` in fp32, rounded
    once; the gate is x's rows in order, in any shape (``gate.reshape(x.shape)``). ``gate_act`` "sigmoid"
    (MiniMax's output gate after its norm): ``sigmoid(gate) * norm``, each rounded to the dtype as eager rounds
    them."""
    dt = x.dtype
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(var + eps)
    if cast_first:
        w = weight if offset == 0.0 else offset + weight
        y = w * xf.to(dt)
    else:
        y = (xf * (offset + weight.float())).to(dt)
    if gate is None:
        return y
    if gate_act == "sigmoid":
        return torch.sigmoid(gate.reshape(x.shape)) * y
    return (y * F.silu(gate.reshape(x.shape).to(torch.float32))).to(dt)


def gemv_ref(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, norm_weight: Optional[Tensor] = None,
             eps: float = 1e-6, residual: Optional[Tensor] = None, act: str = "", up_act: str = "",
             split_heads: int = 0, residual_scale: float = 1.0, residual2: Optional[Tensor] = None) -> Tensor:
    """[RMSNorm] -> linear [+ bias] -> [act(g) * u over the two halves | up_act(y)] -> [residual +]; with
    ``split_heads`` (a head dim), the per-head [q_h | k_h | v_h] rows of the output put as [q | k | v].
    ``residual_scale``: the residual is ``residual * residual_scale``, rounded to its dtype before the add (MiniMax's
    ``h * alpha + y``). ``residual2``: added after the first residual's sum is rounded (DeepSeek's
    ``h + (moe_out + shared_out)``: two eager adds, each rounded)."""
    h = rms_norm_ref(x, norm_weight, eps) if norm_weight is not None else x
    y = F.linear(h, weight, bias)
    if up_act:
        y = up_act_ref(y, up_act)
    if act:
        n = y.shape[-1] // 2
        g, u = torch.split(y, [n, n], -1)
        y = (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")) * u
    if residual is not None:
        y = (residual if residual_scale == 1.0 else residual * residual_scale) + y
    if residual2 is not None:
        y = residual2 + y
    if split_heads:
        y = split_heads_ref(y, split_heads)
    return y


def rotary_cos_sin_ref(inv_freq: Tensor, position_ids: Tensor, scale: float, dtype: torch.dtype):
    """cos and sin of the rotary angles [B, T, D] (``LlamaRotaryEmbedding.forward``): inv_freq (in whatever
    dtype the model holds it) times the positions in fp32, both halves, times ``scale``
    (``attention_scaling``), then rounded to ``dtype``."""
    inv = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(dtype=torch.float,
                                                                         device=position_ids.device)
    pos = position_ids[:, None, :].float()
    freqs = (inv @ pos).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D] rotated by cos/sin [B, T, D] (``apply_rotary_pos_emb``, ``unsqueeze_dim=1``)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def rope_pairs_ref(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """x [B, H, T, D] rotated on its first R elements by the table cos/sin [B, T, R] (``cat(f, f)``, as the rotary
    embedding makes it), the rest passed through (partial rotary: Phi-3, StableLM, GPT-NeoX). ``interleaved``:
    pairs (2i, 2i + 1) rotate, at frequency i (GLM's ``rotate_half_llm`` and its ``repeat_interleave``d table)."""
    R = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    xr, xp = x[..., :R], x[..., R:]
    if interleaved:
        c = c[..., : R // 2].repeat_interleave(2, dim=-1)
        s = s[..., : R // 2].repeat_interleave(2, dim=-1)
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        rot = rotate_half(xr)
    out = xr * c + rot * s
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


def layer_norm_two_pass_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LayerNorm as Cohere writes it (``CohereLayerNorm.forward``): the mean and then the mean of the squared
    deviations in fp32, the normalised x times the weight in fp32, rounded once; no bias."""
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(var + eps)
    return (weight.to(torch.float32) * h).to(x.dtype)


def causal_mask_ref(cache_position: Tensor, kv_len: int, window: int = 0) -> Tensor:
    """[1, 1, T, kv_len] bool: query i (at ``cache_position[0] + i``) sees cache positions <= its own, and with
    ``window`` only the last ``window`` of them (``transformers.masking_utils.sdpa_mask``, no padding)."""
    dev = cache_position.device
    q = torch.arange(cache_position.shape[0], device=dev) + cache_position[0]
    kv = torch.arange(kv_len, device=dev)
    q, kv = q[None, None, :, None], kv[None, None, None, :]
    mask = kv <= q
    if window:
        mask = (kv > q - window) & mask
    return mask.expand(1, -1, cache_position.shape[0], kv_len)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * n_rep, S, D] (transformers' ``repeat_kv``)."""
    if n_rep == 1:
        return x
    B, H, S, D = x.shape
    return x[:, :, None, :, :].expand(B, H, n_rep, S, D).reshape(B, H * n_rep, S, D)


def attention_rope_ref(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, cache_position: Tensor,
                       inv_freq: Optional[Tensor], rope_scale: float, q_norm: Optional[Tensor],
                       k_norm: Optional[Tensor], eps: float, scale: float, num_heads: int, window: int = 0,
                       head_norm: bool = False, rotary_dim: int = 0, interleaved: bool = False,
                       sinks: Optional[Tensor] = None, norm_offset: Optional[float] = None, rope_fp32: bool = False,
                       rope_table_rounded: bool = False, kv_broadcast: bool = False, q_gated: bool = False,
                       q_scale: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                       alibi_beta: float = 1.0) -> Tensor:
    """One attention block of a decode step from the packed projection ``qkv`` [B, T, (Hq + 2 Hkv) D]:
    [q/k RMSNorm over the whole projection (OLMoE) or, ``head_norm``, over each head (Qwen3)] -> heads ->
    rotary at ``cache_position`` -> keys and values written into the static caches [B, Hkv, S, D] there ->
    causal attention over the cache -> [B, T, Hq D]. ``rotary_dim`` / ``interleaved``: partial and interleaved
    rotary (``rope_pairs_ref``; ``inv_freq`` then has ``rotary_dim / 2`` entries); ``sinks`` [Hq]: a learned
    logit per head in the softmax's denominator, as gpt-oss's eager attention computes it. ``norm_offset``: the q/k
    norms are ``norm(x) * (norm_offset + w)`` in fp32 rounded once (``rms_norm_ref``'s ``cast_first`` False: Gemma's
    per head, OLMo 2's over the whole projection with offset 0), None for the Llama form. ``rope_fp32``: the table is
    kept fp32 and q and k are upcast to be rotated by it, then rounded back (Ernie 4.5, OLMo 2); with
    ``rope_table_rounded`` the table is rounded to the activations' dtype first, as Cohere's rotary embedding rounds it
    (and its ``apply_rotary_pos_emb`` upcasts q and k to rotate them by it). ``inv_freq`` None: nothing rotates
    (positions learned, GPT-2, or none, NoPE layers). ``kv_broadcast``: the one kv head is broadcast over the query
    heads by sdpa itself, not repeated first (Falcon's multi-query block: the same attention, rounded as sdpa
    rounds that form). ``q_gated``: each q head is followed by its gate in the projection, [q_0 | g_0 | ... | k | v]
    (Qwen3-Next: the gate's product with the output is the caller's); q/k norms then per head only. ``q_scale``: q
    times this scalar in the activations' dtype before anything else (OPT's ``q_proj(x) * scaling``, then
    ``scale`` 1). ``alibi_slopes`` [Hq] (fp32): ALiBi, each score ``alibi_beta * alibi + scale * q.k`` with
    ``alibi[h, j] = slopes[h] * j`` rounded to the activations' dtype, as BLOOM's eager attention computes it
    (``alibi_attention_ref``); nothing rotated."""
    B, T = qkv.shape[0], qkv.shape[1]
    hkv, S, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    q, k, v = torch.split(qkv, [num_heads * D * (2 if q_gated else 1), hkv * D, hkv * D], -1)
    if q_scale is not None:
        q = q * q_scale
    form = (0.0, True) if norm_offset is None else (norm_offset, False)
    if q_norm is not None and not head_norm:
        if q_gated:
            raise ValueError("tkcc.attention_rope: a gated q has per-head norms only")
        q = rms_norm_ref(q, q_norm, eps, *form)
        k = rms_norm_ref(k, k_norm, eps, *form)
    q = q.view(B, T, -1, 2 * D)[..., :D] if q_gated else q.view(B, T, -1, D)
    k = k.view(B, T, -1, D)
    if q_norm is not None and head_norm:
        q = rms_norm_ref(q, q_norm, eps, *form)
        k = rms_norm_ref(k, k_norm, eps, *form)
    q = q.transpose(1, 2)
    k = k.transpose(1, 2)
    v = v.view(B, T, -1, D).transpose(1, 2)
    if inv_freq is not None:
        cos, sin = rotary_cos_sin_ref(inv_freq, cache_position.unsqueeze(0).expand(B, -1), rope_scale,
                                      torch.float32 if rope_fp32 and not rope_table_rounded else qkv.dtype)
        dt = q.dtype
        if rope_fp32:
            q, k = q.float(), k.float()
        if rotary_dim or interleaved:
            q, k = rope_pairs_ref(q, cos, sin, interleaved), rope_pairs_ref(k, cos, sin, interleaved)
        else:
            q, k = rope_ref(q, cos, sin), rope_ref(k, cos, sin)
        q, k = q.to(dt), k.to(dt)
    k_cache.index_copy_(2, cache_position, k)
    v_cache.index_copy_(2, cache_position, v)
    n_rep = 1 if kv_broadcast else num_heads // hkv
    mask = causal_mask_ref(cache_position, S, window)
    if sinks is not None:
        return sink_attention_ref(q, repeat_kv(k_cache, n_rep), repeat_kv(v_cache, n_rep), mask, sinks, scale) \
            .transpose(1, 2).reshape(B, T, -1)
    if alibi_slopes is not None:
        return alibi_attention_ref(q, repeat_kv(k_cache, n_rep), repeat_kv(v_cache, n_rep), mask, alibi_slopes,
                                   alibi_beta, scale).permute(0, 2, 1, 3).reshape(B, T, -1)
    o = F.scaled_dot_product_attention(q, repeat_kv(k_cache, n_rep), repeat_kv(v_cache, n_rep), attn_mask=mask,
                                       scale=scale)
    return o.transpose(1, 2).reshape(B, T, -1)


def sink_attention_ref(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """gpt-oss's ``eager_attention_forward``: scores + the additive mask (the dtype's minimum where masked), the
    per-head sink logit as one more column, max-subtracted softmax in the scores' dtype, the sink's column
    dropped. q [B, H, T, D], keys/values [B, H, S, D] -> [B, H, T, D]."""
    w = torch.matmul(q, keys.transpose(2, 3)) * scale
    w = w + torch.where(mask, torch.zeros((), dtype=w.dtype, device=w.device), torch.finfo(w.dtype).min)
    sk = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    logits = torch.cat([w, sk], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)
    return torch.matmul(probs[..., :-1], values)


def alibi_attention_ref(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, slopes: Tensor, beta: float,
                        scale: float) -> Tensor:
    """BLOOM's eager attention (``BloomAttention``): the ALiBi bias ``slopes[h] * j`` over the key positions j in
    fp32, rounded to the activations' dtype, ``baddbmm(alibi, q, k^T, beta, alpha=scale)`` over the heads, plus
    the additive mask (the dtype's minimum where masked), softmax in fp32 rounded back, times the values. The
    rewrite's region computes exactly this, so the reference is bit-exact with it. q [B, H, T, D], keys/values
    [B, H, S, D] -> [B, H, T, D]."""
    B, H, T, D = q.shape
    S = keys.shape[2]
    pos = torch.arange(S, device=q.device, dtype=torch.float32)
    alibi = (slopes.to(torch.float32)[:, None] * pos).reshape(B * H, 1, S).to(q.dtype)
    w = alibi.baddbmm(q.reshape(B * H, T, D), keys.reshape(B * H, S, D).transpose(-1, -2), beta=beta, alpha=scale)
    w = w.view(B, H, T, S) + torch.where(mask, torch.zeros((), dtype=w.dtype, device=w.device),
                                         torch.finfo(w.dtype).min)
    p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p.view(B * H, T, S), values.reshape(B * H, S, D)).view(B, H, T, D)


def pack_rows(weights: list[Tensor]) -> Tensor:
    """``weights`` (2-D, same width) stacked row-wise: a view when they already are consecutive rows of one
    buffer (capture packs q|k|v and gate|up so: ``tkcc.frontend.weight_packing``), else a copy. The model's
    parameters are never re-pointed. A lowered graph calls this when it is built and an artifact when it
    binds, so neither embeds weights."""
    base = weights[0]
    if base.dim() == 1:  # biases: small, copied
        with torch.no_grad():
            return torch.cat([w.detach() for w in weights], 0)
    if base.dim() == 2 and base.storage_offset() == 0 and all(w.is_contiguous() for w in weights):
        ptr, off = base.untyped_storage().data_ptr(), 0
        for w in weights:
            if w.untyped_storage().data_ptr() != ptr or w.storage_offset() != off or w.shape[1] != base.shape[1]:
                break
            off += w.numel()
        else:
            return torch.as_strided(base, (sum(w.shape[0] for w in weights), base.shape[1]), base.stride(), 0)
    with torch.no_grad():
        return torch.cat([w.detach() for w in weights], 0)


# OLMoE / Qwen3-MoE: softmax, weights rounded to the dtype; Mixtral: kept fp32; DeepSeek-V3: sigmoid scores,
# bias-corrected grouped top-k, scaled fp32 weights; Ernie 4.5-MoE: softmax of fp32 logits, the choice on the
# probabilities plus a correction bias, renormalised over max(sum, norm_min), weights rounded to the dtype
ROUTERS = ("softmax", "softmax_fp32", "sigmoid_grouped", "softmax_biased")


def moe_ref(h: Tensor, norm_weight: Optional[Tensor], eps: float, router_w: Tensor, gate_up: Tensor, down: Tensor,
            top_k: int, norm_topk: bool, residual: bool, router: str = "softmax", router_bias: Optional[Tensor] = None,
            n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
            forced_ids: Optional[Tensor] = None, norm_min: float = 0.0, residual_scale: float = 1.0) -> Tensor:
    """A sparse-MoE block for tokens h [B, T, H] as OLMoE / Qwen3-MoE / Mixtral write it, with transformers'
    ``batched_mm`` experts: [RMSNorm] -> router logits -> softmax (fp32) -> top-k [-> renormalised] [->
    rounded to the dtype (``router="softmax"``; Mixtral's ``"softmax_fp32"`` keeps them fp32)] -> each token's
    k experts (gate_up [E, 2I, H], silu(g) * u, down [E, H, I]) weighted and summed [-> + h].
    ``forced_ids`` [k] (a benchmark's real routing, softmax routers only): every token takes these experts in
    place of its top-k, each weighted by its softmax probability (renormalised over the k when ``norm_topk``).
    ``router="softmax_biased"`` (Ernie 4.5-MoE): the logits of the upcast input and router, the choice on their
    softmax plus ``router_bias``, the chosen probabilities renormalised over ``max(sum, norm_min)``.
    ``residual_scale``: the residual is ``h * residual_scale``, rounded to the dtype before the add (MiniMax's
    ``h * alpha + moe(h)``, h its normed hidden state)."""
    x = rms_norm_ref(h, norm_weight, eps) if norm_weight is not None else h
    H = x.shape[-1]
    xs = x.view(-1, H)
    if forced_ids is not None and router == "sigmoid_grouped":
        from tkcc.errors import TkccError

        raise TkccError("tkcc.moe: forced_ids takes a softmax router's experts; the grouped router has no such hook")
    if router == "sigmoid_grouped":
        w, ids = _grouped_router(xs, router_w, router_bias, top_k, n_group, topk_group, norm_topk, scaling)
    else:
        biased = router == "softmax_biased"
        rows = xs.reshape(-1, H)
        logits = F.linear(rows.float(), router_w.float()) if biased else F.linear(rows, router_w)
        probs = F.softmax(logits, dtype=torch.float, dim=-1) if router in ("softmax", "softmax_biased") else \
            F.softmax(logits.float(), dim=-1)
        if forced_ids is not None:
            ids = forced_ids.reshape(1, top_k).long().clamp(0, gate_up.shape[0] - 1).expand(xs.shape[0], top_k)
            w = probs.gather(-1, ids)
        elif biased:
            ids = torch.topk(probs + router_bias.reshape(-1).float(), top_k, dim=-1).indices
            w = probs.gather(-1, ids)
        else:
            w, ids = torch.topk(probs, top_k, dim=-1)
        if norm_topk:
            w = w / (torch.clamp(w.sum(dim=-1, keepdim=True), min=norm_min) if biased else w.sum(dim=-1, keepdim=True))
        if router in ("softmax", "softmax_biased"):
            w = w.to(xs.dtype)
    sel = xs.repeat_interleave(top_k, dim=0)
    sw = w.reshape(-1)
    eid = ids.reshape(-1).clamp(0, gate_up.shape[0] - 1)
    gu = torch.bmm(gate_up[eid], sel.unsqueeze(-1)).squeeze(-1)
    g, u = gu.chunk(2, dim=-1)
    a = F.silu(g) * u
    y = torch.bmm(down[eid], a.unsqueeze(-1)).squeeze(-1)
    y = (y * sw.unsqueeze(-1)).view(xs.shape[0], top_k, H).sum(dim=1).to(xs.dtype)
    y = y.reshape(x.shape)
    if not residual:
        return y
    return (h if residual_scale == 1.0 else h * residual_scale) + y


# ---- the ops ---------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{NS}::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0, cast_first: bool = True,
             gate: Optional[Tensor] = None, gate_act: str = "silu") -> Tensor:
    """RMSNorm over the last dim (``rms_norm_ref``): the Triton row kernel, in each of the reference's weight forms,
    gated or not (the gate read at its strides where they allow: ``tkcc.kernels.rmsnorm.gate_rows``); ``gate_act``
    (last: graphs written before it still load): "silu" or "sigmoid"."""
    if gate_act not in ("silu", "sigmoid"):
        raise ValueError(f"tkcc.rms_norm: gate_act {gate_act!r} is not 'silu' or 'sigmoid'")
    reason = fallback_reason(x, weight, gate)
    if reason is None and not (x.is_contiguous() and weight.is_contiguous() and weight.numel() == x.shape[-1]):
        reason = f"non-contiguous or mismatched x {tuple(x.shape)} weight {tuple(weight.shape)}"
    if reason is None and gate is not None:
        from tkcc.kernels.rmsnorm import gate_rows

        if gate_rows(gate, x) is None:
            reason = f"gate {tuple(gate.shape)} strides {gate.stride()} are not rows of x {tuple(x.shape)} in place"
    if reason is None:
        from tkcc.kernels.rmsnorm import rmsnorm

        return rmsnorm(x, weight, eps, offset=offset, cast_first=cast_first, gate=gate, gate_act=gate_act)
    note_fallback("tkcc.rms_norm", reason)
    return rms_norm_ref(x, weight, eps, offset, cast_first, gate, gate_act)


@rms_norm.register_fake
def _(x, weight, eps, offset=0.0, cast_first=True, gate=None, gate_act="silu"):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
               two_pass: bool = False) -> Tensor:
    """LayerNorm over the last dim (``F.layer_norm``: its own fused kernel on every device). ``two_pass``: the region
    writes it out (``layer_norm_two_pass_ref``): that arithmetic off a kernel, ``F.layer_norm``'s fused one (its own
    statistic, within rounding) where a kernel runs."""
    if not two_pass:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if bias is not None:
        raise ValueError("tkcc.layer_norm: the two-pass form has no bias")
    reason = fallback_reason(x, weight)
    if reason is None:
        return F.layer_norm(x, (x.shape[-1],), weight, None, eps)
    note_fallback("tkcc.layer_norm", reason)
    return layer_norm_two_pass_ref(x, weight, eps)


@layer_norm.register_fake
def _(x, weight, bias, eps, two_pass=False):
    return torch.empty_like(x)


def gemv_reason(x: Tensor, weight: Tensor, bias, norm_weight, residual, act: str, up_act: str = "",
                split_heads: int = 0, residual_scale: float = 1.0, residual2=None) -> str | None:
    """None when the GEMV kernel takes this call, else why not."""
    reason = fallback_reason(x, weight, bias, norm_weight, residual, residual2)
    if reason is not None:
        return reason
    K = weight.shape[-1]
    if not _one_token(x) or x.shape[-1] != K:
        return f"x {tuple(x.shape)} is not one token of width {K}"
    if weight.dim() != 2 or weight.stride(-1) != 1:
        return f"weight {tuple(weight.shape)} strides {weight.stride()} are not [N, K] rows"
    if act not in ACTS:
        return f"gated epilogue {act!r} has no kernel (kernels: {ACTS})"
    if up_act not in UP_ACTS or (up_act and (act or residual is not None)):
        return (f"activation {up_act!r} over the output has no kernel (kernels: {UP_ACTS}, with neither a gated "
                "epilogue nor a residual)")
    if norm_weight is not None and (norm_weight.numel() != K or not norm_weight.is_contiguous()):
        return f"norm weight {tuple(norm_weight.shape)} for width {K}"
    if residual is not None and residual.numel() != (weight.shape[0] // (2 if act else 1)):
        return f"residual {tuple(residual.shape)} for {weight.shape[0]} rows"
    if split_heads and (act or up_act or residual is not None or weight.shape[0] % (3 * split_heads)):
        return (f"split_heads={split_heads} over {weight.shape[0]} rows, or with a gate, an activation or a "
                "residual")
    if residual_scale != 1.0 and residual is None:
        return f"a residual scale {residual_scale} without a residual"
    if residual2 is not None and (residual is None or residual2.numel() != residual.numel()):
        return (f"a second residual {tuple(residual2.shape)} without a first one, or of another size "
                f"({None if residual is None else tuple(residual.shape)})")
    return None


@torch.library.custom_op(f"{NS}::gemv", mutates_args=())
def gemv(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, norm_weight: Optional[Tensor] = None,
         eps: float = 1e-6, residual: Optional[Tensor] = None, act: str = "", config: Optional[list[int]] = None,
         pdl: bool = False, up_act: str = "", split_heads: int = 0, residual_scale: float = 1.0,
         residual2: Optional[Tensor] = None) -> Tensor:
    """``gemv_ref`` as one batch-1 GEMV kernel: RMSNorm prologue, bias, gated epilogue (``act``: the weight is
    [gate; up]) or an activation over the output (``up_act``), and residual epilogue in the same launch.
    ``config``: (BLOCK_N, BLOCK_K, warps), empty for the kernel's default; ``pdl``: programmatic dependent launch
    where the device has it; ``split_heads``, ``residual_scale``, ``residual2`` (last, each in its turn: graphs
    written before it still load): see ``gemv_ref``."""
    reason = gemv_reason(x, weight, bias, norm_weight, residual, act, up_act, split_heads, residual_scale, residual2)
    if reason is None:
        from tkcc.kernels import gemv as gemv_mod

        cfg = tuple(config) if config else None  # None: the kernel's default
        y = gemv_mod.gemv(x.contiguous().view(-1), weight, norm_w=norm_weight, eps=eps,
                          residual=None if residual is None else residual.contiguous().view(-1), gated=bool(act),
                          config=cfg, pdl=pdl and _pdl_ok(x.device), bias=bias, act=act or "silu", up_act=up_act,
                          split_heads=split_heads, residual_scale=residual_scale,
                          residual2=None if residual2 is None else residual2.contiguous().view(-1))
        return y.view(*x.shape[:-1], y.shape[-1])
    note_fallback("tkcc.gemv", reason)
    return gemv_ref(x, weight, bias, norm_weight, eps, residual, act, up_act, split_heads, residual_scale, residual2)


@gemv.register_fake
def _(x, weight, bias=None, norm_weight=None, eps=1e-6, residual=None, act="", config=None, pdl=False, up_act="",
      split_heads=0, residual_scale=1.0, residual2=None):
    n = weight.shape[0] // (2 if act else 1)
    return x.new_empty(*x.shape[:-1], n)


@torch.library.custom_op(f"{NS}::rotary_cos_sin", mutates_args=())
def rotary_cos_sin(inv_freq: Tensor, position_ids: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``rotary_cos_sin_ref``: computed once per step and shared by every layer (the fused attention
    computes its own from ``inv_freq`` and the position, so once every layer is fused this op is dead)."""
    return rotary_cos_sin_ref(inv_freq, position_ids, scale, dtype)


@rotary_cos_sin.register_fake
def _(inv_freq, position_ids, scale, dtype):
    shape = (position_ids.shape[0], position_ids.shape[1], 2 * inv_freq.shape[0])
    return (position_ids.new_empty(shape, dtype=dtype), position_ids.new_empty(shape, dtype=dtype))


@torch.library.custom_op(f"{NS}::causal_mask", mutates_args=())
def causal_mask(cache_position: Tensor, kv_len: int, window: int = 0) -> Tensor:
    """``causal_mask_ref`` (shared by every layer; dead once every attention is fused)."""
    return causal_mask_ref(cache_position, kv_len, window)


@causal_mask.register_fake
def _(cache_position, kv_len, window=0):
    return cache_position.new_empty((1, 1, cache_position.shape[0], kv_len), dtype=torch.bool)


def attention_reason(qkv, k_cache, v_cache, cache_position, inv_freq, q_norm, k_norm, num_heads, chunk,
                     block_s, num_warps, count, window, head_norm=False, rotary_dim=0, interleaved=False,
                     sinks=None, norm_offset=None, q_gated=False, q_scale=None, alibi_slopes=None) -> str | None:
    """None when the fused attention kernel takes this call, else why not."""
    reason = fallback_reason(qkv, k_cache, v_cache, q_norm, k_norm)
    if reason is not None:
        return reason
    B, T = qkv.shape[0], qkv.shape[1]
    hkv, S, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if B != 1 or T != 1 or cache_position.numel() != 1:
        return f"qkv {tuple(qkv.shape)} is not one token of one sequence"
    if num_heads % hkv or D != next_pow2(D) or D < 16:
        return f"heads {num_heads}/{hkv} x {D} (needs a multiple of the kv heads, a power-of-two head dim >= 16)"
    if tuple(v_cache.shape) != tuple(k_cache.shape) or k_cache.stride() != v_cache.stride() \
            or k_cache.stride(-1) != 1:
        return f"caches {tuple(k_cache.shape)} {k_cache.stride()} / {tuple(v_cache.shape)} {v_cache.stride()}"
    if not qkv.is_contiguous() or qkv.shape[-1] != ((2 if q_gated else 1) * num_heads + 2 * hkv) * D:
        return (f"qkv {tuple(qkv.shape)} is not a contiguous [q | k | v] of {num_heads}{' gated' if q_gated else ''}"
                f"+2x{hkv} heads of {D}")
    if q_gated and q_norm is not None and not head_norm:
        return "a gated q with q/k norms over the whole projection"
    if q_scale is not None and (inv_freq is not None or q_norm is not None or q_gated):
        return "a q scale with a rotation, q/k norms or a gated q (the kernel scales q only when nothing else does)"
    if alibi_slopes is not None and (inv_freq is not None or q_norm is not None or q_gated or q_scale is not None
                                     or sinks is not None):
        return "ALiBi with a rotation, q/k norms, a gated or scaled q or sinks (the kernel biases plain q.k only)"
    if alibi_slopes is not None and (alibi_slopes.numel() != num_heads or alibi_slopes.dtype != torch.float32
                                     or not alibi_slopes.is_contiguous()):
        return (f"ALiBi slopes {tuple(alibi_slopes.shape)} {alibi_slopes.dtype} (needs fp32, one for each of "
                f"{num_heads} heads)")
    if (q_norm is None) != (k_norm is None):
        return "only one of the q/k norms"
    want = (D, D) if head_norm else (num_heads * D, hkv * D)
    if q_norm is not None and (q_norm.numel(), k_norm.numel()) != want:
        return f"q/k norm weights {tuple(q_norm.shape)}/{tuple(k_norm.shape)}, expected {want} elements"
    R = rotary_dim or D
    if R % 2 or R > D:
        return f"rotary dim {R} of head dim {D}"
    if inv_freq is not None and (not inv_freq.is_floating_point() or inv_freq.numel() != R // 2
                                 or not inv_freq.is_contiguous()):
        return f"inv_freq {tuple(inv_freq.shape)} {inv_freq.dtype} (needs a float vector of {R // 2})"
    if sinks is not None and (sinks.numel() != num_heads or not sinks.is_contiguous()):
        return f"sinks {tuple(sinks.shape)} for {num_heads} heads"
    if count.numel() < hkv or count.dtype != torch.int32:
        return f"arrival counters {tuple(count.shape)} {count.dtype} for {hkv} kv heads"
    dynamic = False
    if chunk < 0:  # -N splits sized to the context: no more than the kernel merges itself
        from tkcc.kernels.attention_rope import MERGE_MAX_SPLITS

        dynamic = -chunk <= MERGE_MAX_SPLITS
    if (chunk < 16 and not dynamic) or block_s < 16 or block_s & (block_s - 1) or num_warps not in (1, 2, 4, 8, 16):
        return (f"layout chunk={chunk} tile={block_s}x{num_warps} (a chunk is at least 16 positions, or -N: N "
                "splits sized to each step's context, no more than the kernel merges itself)")
    return None


def _check_context(cache_position: Tensor, S: int) -> None:
    """A position at or past the static cache is bad input: a clear error (the kernel would write nothing)."""
    from tkcc.errors import TkccError

    last = int(cache_position.max())
    if last >= S or int(cache_position.min()) < 0:
        raise TkccError(f"decode attention: cache position {last} needs a context of {last + 1}, longer than the "
                        f"static cache ({S} positions); capture with a larger max_cache_len")


def attention_layout(S: int, chunk: int) -> tuple[int, int]:
    """(chunk, splits) covering a cache of S positions: one split over the whole cache when it fits. A negative
    ``chunk``, -N: N splits whose chunks the kernel sizes to each step's context (its ``DYN``); returned as
    (-N, N), or one split where the cache holds no two chunks of 16."""
    if chunk < 0:
        splits = min(-chunk, max(1, S // 16))
        return (S, 1) if splits == 1 else (-splits, splits)
    chunk = min(chunk, S)
    splits = -(-S // chunk)
    return (S, 1) if splits == 1 else (chunk, splits)


@torch.library.custom_op(f"{NS}::attention_rope", mutates_args=("k_cache", "v_cache", "count"))
def attention_rope(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, cache_position: Tensor,
                   inv_freq: Optional[Tensor], rope_scale: float, q_norm: Optional[Tensor],
                   k_norm: Optional[Tensor], eps: float, scale: float, num_heads: int, window: int, chunk: int,
                   block_s: int, num_warps: int, count: Tensor,
                   pdl: bool = False, head_norm: bool = False, rotary_dim: int = 0, interleaved: bool = False,
                   sinks: Optional[Tensor] = None, norm_offset: Optional[float] = None,
                   rope_fp32: bool = False, rope_table_rounded: bool = False, kv_broadcast: bool = False,
                   q_gated: bool = False, q_scale: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                   alibi_beta: float = 1.0) -> Tensor:
    """``attention_rope_ref`` in one launch per layer (``tkcc.kernels.attention_rope``): q/k norm, rotary,
    the cache write at ``cache_position``, split-KV attention over positions [0, pos] and the merge of the
    splits. ``chunk``: positions per split, or -N: N splits sized on the device to each step's context (one
    CUDA graph then spreads every context's work evenly); ``block_s`` x ``num_warps``: the kernel's tile. The
    position is read on the device (no host synchronisation; a replayed graph advances with its input). A
    position at or past the cache writes and reads nothing there: the greedy loop refuses such a context first."""
    if kv_broadcast and k_cache.shape[1] != 1:
        raise ValueError(f"tkcc.attention_rope: kv_broadcast is for one kv head, not {k_cache.shape[1]}")
    reason = attention_reason(qkv, k_cache, v_cache, cache_position, inv_freq, q_norm, k_norm, num_heads, chunk,
                              block_s, num_warps, count, window, head_norm, rotary_dim, interleaved, sinks,
                              norm_offset, q_gated, q_scale, alibi_slopes)
    if reason is None:
        if cache_position.device.type == "cpu":  # free to check on the host (on a GPU: the greedy loop's check)
            _check_context(cache_position, k_cache.shape[2])
        from tkcc.kernels import attention_rope as ar

        hkv, S, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        ch, splits = attention_layout(S, chunk)
        dev = qkv.device
        out = torch.empty(num_heads, D, device=dev, dtype=qkv.dtype)
        po = torch.empty(num_heads, splits, D, device=dev, dtype=torch.float32)
        plse = torch.empty(num_heads, splits, device=dev, dtype=torch.float32)
        ar.launch(qkv.view(-1), k_cache[0], v_cache[0], cache_position, inv_freq, out, po, plse, count, hq=num_heads,
                  hkv=hkv, chunk=ch, splits=splits, q_norm=q_norm, k_norm=k_norm, eps=eps, scale=scale,
                  pdl=pdl and _pdl_ok(dev), block_s=block_s, num_warps=num_warps,
                  rope_scale=None if rope_scale == 1.0 else rope_scale, head_norm=head_norm, window=window,
                  rotary_dim=rotary_dim, interleaved=interleaved, sinks=sinks, norm_offset=norm_offset,
                  dynamic=ch < 0, rope_fp32=rope_fp32, rope_table_rounded=rope_table_rounded, q_gated=q_gated,
                  q_scale=q_scale, alibi=alibi_slopes, alibi_beta=alibi_beta)
        return out.view(1, 1, num_heads * D)
    note_fallback("tkcc.attention_rope", reason)
    _check_context(cache_position, k_cache.shape[2])
    return attention_rope_ref(qkv, k_cache, v_cache, cache_position, inv_freq, rope_scale, q_norm, k_norm, eps, scale,
                              num_heads, window, head_norm, rotary_dim, interleaved, sinks, norm_offset, rope_fp32,
                              rope_table_rounded, kv_broadcast, q_gated, q_scale, alibi_slopes, alibi_beta)


@attention_rope.register_fake
def _(qkv, k_cache, v_cache, cache_position, inv_freq, rope_scale, q_norm, k_norm, eps, scale, num_heads, window,
      chunk, block_s, num_warps, count, pdl=False, head_norm=False, rotary_dim=0, interleaved=False, sinks=None,
      norm_offset=None, rope_fp32=False, rope_table_rounded=False, kv_broadcast=False, q_gated=False, q_scale=None,
      alibi_slopes=None, alibi_beta=1.0):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], num_heads * k_cache.shape[3])


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _grouped_router(xs, router_w, bias, top_k, n_group, topk_group, norm_topk, scaling):
    """DeepSeek-V3's ``DeepseekV3TopkRouter``: fp32 logits, sigmoid, the choice on scores + bias within the best
    ``topk_group`` of ``n_group`` groups (by the sum of their two best), weights from the scores."""
    E = router_w.shape[0]
    logits = F.linear(xs.type(torch.float32), router_w.type(torch.float32))
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if norm_topk:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, ids


def moe_reason(h, norm_weight, router_w, gate_up, down, top_k, count, router="softmax", router_bias=None,
               n_group=1, topk_group=1, forced_ids=None, residual=True, residual_scale=1.0) -> str | None:
    """None when the routed-MoE kernels take this call, else why not."""
    reason = fallback_reason(h, norm_weight, router_w, gate_up, down)
    if reason is not None:
        return reason
    if not _one_token(h):
        return f"h {tuple(h.shape)} is not one token"
    E, I2, H = gate_up.shape
    if tuple(router_w.shape) != (E, H) or router_w.stride(-1) != 1 or tuple(down.shape) != (E, H, I2 // 2) \
            or not gate_up.is_contiguous() or not down.is_contiguous() \
            or (norm_weight is not None and norm_weight.numel() != H):
        return (f"experts not contiguous [E, 2I, H] / [E, H, I] with a router [E, H]: {tuple(gate_up.shape)}, "
                f"{tuple(down.shape)}, {tuple(router_w.shape)}")
    if router not in ROUTERS:
        return f"router {router!r} has no kernel (kernels: {ROUTERS})"
    if router == "softmax_biased" and (router_bias is None or router_bias.numel() != E
                                       or not router_bias.is_contiguous()):
        return f"biased router over {E} experts with bias {None if router_bias is None else tuple(router_bias.shape)}"
    if router == "sigmoid_grouped" and (router_bias is None or router_bias.numel() != E or n_group < 1
                                        or E % n_group or E // n_group < 2 or not 1 <= topk_group <= n_group):
        return f"grouped router over {E} experts in {n_group} groups (top {topk_group}) with bias {router_bias is not None}"
    if not 1 <= top_k <= E or count.numel() < 1 or count.dtype != torch.int32:
        return f"top-{top_k} of {E} experts, counter {tuple(count.shape)} {count.dtype}"
    if forced_ids is not None and router == "sigmoid_grouped":
        return "forced_ids with the grouped router (the kernel forces a softmax router's choice only)"
    if forced_ids is not None and (forced_ids.numel() != top_k or forced_ids.device != h.device
                                   or not forced_ids.is_contiguous() or forced_ids.dtype.is_floating_point):
        return f"forced_ids {tuple(forced_ids.shape)} {forced_ids.dtype} is not {top_k} contiguous integer ids"
    if residual_scale != 1.0 and not residual:
        return f"a residual scale {residual_scale} without a residual"
    return None


@torch.library.custom_op(f"{NS}::moe", mutates_args=("count",))
def moe(h: Tensor, norm_weight: Optional[Tensor], eps: float, router_w: Tensor, gate_up: Tensor, down: Tensor,
        top_k: int, norm_topk: bool, residual: bool, count: Tensor, configs: Optional[list[int]] = None,
        pdl: bool = False, router: str = "softmax", router_bias: Optional[Tensor] = None, n_group: int = 1,
        topk_group: int = 1, scaling: float = 1.0, forced_ids: Optional[Tensor] = None,
        norm_min: float = 0.0, residual_scale: float = 1.0) -> Tensor:
    """``moe_ref`` as three launches (``tkcc.kernels.moe_routed``): the router GEMV with the norm prologue whose
    last program picks the top-k (softmax, renormalisation) once; gate_up over the k selected experts only
    (silu(g) * u); down weighted over them, plus the residual. ``configs``: (BLOCK_N, warps) of router,
    gate_up and down (6 ints), None for the kernels' defaults. ``forced_ids``: see ``moe_ref`` (never in a
    graph a pass writes; ``benchmarks/decode.py`` adds it for its real-routing rows). ``norm_min``: the
    ``softmax_biased`` router's floor under the renormalising sum. ``residual_scale`` (last: graphs written before it
    still load): see ``moe_ref``, in the down kernel's epilogue."""
    reason = moe_reason(h, norm_weight, router_w, gate_up, down, top_k, count, router, router_bias, n_group,
                        topk_group, forced_ids, residual, residual_scale)
    if reason is None:
        from tkcc.kernels import moe_routed as mr

        E, I2, H = gate_up.shape
        dev, dt = h.device, h.dtype
        if configs:
            rc, gc, dc = tuple(configs[0:2]), tuple(configs[2:4]), tuple(configs[4:6])
        else:
            rc, gc, dc = mr.default_configs()
        grouped = (router_bias, n_group, topk_group, scaling) if router == "sigmoid_grouped" else None
        biased = (router_bias, norm_min) if router == "softmax_biased" else None
        logits_dt = torch.float32 if grouped or biased else dt  # DeepSeek's and Ernie's logits are fp32 throughout
        scratch = (torch.empty(E, device=dev, dtype=logits_dt), torch.empty(top_k, device=dev, dtype=torch.int32),
                   torch.empty(top_k, device=dev, dtype=torch.float32), torch.empty(H, device=dev, dtype=dt),
                   torch.empty(top_k, I2 // 2, device=dev, dtype=dt), count)
        x = h.contiguous().view(-1)
        out = torch.empty(H, device=dev, dtype=dt)
        mr.launch(x, router_w, gate_up, down, top_k, norm_topk, x if residual else None, norm_weight, eps, out,
                  scratch, rc, gc, dc, pdl=pdl and _pdl_ok(dev), fp32_weights=router == "softmax_fp32",
                  grouped=grouped, forced_ids=forced_ids, biased=biased, residual_scale=residual_scale)
        return out.view(h.shape)
    note_fallback("tkcc.moe", reason)
    return moe_ref(h, norm_weight, eps, router_w, gate_up, down, top_k, norm_topk, residual, router, router_bias,
                   n_group, topk_group, scaling, forced_ids, norm_min, residual_scale)


@moe.register_fake
def _(h, norm_weight, eps, router_w, gate_up, down, top_k, norm_topk, residual, count, configs=None, pdl=False,
      router="softmax", router_bias=None, n_group=1, topk_group=1, scaling=1.0, forced_ids=None, norm_min=0.0,
      residual_scale=1.0):
    return torch.empty_like(h)


def moe_gptoss_ref(xs: Tensor, router_w: Tensor, router_b: Tensor, gate_up: Tensor, gate_up_b: Tensor, down: Tensor,
                   down_b: Tensor, top_k: int, alpha: float, limit: float,
                   forced_ids: Optional[Tensor] = None) -> Tensor:
    """gpt-oss's MoE block on its flattened input xs [T, H] (``GptOssTopKRouter``, then ``GptOssExperts`` under
    transformers' ``batched_mm``): the router linear with its bias, top-k of the logits, a softmax over the k in the
    dtype; each token's k experts x @ gate_up [E, H, 2I] + bias, gate / up the even / odd columns, gate clamped
    above at ``limit``, up to +-``limit``, (up + 1) * gate * sigmoid(alpha * gate), @ down [E, I, H] + bias, weighted
    and summed. ``forced_ids`` [k] (one token; the benchmark's real-routing hook): those experts instead of the
    top-k, weighted by the softmax over their logits."""
    logits = F.linear(xs, router_w, router_b)
    if forced_ids is None:
        top_value, top_index = torch.topk(logits, top_k, dim=-1)
    else:
        top_index = forced_ids.reshape(1, top_k).long().clamp(0, gate_up.shape[0] - 1)
        top_value = logits.gather(-1, top_index)
    scores = F.softmax(top_value, dim=1, dtype=top_value.dtype)
    ids = top_index.reshape(-1).clamp(0, gate_up.shape[0] - 1)
    gu = torch.bmm(xs.repeat_interleave(top_k, dim=0).unsqueeze(1), gate_up[ids]).squeeze(1) + gate_up_b[ids]
    gate, up = gu[..., ::2].clamp(max=limit), gu[..., 1::2].clamp(min=-limit, max=limit)
    act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    out = (torch.bmm(act.unsqueeze(1), down[ids]).squeeze(1) + down_b[ids]) * scores.reshape(-1, 1)
    return out.view(xs.shape[0], top_k, xs.shape[-1]).sum(dim=1).to(xs.dtype)


def moe_gptoss_reason(xs, router_w, router_b, gate_up, gate_up_b, down, down_b, top_k, count) -> str | None:
    """None when gpt-oss's routed kernels take this call, else why not."""
    reason = fallback_reason(xs, router_w, router_b, gate_up, gate_up_b, down, down_b)
    reason = reason or moe_gptoss_layout(xs, router_w, router_b, gate_up, gate_up_b, down, down_b, top_k)
    if reason is None:
        from tkcc.kernels.moe_gptoss import counters_any

        E, H, I2 = gate_up.shape
        need = counters_any(H, I2 // 2, top_k)
        if count.numel() < need or count.dtype != torch.int32 or not count.is_contiguous():
            reason = f"arrival counters {tuple(count.shape)} {count.dtype}: {need} int32 needed"
    return reason


def moe_gptoss_layout(xs, router_w, router_b, gate_up, gate_up_b, down, down_b, top_k) -> str | None:
    """Why these are not one token of one gpt-oss MoE block the kernels can read (shapes, strides, k), or None."""
    if not _one_token(xs) or xs.dim() != 2:
        return f"xs {tuple(xs.shape)} is not one token [1, H]"
    E, H, I2 = gate_up.shape
    if (tuple(router_w.shape) != (E, H) or router_b.numel() != E or tuple(gate_up_b.shape) != (E, I2)
            or tuple(down.shape) != (E, I2 // 2, H) or tuple(down_b.shape) != (E, H) or I2 % 2):
        return (f"router {tuple(router_w.shape)} / experts {tuple(gate_up.shape)}, {tuple(down.shape)} / biases "
                f"{tuple(router_b.shape)}, {tuple(gate_up_b.shape)}, {tuple(down_b.shape)} are not one gpt-oss MoE")
    if not (gate_up.is_contiguous() and down.is_contiguous() and router_w.stride(-1) == 1
            and router_b.is_contiguous() and gate_up_b.stride(-1) == 1 and down_b.stride(-1) == 1):
        return "experts not contiguous [E, H, 2I] / [E, I, H] (or a bias, or the router's rows, strided)"
    if not 1 <= top_k <= E:
        return f"top-{top_k} of {E} experts"
    return None


@torch.library.custom_op(f"{NS}::moe_gptoss", mutates_args=("count",))
def moe_gptoss(xs: Tensor, router_w: Tensor, router_b: Tensor, gate_up: Tensor, gate_up_b: Tensor, down: Tensor,
               down_b: Tensor, top_k: int, alpha: float, limit: float, count: Tensor,
               configs: Optional[list[int]] = None, pdl: bool = False, forced_ids: Optional[Tensor] = None) -> Tensor:
    """``moe_gptoss_ref`` as three launches (``tkcc.kernels.moe_gptoss``): the router GEMV with its bias whose last
    program picks the top-k and their weights once; gate_up and down over the k chosen experts only, their rows
    split over programs. ``count``: the arrival counters (``moe_gptoss.counters_any`` of them, zero). ``configs``:
    router (BLOCK_N, warps), gate_up and down (BLOCK_N, BLOCK_K, SPLIT, warps): 10 ints, None for the defaults.
    ``forced_ids``: as ``moe_gptoss_ref``'s (int32 [k] for the kernels)."""
    reason = moe_gptoss_reason(xs, router_w, router_b, gate_up, gate_up_b, down, down_b, top_k, count)
    if reason is None:
        from tkcc.kernels import moe_gptoss as mg

        E, H, I2 = gate_up.shape
        dev, dt = xs.device, xs.dtype
        cfg = (tuple(configs[0:2]), tuple(configs[2:6]), tuple(configs[6:10])) if configs else mg.default_configs()
        scratch = (torch.empty(E, device=dev, dtype=dt), torch.empty(top_k, device=dev, dtype=torch.int32),
                   torch.empty(top_k, device=dev, dtype=torch.float32), torch.empty(H, device=dev, dtype=dt),
                   torch.empty(top_k, I2 // 2, device=dev, dtype=dt), count,
                   torch.empty(mg.part_size(H, I2 // 2, top_k, cfg[1], cfg[2]), device=dev, dtype=torch.float32))
        out = torch.empty(H, device=dev, dtype=dt)
        forced = None if forced_ids is None else forced_ids.reshape(-1).to(torch.int32)
        mg.launch(xs.contiguous().view(-1), router_w, router_b.reshape(-1), gate_up, gate_up_b, down, down_b, top_k,
                  alpha, limit, out, scratch, cfg, pdl=pdl and _pdl_ok(dev), forced_ids=forced)
        return out.view(xs.shape)
    note_fallback("tkcc.moe_gptoss", reason)
    return moe_gptoss_ref(xs, router_w, router_b, gate_up, gate_up_b, down, down_b, top_k, alpha, limit, forced_ids)


@moe_gptoss.register_fake
def _(xs, router_w, router_b, gate_up, gate_up_b, down, down_b, top_k, alpha, limit, count, configs=None, pdl=False,
      forced_ids=None):
    return torch.empty_like(xs)


@torch.library.custom_op(f"{NS}::gemv_gather", mutates_args=())
def gemv_gather(table: Tensor, ids: Tensor, weight: Tensor, norm_weight: Optional[Tensor] = None, eps: float = 1e-6,
                config: Optional[list[int]] = None, pdl: bool = False,
                bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The step's first GEMV reading its input from the embedding table: (gemv(e), e) with
    e = embedding(table, ids) — the token's row is gathered inside the GEMV (program 0 also writes it out:
    the residual stream), so the step has no separate embedding launch."""
    reason = None if ids.numel() == 1 else f"ids {tuple(ids.shape)} are not one token"
    reason = reason or gemv_reason(table[0].view(1, 1, -1), weight, bias, norm_weight, None, "")
    if reason is None and (table.dim() != 2 or table.stride(-1) != 1 or ids.dtype != torch.int64):
        reason = f"table {tuple(table.shape)} strides {table.stride()} / ids {ids.dtype}"
    if reason is None:
        from tkcc.kernels import gemv as gemv_mod

        cfg = tuple(config) if config else None  # None: the kernel's default
        e = torch.empty(table.shape[1], device=table.device, dtype=table.dtype)
        y = gemv_mod.gemv(table, weight, norm_w=norm_weight, eps=eps, config=cfg, pdl=pdl and _pdl_ok(table.device),
                          gather=(ids.reshape(1), e), bias=bias)
        shape = tuple(ids.shape)
        return y.view(*shape, y.shape[-1]), e.view(*shape, e.shape[-1])
    note_fallback("tkcc.gemv_gather", reason)
    e = F.embedding(ids, table)
    return gemv_ref(e, weight, bias, norm_weight, eps), e


@gemv_gather.register_fake
def _(table, ids, weight, norm_weight=None, eps=1e-6, config=None, pdl=False, bias=None):
    return (table.new_empty(*ids.shape, weight.shape[0]), table.new_empty(*ids.shape, table.shape[1]))


# ops whose kernels live in their own modules (registered with the rest: an artifact imports only this module)
from tkcc.kernels import causal_conv as _causal_conv  # noqa: E402,F401
from tkcc.kernels import gated_delta as _gated_delta  # noqa: E402,F401
from tkcc.kernels import linear_attention as _linear_attention  # noqa: E402,F401
from tkcc.kernels import lowered_mla  # noqa: E402,F401 - registers tkcc.mla_attention (DeepSeek's latent attention)
