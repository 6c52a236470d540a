"""Cache write + attention: the causal mask of a step, then each layer's attention block as one fused op.

``causal_mask``: transformers' ``sdpa_mask`` for a query at ``cache_position`` over the whole static cache
(``kv_idx <= q_idx``), named ``tkcc.causal_mask`` (same arithmetic, bit-exact) so that the attention rewrite
knows what the mask says without reading it.

``attention``: one layer's block from its packed projection to the o-proj's input, as Llama/OLMoE/Mistral
write it: split q | k | v, [q/k RMSNorm over the whole projection (OLMoE)], heads, rotary with the step's
cos/sin table, ``index_copy_`` of k and v into the static cache at ``cache_position``, ``repeat_kv`` for
grouped-query heads (MHA: none; GQA, MQA: the expand), sdpa under the causal mask, heads back. It becomes
``tkcc.attention_rope``: one launch per layer that normalises, rotates (cos/sin from ``inv_freq`` and the
position, on the device), writes the cache, attends over positions [0, pos] only (no mask read, no
``repeat_kv`` copy) split over the cache, and merges the splits. The rewrite checks what the kernel
assumes and refuses the match otherwise (the region stays in aten, with the reason logged): the mask is
the causal mask of the same positions over the whole cache, the rotation is the step's table from those
positions, the caches are [1, Hkv, S, D] buffers of the graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tkcc.passes.lower.norms import EPS, rms_norm
from tkcc.passes.lower.pattern import Refused, Rewrite

KV_LEN = 77        # sentinels
SCALE = 0.3125


# ---- the causal mask -------------------------------------------------------------------------------------

def _mask_indices(cache_position, kv_len):
    """(query positions [1, 1, T, 1], key positions [1, 1, 1, kv_len]) as ``sdpa_mask`` builds them."""
    dev = cache_position.device
    q_offset = cache_position[0].to(dev)
    q_arange = torch.arange(cache_position.shape[0], device=dev) + q_offset
    kv_arange = torch.arange(kv_len, device=dev) + 0
    q_idx = q_arange[None, None, :, None]
    kv_idx = kv_arange[None, None, None, :]
    return q_idx, kv_idx


def causal_mask(cache_position, *, kv_len):
    """``sdpa_mask(mask_function=causal_mask_function)`` for queries at ``cache_position``, no padding."""
    q_idx, kv_idx = _mask_indices(cache_position, kv_len)
    return (kv_idx <= q_idx).expand(1, -1, cache_position.shape[0], kv_len)


def sliding_mask(cache_position, *, kv_len, window):
    """``sdpa_mask(mask_function=sliding_window_causal_mask_function(window))``: ``and_masks`` of the window
    overlay (``kv_idx > q_idx - window``) and the causal mask."""
    q_idx, kv_idx = _mask_indices(cache_position, kv_len)
    result = q_idx.new_ones((), dtype=torch.bool)
    result = result & (kv_idx > q_idx - window).to(result.device)
    result = result & (kv_idx <= q_idx).to(result.device)
    return result.expand(1, -1, cache_position.shape[0], kv_len)


def _to_mask(cache_position, *, kv_len):
    return torch.ops.tkcc.causal_mask(cache_position, kv_len, 0)


def _to_sliding(cache_position, *, kv_len, window):
    return torch.ops.tkcc.causal_mask(cache_position, kv_len, window)


WINDOW = 5  # sentinel


def _mask_check(m):
    if m.val(0).dim() != 1:
        return f"positions of shape {tuple(m.val(0).shape)}"
    if m.scalars.get("window", 1) < 1:
        return f"sliding window {m.scalars['window']}"
    return None


MASKS = [
    Rewrite("sliding_window_mask", sliding_mask, _to_sliding,
            lambda dt: ((torch.empty(1, dtype=torch.int64),), {"kv_len": KV_LEN, "window": WINDOW}),
            region="attention", exact=True, check=_mask_check),
    Rewrite("causal_mask", causal_mask, _to_mask, lambda dt: ((torch.empty(1, dtype=torch.int64),), {"kv_len": KV_LEN}),
            region="attention", exact=True, check=_mask_check),
]


# ---- the attention block ---------------------------------------------------------------------------------

def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def rope_half(q, k, cos, sin):
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _attention_pattern(qk_norm: str, rope=rope_half):
    """``qk_norm``: "" (none), "full" (OLMoE: over the whole projection), "head" (Qwen3: over each head);
    ``rope(q, k, cos, sin) -> (q, k)``: the rotation (``rotary.py`` has the partial and interleaved ones)."""

    def pattern(qkv, k_cache, v_cache, cache_position, cos, sin, mask, *norms, scale, **kw):
        B, T = qkv.shape[0], qkv.shape[1]
        hkv, D = k_cache.shape[1], k_cache.shape[3]
        hq = qkv.shape[-1] // D - 2 * hkv
        q, k, v = torch.split(qkv, [hq * D, hkv * D, hkv * D], -1)
        if qk_norm == "full":
            q = rms_norm(q, norms[0], eps=kw["eps"])
            k = rms_norm(k, norms[1], eps=kw["eps"])
        hidden_shape = (B, T, -1, D)
        if qk_norm == "head":
            q = rms_norm(q.view(hidden_shape), norms[0], eps=kw["eps"]).transpose(1, 2)
            k = rms_norm(k.view(hidden_shape), norms[1], eps=kw["eps"]).transpose(1, 2)
        else:
            q = q.view(hidden_shape).transpose(1, 2)
            k = k.view(hidden_shape).transpose(1, 2)
        v = v.view(hidden_shape).transpose(1, 2)
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        q, k = rope(q, k, cos, sin)
        keys = k_cache.index_copy_(2, cache_position, k)
        values = v_cache.index_copy_(2, cache_position, v)
        keys = repeat_kv(keys, hq // hkv)
        values = repeat_kv(values, hq // hkv)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=0.0, scale=scale,
                                           is_causal=False)
        o = o.transpose(1, 2).contiguous()
        return o.reshape(B, T, -1)

    def replacement(qkv, k_cache, v_cache, cache_position, cos, sin, mask, *norms, scale, inv_freq, count,
                    rope_scale, num_heads, window, chunk, block_s, num_warps, pdl, **kw):
        qn, kn = (norms[0], norms[1]) if qk_norm else (None, None)
        return torch.ops.tkcc.attention_rope(qkv, k_cache, v_cache, cache_position, inv_freq, rope_scale, qn, kn,
                                             kw.get("eps", 1e-6), scale, num_heads, window, chunk, block_s,
                                             num_warps, count, pdl, qk_norm == "head", kw.get("rotary_dim", 0),
                                             kw.get("interleaved", False))

    return pattern, replacement


def _example(qk_norm: str, hq: int, hkv: int):
    D, S = 16, 40

    def example(dt):
        ts = [torch.empty(1, 1, (hq + 2 * hkv) * D, dtype=dt), torch.empty(1, hkv, S, D, dtype=dt),
              torch.empty(1, hkv, S, D, dtype=dt), torch.empty(1, dtype=torch.int64),
              torch.empty(1, 1, D, dtype=dt), torch.empty(1, 1, D, dtype=dt), torch.empty(1, 1, 1, S, dtype=torch.bool)]
        if qk_norm == "full":
            ts += [torch.empty(hq * D, dtype=dt), torch.empty(hkv * D, dtype=dt)]
        elif qk_norm == "head":
            ts += [torch.empty(D, dtype=dt), torch.empty(D, dtype=dt)]
        return tuple(ts), ({"scale": SCALE, "eps": EPS} if qk_norm else {"scale": SCALE})

    return example


def _producer(node, target):
    return node if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target else None


def _getitem_of(node, target, index):
    """The call ``node`` is output ``index`` of, when that call is ``target``."""
    import operator

    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem \
            and node.args[1] == index:
        return _producer(node.args[0], target)
    return None


def _is_positions_of(pos_ids, cache_position) -> bool:
    """``pos_ids`` is ``cache_position.unsqueeze(0)`` (how the step feeds positions to the rotary)."""
    return (isinstance(pos_ids, torch.fx.Node) and pos_ids.op == "call_function"
            and pos_ids.target == torch.ops.aten.unsqueeze.default and pos_ids.args[0] is cache_position
            and pos_ids.args[1] == 0)


def _check(m) -> str | None:
    qkv, kc, vc, pos = m.val(0), m.val(1), m.val(2), m.val(3)
    if qkv.shape[0] != 1 or qkv.shape[1] != 1:
        return f"qkv {tuple(qkv.shape)} is not one token of one sequence (the fused attention is batch-1 decode)"
    if kc.dim() != 4 or tuple(kc.shape) != tuple(vc.shape) or kc.dtype != qkv.dtype:
        return f"caches {tuple(kc.shape)} / {tuple(vc.shape)} {kc.dtype} are not one [B, Hkv, S, D] layout"
    if m.tensor(1) is None or m.tensor(2) is None:
        return "the caches are not buffers of the graph"
    return step_mask_and_rotary(m, pos=3, cos=4, sin=5, mask=6, kv_len=kc.shape[2])


def step_mask_and_rotary(m, *, pos: int, cos: int, sin: int, mask: int, kv_len: int, whole: bool = False):
    """Why a matched region's mask and rotary table are not the step's own, or None: the mask is the step's
    causal mask over the ``kv_len``-position cache at the cache positions (``whole``: with no window), and
    cos/sin are one ``rotary_cos_sin`` at those positions. Arguments are the region's input indices."""
    causal = _producer(m.inputs[mask], torch.ops.tkcc.causal_mask.default)
    if causal is None:
        return "the attention mask is not the step's causal mask (padding, a custom mask)"
    if causal.args[0] is not m.inputs[pos] or causal.args[1] != kv_len or (
            whole and len(causal.args) > 2 and causal.args[2]):
        return f"the causal mask is not over the {'whole ' if whole else ''}cache at these positions"
    rot = _getitem_of(m.inputs[cos], torch.ops.tkcc.rotary_cos_sin.default, 0)
    if rot is None or _getitem_of(m.inputs[sin], torch.ops.tkcc.rotary_cos_sin.default, 1) is not rot:
        return "cos/sin are not the step's rotary table"
    if not _is_positions_of(rot.args[1], m.inputs[pos]):
        return "the rotary positions are not the cache positions"
    return None


