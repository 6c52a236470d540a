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
  is not the same as scaling the scores.

``CANONICAL``: BLOOM's per-head [q_h | k_h | v_h] projection viewed ``(B, T, H, 3, D)`` and selected along the 3
is GPT-NeoX's ``view(B, T, -1, 3 D).transpose(1, 2).chunk(3, -1)`` (the same views), which ``projections``' per-head
GEMV (``split_heads``) takes and stores as [q | k | v].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tkcc.passes.lower.attention import SCALE, _layout_params, qk_heads, repeat_kv, step_mask, token_and_caches
from tkcc.passes.lower.norms import EPS
from tkcc.passes.lower.pattern import Rewrite

Q_SCALE = 0.4375  # sentinels
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


# ---- a per-head q|k|v selected out of a (B, T, H, 3, D) view -----------------------------------------------

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
