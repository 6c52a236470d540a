"""Attention blocks with no rotation: positions learned and added to the embedding (GPT-2, GPT-BigCode) or none at
all (the NoPE layers of SmolLM3 and Llama 4). Each becomes the same fused ``tkcc.attention_rope`` as a rotary
block (``attention.py``), given no frequencies (``inv_freq`` None): the cache write, then attention over
positions [0, pos] under the step's causal mask, with nothing rotated.

The forms, as each model's code splits its packed projection into heads:

- ``split``: ``torch.split(qkv, [Hq D, Hkv D, Hkv D], -1)``, heads by ``view(B, T, -1, D)``, ``repeat_kv`` (a
  Llama-style layer whose rotation is switched off), with or without q/k RMSNorms over each head, before the heads
  are transposed (Qwen3's form) or after (EXAONE 4's global layers);
- ``even``: GPT-2's ``qkv.split(E, dim=2)`` into three equal parts (multi-head);
- ``unsqueezed``: GPT-BigCode's multi-query ``qkv.unsqueeze(1).split((E, D, D), dim=3)``: the one key and value
  head already [B, 1, T, D], ``repeat_kv`` over the query heads;
- ``q_scaled``: OPT's ``q_proj(x) * scaling`` before the heads (``view(B, -1, H, D)``), then sdpa at scale 1. The
  kernel scales q and rounds it to the activations' dtype before the dot, as eager does (``q_scale``): in bf16 that
  is not the same as scaling the scores;
- ``alibi``: BLOOM's ALiBi attention (the Llama split of a [q | k | v] projection, multi-head), its scores
  ``baddbmm(alibi, q, k^T, beta, alpha)`` over the heads plus the additive causal mask, an fp32 softmax, ``bmm``
  with the values. The bias is a constant of the step (slope h times key position j over the whole cache, built from
  the all-ones mask ``tkcc.frontend.hf.mask_sized_by_the_cache`` gives such a model): the rewrite evaluates it and
  reads the per-head slopes off the graph's own computation (``alibi_slopes``), so the kernel adds slope_h * j
  itself (``attention_rope``'s ``alibi_slopes``) and the bias tensor goes.

``CANONICAL``: BLOOM's per-head [q_h | k_h | v_h] projection viewed ``(B, T, H, 3, D)`` and selected along the 3
is GPT-NeoX's ``view(B, T, -1, 3 D).transpose(1, 2).chunk(3, -1)`` (the same views), which ``projections``' per-head
GEMV (``split_heads``) takes and stores as [q | k | v].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tkcc.passes.lower.attention import SCALE, _layout_params, qk_heads, repeat_kv, step_mask, token_and_caches
from tkcc.passes.lower.norms import EPS
from tkcc.passes.lower.pattern import Refused, Rewrite

Q_SCALE = 0.4375  # sentinels
BETA = 0.8125
HEADS, HEAD_DIM = 5, 17


def _heads(x, B, T, D):
    return x.view(B, T, -1, D).transpose(1, 2)


def _pattern(form: str, qk_norm: str = ""):
    def pattern(qkv, k_cache, v_cache, cache_position, mask, *norms, scale, **kw):
        B, T = qkv.shape[0], qkv.shape[1]
        hkv, D = k_cache.shape[1], k_cache.shape[3]
        if form == "even":
            q, k, v = qkv.split(qkv.shape[-1] // 3, dim=2)
            q, k, v = _heads(q, B, T, D), _heads(k, B, T, D), _heads(v, B, T, D)
        elif form == "unsqueezed":
            q, k, v = qkv.unsqueeze(1).split((qkv.shape[-1] - 2 * D, D, D), dim=3)
            q = _heads(q, B, T, D)
        elif form == "q_scaled":
            hq = qkv.shape[-1] // D - 2 * hkv
            q, k, v = torch.split(qkv, [hq * D, hkv * D, hkv * D], -1)
            q = q * kw["q_scale"]
            q, k, v = (x.view(B, -1, h, D).transpose(1, 2) for x, h in ((q, hq), (k, hkv), (v, hkv)))
        else:
            hq = qkv.shape[-1] // D - 2 * hkv
            q, k, v = torch.split(qkv, [hq * D, hkv * D, hkv * D], -1)
            q, k = qk_heads(q, k, B, T, D, qk_norm, norms, kw)
            v = _heads(v, B, T, D)
        keys = k_cache.index_copy_(2, cache_position, k)
        values = v_cache.index_copy_(2, cache_position, v)
        n_rep = q.shape[1] // hkv
        o = F.scaled_dot_product_attention(q, repeat_kv(keys, n_rep), repeat_kv(values, n_rep), attn_mask=mask,
                                           dropout_p=0.0, scale=scale, is_causal=False)
        return o.transpose(1, 2).reshape(B, T, -1)

    return pattern


def _replacement(qkv, k_cache, v_cache, cache_position, mask, *norms, scale, count, num_heads, window, chunk, block_s,
                 num_warps, pdl, **kw):
    qn, kn = norms if norms else (None, None)
    return torch.ops.tkcc.attention_rope(qkv, k_cache, v_cache, cache_position, None, 1.0, qn, kn, kw.get("eps", 1e-6),
                                         scale, num_heads, window, chunk, block_s, num_warps, count, pdl, bool(norms),
                                         **({"q_scale": kw["q_scale"]} if "q_scale" in kw else {}))


def _example(hq: int, hkv: int, qk_norm: str = "", q_scaled: bool = False):
    D, S = 16, 40

    def example(dt):
        ts = (torch.empty(1, 1, (hq + 2 * hkv) * D, dtype=dt), torch.empty(1, hkv, S, D, dtype=dt),
              torch.empty(1, hkv, S, D, dtype=dt), torch.empty(1, dtype=torch.int64),
              torch.empty(1, 1, 1, S, dtype=torch.bool))
        if qk_norm:
            return ts + (torch.empty(D, dtype=dt), torch.empty(D, dtype=dt)), {"scale": SCALE, "eps": EPS}
        return ts, {"scale": SCALE, **({"q_scale": Q_SCALE} if q_scaled else {})}

    return example


def _check(m) -> str | None:
    why = token_and_caches(m)
    if why:
        return why
    kc = m.val(1)
    norms = [m.val(i) for i in range(5, len(m.inputs))]
    if any(tuple(n.shape) != (kc.shape[3],) for n in norms):
        return f"q/k norm weights {[tuple(n.shape) for n in norms]} for heads of {kc.shape[3]}"
    return step_mask(m, pos=3, mask=4, kv_len=kc.shape[2])


def _params(m, ctx):
    return _layout_params(m, ctx, mask=4)


REWRITES = [Rewrite(f"attention[{name}{'+' + qk_norm + '_qk_norm' if qk_norm else ''}, no rotary]",
                    _pattern(form, qk_norm), _replacement, _example(hq, hkv, qk_norm, form == "q_scaled"),
                    region="attention", check=_check, params=_params)
            for name, form, (hq, hkv), qk_norm in (
                ("gqa", "split", (4, 2), "head"), ("mha", "split", (4, 4), "head"),
                ("gqa", "split", (4, 2), "head_transposed"), ("mha", "split", (4, 4), "head_transposed"),
                ("gqa", "split", (4, 2), ""), ("mha", "split", (4, 4), ""), ("mha, split evenly", "even", (4, 4), ""),
                ("mqa, unsqueezed", "unsqueezed", (4, 1), ""), ("mha, q scaled", "q_scaled", (4, 4), ""))]


# ---- ALiBi (BLOOM) ---------------------------------------------------------------------------------------------

def alibi_attention(qkv, k_cache, v_cache, cache_position, mask, alibi, *, scale, beta):
    """``BloomAttention.forward`` from its heads (split as the per-head GEMV stores them): the cache writes, the
    scores ``beta * alibi + scale * q k^T`` by ``baddbmm`` over the B H heads, the additive mask, softmax in fp32
    rounded back, ``bmm`` with the values, heads merged."""
    B, T = qkv.shape[0], qkv.shape[1]
    H, D = k_cache.shape[1], k_cache.shape[3]
    q, k, v = torch.split(qkv, [H * D, H * D, H * D], -1)
    q, k, v = _heads(q, B, T, D), _heads(k, B, T, D), _heads(v, B, T, D)
    keys = k_cache.index_copy_(2, cache_position, k)
    values = v_cache.index_copy_(2, cache_position, v)
    q = q.reshape(B * H, -1, D)
    keys = keys.reshape(B * H, -1, D).transpose(-1, -2)
    values = values.reshape(B * H, -1, D)
    scores = alibi.baddbmm(batch1=q, batch2=keys, beta=beta, alpha=scale)
    w = scores.view(B, H, T, -1) + mask
    p = F.softmax(w, dim=-1, dtype=torch.float32).to(values.dtype)
    o = torch.bmm(p.view(B * H, T, -1), values)
    return o.view(B, H, T, D).permute(0, 2, 1, 3).reshape(B, T, H * D)


def _alibi_replacement(qkv, k_cache, v_cache, cache_position, mask, alibi, *, scale, beta, slopes, count, num_heads,
                       window, chunk, block_s, num_warps, pdl):
    return torch.ops.tkcc.attention_rope(qkv, k_cache, v_cache, cache_position, None, 1.0, None, None, 1e-6, scale,
                                         num_heads, window, chunk, block_s, num_warps, count, pdl,
                                         alibi_slopes=slopes, alibi_beta=beta)


def _alibi_example(dt):
    H, D, S = 4, 16, 40
    return ((torch.empty(1, 1, 3 * H * D, dtype=dt), torch.empty(1, H, S, D, dtype=dt),
             torch.empty(1, H, S, D, dtype=dt), torch.empty(1, dtype=torch.int64), torch.empty(1, 1, 1, S, dtype=dt),
             torch.empty(H, 1, S, dtype=dt)), {"scale": SCALE, "beta": BETA})


def _alibi_check(m) -> str | None:
    why = token_and_caches(m)
    if why:
        return why
    kc, a = m.val(1), m.val(5)
    H, S = kc.shape[1], kc.shape[2]
    if tuple(a.shape) != (H, 1, S):
        return f"the ALiBi bias {tuple(a.shape)} is not one row per head over the {S}-position cache"
    return step_mask(m, pos=3, mask=4, kv_len=S)


class _NotConstant(Exception):
    pass


def _evaluate(node, gm, memo: dict, budget: list):
    """The value of ``node`` when the step computes it from constants alone (no input, nothing the step writes,
    nothing random), evaluated now; raises ``_NotConstant`` otherwise."""
    if isinstance(node, (list, tuple)):
        return type(node)(_evaluate(x, gm, memo, budget) for x in node)
    if not isinstance(node, torch.fx.Node):
        return node
    if node in memo:
        return memo[node]
    budget[0] -= 1
    if budget[0] < 0:
        raise _NotConstant("more than 64 ops")
    if node.op == "get_attr":
        if any(isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable for u in node.users):
            raise _NotConstant(f"{node.target} is written by the step")
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
    elif node.op == "call_function" and node.target is torch.ops.aten.detach_.default:
        value = _evaluate(node.args[0], gm, memo, budget)  # (a lifted constant's: changes no value)
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and not node.target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in node.target.tags:
        args = _evaluate(list(node.args), gm, memo, budget)
        kwargs = {k: _evaluate(v, gm, memo, budget) for k, v in node.kwargs.items()}
        value = node.target(*args, **kwargs)
    else:
        raise _NotConstant(f"{node.name} ({node.op} {node.target}) is not a constant of the step")
    memo[node] = value
    return value


def alibi_slopes(node, gm) -> torch.Tensor:
    """The fp32 per-head slopes s of an ALiBi bias ``node`` [H, 1, S] that the step computes from constants:
    ``node`` is exactly ``(s[:, None] * j).to(dtype)`` over key positions j = 0 .. S - 1 (BLOOM's
    ``build_alibi_tensor`` over the all-ones mask). The slopes are a tensor of H elements among the ops that compute
    the bias (its ``pow`` of the base, or the ``cat`` of two), checked by recomputing the whole bias bit for bit from
    them as the kernel does; a bias of any other form (MPT's positions relative to the last, a padded mask) refuses
    the region with a reason."""
    memo: dict = {}
    try:
        bias = _evaluate(node, gm, memo, [64])
    except _NotConstant as e:
        raise Refused(f"the ALiBi bias is not a constant of the step: {e}") from None
    if not isinstance(bias, torch.Tensor) or bias.dim() != 3 or bias.shape[1] != 1:
        raise Refused("the ALiBi bias is not [H, 1, S]")
    H, S = bias.shape[0], bias.shape[2]
    pos = torch.arange(S, dtype=torch.float32, device=bias.device)
    candidates = [v for v in reversed(list(memo.values()))
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == H]
    if bias.dtype == torch.float32 and S > 1:
        candidates.append(bias[:, 0, 1])
    for c in candidates:
        s = c.detach().reshape(H).to(torch.float32)
        if torch.equal((s[:, None] * pos).to(bias.dtype).reshape(bias.shape), bias):
            return s.contiguous()
    raise Refused("the ALiBi bias is not slope[h] * j over the cache's positions j = 0 .. S - 1 for any per-head "
                  "slopes the step computes")


def _alibi_params(m, ctx):
    slopes = alibi_slopes(m.inputs[5], m.gm)
    node = ctx.tensor("alibi_slopes", slopes.to(m.val(1).device), share_key=("alibi_slopes", m.inputs[5]))
    return {**_layout_params(m, ctx, mask=4), "slopes": node}


ALIBI = [Rewrite("attention[mha, alibi, no rotary]", alibi_attention, _alibi_replacement, _alibi_example,
                 region="attention", check=_alibi_check, params=_alibi_params)]
REWRITES += ALIBI


def per_head_qkv_select(y, *, heads, head_dim):
    """BLOOM's ``_reshape``: a fused projection whose rows are per-head [q_h | k_h | v_h] blocks, viewed
    (B, T, H, 3, D) and each of q, k, v selected along the 3."""
    f = y.view(y.shape[0], y.shape[1], heads, 3, head_dim)
    return f[..., 0, :].transpose(1, 2), f[..., 1, :].transpose(1, 2), f[..., 2, :].transpose(1, 2)


def _per_head_qkv_chunk(y, *, heads, head_dim):
    """The same views as GPT-NeoX spells them (``projections._per_head_qkv``'s pattern)."""
    return y.view(y.shape[0], y.shape[1], -1, 3 * head_dim).transpose(1, 2).chunk(3, dim=-1)


def _per_head_check(m) -> str | None:
    y, h, d = m.val(0), m.scalars["heads"], m.scalars["head_dim"]
    if y.dim() != 3 or y.shape[-1] != 3 * h * d:
        return f"{tuple(y.shape)} is not {h} heads of [q | k | v] rows of {d}"
    return None


CANONICAL = [Rewrite("canonical_qkv_per_head[view (B, T, H, 3, D), select]", per_head_qkv_select, _per_head_qkv_chunk,
                     lambda dt: ((torch.empty(1, 1, 3 * HEADS * HEAD_DIM, dtype=dt),),
                                 {"heads": HEADS, "head_dim": HEAD_DIM}),
                     region="projection", exact=True, check=_per_head_check)]