def _params(m, ctx):
    kc = m.val(1)
    hkv, S, D = kc.shape[1], kc.shape[2], kc.shape[3]
    hq = m.val(0).shape[-1] // D - 2 * hkv
    rot = m.inputs[4].args[0]
    mask = m.inputs[6]
    chunk, (block_s, num_warps) = ctx.options["attention_layout"](hq, hkv, D, S)
    if block_s is None:
        raise Refused("no attention tile fits the device")
    count = ctx.tensor("count", torch.zeros(max(hkv, 1), dtype=torch.int32, device=kc.device),
                       share_key=("count", hkv, str(kc.device)))
    return {"inv_freq": rot.args[0], "count": count, "rope_scale": float(rot.args[2]), "num_heads": int(hq),
            "window": int(mask.args[2]) if len(mask.args) > 2 else 0, "chunk": int(chunk), "block_s": int(block_s),
            "num_warps": int(num_warps), "pdl": bool(ctx.options.get("pdl"))}


def _attention_rewrites():
    out = []
    for qk_norm in ("full", "head", ""):
        pattern, replacement = _attention_pattern(qk_norm)
        for kind, (hq, hkv) in (("gqa", (4, 2)), ("mha", (4, 4))):
            name = f"attention[{kind}{'+' + qk_norm + '_qk_norm' if qk_norm else ''}]"
            out.append(Rewrite(name, pattern, replacement, _example(qk_norm, hq, hkv), region="attention",
                               check=_check, params=_params))
    return out


ATTENTION = _attention_rewrites()
