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

from tkcc.passes.lower.norms import EPS, OFFSET, rms_norm, rms_norm_offset, rms_norm_weight_fp32
from tkcc.passes.lower.pattern import Refused, Rewrite, _all_args

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


def additive_mask(mask, zero, *, mn):
    """transformers' ``eager_mask``: the boolean mask as 0 / the dtype's minimum (``torch.where(mask,
    torch.tensor(0.0, ...), min_dtype)``; capture lifts the 0 into a constant of the graph, copied each step)."""
    return torch.where(mask, torch.ops.aten.lift_fresh_copy(zero).detach_(), mn)


def _to_additive(mask, zero, *, mn):
    """The same without the copied constant (so that nothing is left of the mask once every attention is fused)."""
    return torch.where(mask, mask.new_zeros((), dtype=zero.dtype), mn)


def _additive_check(m):
    z = m.tensor(1)
    if z is None or z.numel() != 1 or float(z.reshape(())) != 0.0:
        return "the additive mask keeps a value that is not the constant 0"
    return None


MASK_MIN = -1.25e30  # sentinel

MASKS = [
    Rewrite("sliding_window_mask", sliding_mask, _to_sliding,
            lambda dt: ((torch.empty(1, dtype=torch.int64),), {"kv_len": KV_LEN, "window": WINDOW}),
            region="attention", exact=True, check=_mask_check),
    Rewrite("causal_mask", causal_mask, _to_mask, lambda dt: ((torch.empty(1, dtype=torch.int64),), {"kv_len": KV_LEN}),
            region="attention", exact=True, check=_mask_check),
    Rewrite("additive_mask", additive_mask, _to_additive,
            lambda dt: ((torch.empty(1, 1, 1, KV_LEN, dtype=torch.bool), torch.empty((), dtype=dt)), {"mn": MASK_MIN}),
            region="attention", exact=True, check=_additive_check),
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


def sink_attention(q, keys, values, mask, sinks, *, scale):
    """gpt-oss's (and MiMo-V2's) ``eager_attention_forward`` with per-head sink logits: scores plus the additive mask,
    the head's sink as one more column, max-subtracted softmax in the scores' dtype, the sink's column dropped."""
    w = torch.matmul(q, keys.transpose(2, 3)) * scale
    w = w + mask
    sk = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    logits = torch.cat([w, sk], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)
    scores = probs[..., :-1]
    scores = F.dropout(scores, p=0.0, training=False).to(values.dtype)
    return torch.matmul(scores, values)


# q/k norms over each head (the kernel's per-head norm)
PER_HEAD = ("head", "head_transposed", "head_offset", "head_offset_view")
NORM_FP32 = ("head_offset", "head_offset_view", "full_fp32")  # norm(x) * (offset + w) in fp32, rounded once


def qk_heads(q, k, B, T, D, qk_norm: str, norms, kw, counts=None):
    """q and k of a packed projection's split as [B, H, T, D] heads, normed as ``qk_norm`` says (see
    ``_attention_pattern``; ``kw``: the pattern's ``eps`` and ``offset``); ``counts``: (Hq, Hkv) when the model views
    the heads by their counts rather than ``view(B, T, -1, D)``."""
    if qk_norm == "full":
        q = rms_norm(q, norms[0], eps=kw["eps"])
        k = rms_norm(k, norms[1], eps=kw["eps"])
    elif qk_norm == "full_fp32":
        q = rms_norm_weight_fp32(q, norms[0], eps=kw["eps"])
        k = rms_norm_weight_fp32(k, norms[1], eps=kw["eps"])
    hidden_shape = (B, T, -1, D)
    if qk_norm == "head":
        q = rms_norm(q.view(hidden_shape), norms[0], eps=kw["eps"]).transpose(1, 2)
        k = rms_norm(k.view(hidden_shape), norms[1], eps=kw["eps"]).transpose(1, 2)
    elif qk_norm == "head_transposed":
        q = rms_norm(q.view(hidden_shape).transpose(1, 2), norms[0], eps=kw["eps"])
        k = rms_norm(k.view(hidden_shape).transpose(1, 2), norms[1], eps=kw["eps"])
    elif qk_norm == "head_offset":
        q = rms_norm_offset(q.view(hidden_shape).transpose(1, 2), norms[0], eps=kw["eps"], offset=kw["offset"])
        k = rms_norm_offset(k.view(hidden_shape).transpose(1, 2), norms[1], eps=kw["eps"], offset=kw["offset"])
    elif qk_norm == "head_offset_view":
        q = rms_norm_offset(q.view(hidden_shape), norms[0], eps=kw["eps"], offset=kw["offset"]).transpose(1, 2)
        k = rms_norm_offset(k.view(hidden_shape), norms[1], eps=kw["eps"], offset=kw["offset"]).transpose(1, 2)
    elif counts is not None:
        q = q.view(B, T, counts[0], D).transpose(1, 2)
        k = k.view(B, T, counts[1], D).transpose(1, 2)
    else:
        q = q.view(hidden_shape).transpose(1, 2)
        k = k.view(hidden_shape).transpose(1, 2)
    return q, k


def _attention_pattern(qk_norm: str, rope=rope_half, sinks: bool = False, explicit_heads: bool = False,
                       gated: bool = False):
    """``qk_norm``: "" (none), "full" (OLMoE: over the whole projection), "full_fp32" (OLMo 2: the same, the weight
    times the fp32 normed x, rounded once), "head" (Qwen3: over each head),
    "head_transposed" (EXAONE 4: the same RMSNorm over each head, once the heads are transposed),
    "head_offset" (Gemma 3: over each head once the heads are transposed, ``norm(x) * (offset + w)`` in fp32),
    "head_offset_view" (Qwen3-Next: that norm over each head before they are transposed);
    ``rope(q, k, cos, sin) -> (q, k)``: the rotation (``rotary.py`` has the partial, interleaved and chunked ones);
    ``sinks``: the eager attention with per-head sink logits (``sink_attention``; the logits are the last tensor,
    the mask is additive), else sdpa under the boolean mask; ``explicit_heads``: q, k and v viewed as heads by their
    counts (StableLM's ``view(bsz, q_len, self.num_heads, self.head_dim)``), not ``view(B, T, -1, D)``; ``gated``
    (Qwen3-Next's gated attention): each q head of the projection followed by its gate, [q_0 | g_0 | ... | k | v],
    chunked apart, the output times ``sigmoid(gate)`` (the op reads q in place; the gate's product stays in aten)."""

    def pattern(qkv, k_cache, v_cache, cache_position, cos, sin, mask, *extra, scale, **kw):
        norms = extra
        B, T = qkv.shape[0], qkv.shape[1]
        hkv, D = k_cache.shape[1], k_cache.shape[3]
        hq = (qkv.shape[-1] // D - 2 * hkv) // (2 if gated else 1)
        q, k, v = torch.split(qkv, [hq * D * (2 if gated else 1), hkv * D, hkv * D], -1)
        if gated:
            q, gate = torch.chunk(q.view(B, T, -1, 2 * D), 2, dim=-1)
            gate = gate.reshape(B, T, -1)
        q, k = qk_heads(q, k, B, T, D, qk_norm, norms, kw, (hq, hkv) if explicit_heads else None)
        v = v.view(B, T, hkv, D).transpose(1, 2) if explicit_heads else v.view(B, T, -1, D).transpose(1, 2)
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        q, k = rope(q, k, cos, sin)
        keys = k_cache.index_copy_(2, cache_position, k)
        values = v_cache.index_copy_(2, cache_position, v)
        keys = repeat_kv(keys, hq // hkv)
        values = repeat_kv(values, hq // hkv)
        if sinks:
            o = sink_attention(q, keys, values, mask, extra[-1], scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=0.0, scale=scale,
                                               is_causal=False)
        o = o.transpose(1, 2).contiguous()
        o = o.reshape(B, T, -1)
        return o * torch.sigmoid(gate) if gated else o

    def replacement(qkv, k_cache, v_cache, cache_position, cos, sin, mask, *extra, scale, inv_freq, count,
                    rope_scale, num_heads, window, chunk, block_s, num_warps, pdl, **kw):
        qn, kn = (extra[0], extra[1]) if qk_norm else (None, None)
        fp32_norm = qk_norm in NORM_FP32
        tail = (extra[-1] if sinks else None,) if sinks or fp32_norm else ()
        tail += (float(kw["offset"]) if "offset" in kw else 0.0,) if fp32_norm else ()
        o = torch.ops.tkcc.attention_rope(qkv, k_cache, v_cache, cache_position, inv_freq, rope_scale, qn, kn,
                                          kw.get("eps", 1e-6), scale, num_heads, window, chunk, block_s,
                                          num_warps, count, pdl, qk_norm in PER_HEAD,
                                          kw.get("rotary_dim", 0), kw.get("interleaved", False), *tail,
                                          **{k: True for k in ("rope_fp32", "rope_table_rounded", "kv_broadcast")
                                             if kw.get(k)}, **({"q_gated": True} if gated else {}))
        if not gated:
            return o
        B, T, D = qkv.shape[0], qkv.shape[1], k_cache.shape[3]
        # the gate copied out as the model's reshape copies it: sigmoid over a strided view rounds apart on the CPU
        gate = qkv[..., :2 * num_heads * D].view(B, T, num_heads, 2 * D)[..., D:].reshape(B, T, -1)
        return o * torch.sigmoid(gate)

    return pattern, replacement


def fused_heads_mqa(qkv, k_cache, v_cache, cache_position, cos, sin, mask, k_index, v_index):
    """Falcon's multi-query block (``multi_query``, ``FalconAttention._split_heads``): the projection viewed as its
    query heads and one key and one value head, ``[..., :-2, :]``, ``[..., [-2], :]``, ``[..., [-1], :]`` (the list
    indices are constants of the graph: ``k_index``, ``v_index``), rotate-half, the cache writes, and sdpa with the
    one key head broadcast over the query heads (no ``repeat_kv``), at sdpa's default scale. The projection is
    [q | k | v] as the fused attention reads it, with one kv head."""
    B, T, D = qkv.shape[0], qkv.shape[1], k_cache.shape[3]
    hq = qkv.shape[-1] // D - 2
    fused = qkv.view(B, T, hq + 2, D)
    query, key, value = fused[..., :-2, :], fused[..., k_index, :], fused[..., v_index, :]
    query = query.transpose(1, 2).reshape(B, hq, T, D)
    key = key.transpose(1, 2).reshape(B, 1, T, D)
    value = value.transpose(1, 2).reshape(B, 1, T, D)
    query, key = rope_half(query, key, cos.unsqueeze(1), sin.unsqueeze(1))
    keys = k_cache.index_copy_(2, cache_position, key)
    values = v_cache.index_copy_(2, cache_position, value)
    o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=0.0, is_causal=False)
    o = o.view(B, hq, T, D).permute(0, 2, 1, 3)
    return o.reshape(B, T, hq * D)


def _fused_heads_mqa_replacement(qkv, k_cache, v_cache, cache_position, cos, sin, mask, k_index, v_index, *,
                                 scale, **params):
    _pattern, replacement = _attention_pattern("")
    return replacement(qkv, k_cache, v_cache, cache_position, cos, sin, mask, scale=scale, **params)


def _fused_heads_mqa_example(dt):
    D, S, hq = 16, 40, 4
    return ((torch.empty(1, 1, (hq + 2) * D, dtype=dt), torch.empty(1, 1, S, D, dtype=dt),
             torch.empty(1, 1, S, D, dtype=dt), torch.empty(1, dtype=torch.int64), torch.empty(1, 1, D, dtype=dt),
             torch.empty(1, 1, D, dtype=dt), torch.empty(1, 1, 1, S, dtype=torch.bool),
             torch.empty(1, dtype=torch.int64), torch.empty(1, dtype=torch.int64)), {})


def _fused_heads_mqa_check(m) -> str | None:
    """``_check``, one kv head, and the list indices pick the key and the value head (the last two)."""
    kc = m.val(1)
    hq = m.val(0).shape[-1] // kc.shape[3] - 2
    if kc.shape[1] != 1:
        return f"a multi-query cache of {kc.shape[1]} heads"
    for i, want in ((7, (-2, hq)), (8, (-1, hq + 1))):
        got = _constant(m.inputs[i], m.gm)
        if got not in want:
            return (f"the {'key' if i == 7 else 'value'} head is index {got if got is None else int(got)}, not "
                    f"{want[0]} of {hq + 2} heads")
    return _check(m)


def _fused_heads_mqa_params(m, ctx):
    from tkcc.kernels.lowered import default_scale

    # sdpa's own default scale; the one key head broadcast by sdpa (the reference rounds as that form does)
    return {**_params(m, ctx), "scale": default_scale(int(m.val(1).shape[3])), "kv_broadcast": True}


def _example(qk_norm: str, hq: int, hkv: int, sinks: bool = False, table: int | None = None, gated: bool = False):
    """``sinks``: the mask additive (float) and the per-head sink logits last; ``table``: the rotary table's width
    (default the head's); ``gated``: a gate after each q head."""
    D, S = 16, 40

    def example(dt):
        R = table or D
        ts = [torch.empty(1, 1, ((2 if gated else 1) * hq + 2 * hkv) * D, dtype=dt), torch.empty(1, hkv, S, D, dtype=dt),
              torch.empty(1, hkv, S, D, dtype=dt), torch.empty(1, dtype=torch.int64),
              torch.empty(1, 1, R, dtype=dt), torch.empty(1, 1, R, dtype=dt),
              torch.empty(1, 1, 1, S, dtype=dt) if sinks else torch.empty(1, 1, 1, S, dtype=torch.bool)]
        if qk_norm in ("full", "full_fp32"):
            ts += [torch.empty(hq * D, dtype=dt), torch.empty(hkv * D, dtype=dt)]
        elif qk_norm in PER_HEAD:
            ts += [torch.empty(D, dtype=dt), torch.empty(D, dtype=dt)]
        if sinks:
            ts.append(torch.empty(hq, dtype=dt))
        sc = {"scale": SCALE, "eps": EPS} if qk_norm else {"scale": SCALE}
        return tuple(ts), ({**sc, "offset": OFFSET} if qk_norm in ("head_offset", "head_offset_view") else sc)

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


def _check(m, half_table: bool = False, interleaved_table: bool = False) -> str | None:
    return token_and_caches(m) or step_mask_and_rotary(m, pos=3, cos=4, sin=5, mask=6, kv_len=m.val(1).shape[2],
                                                       half_table=half_table, interleaved_table=interleaved_table)


def token_and_caches(m) -> str | None:
    """Why a region whose inputs start (qkv, k cache, v cache) is not what the fused attention takes, or None: one
    token of one sequence, the caches one [B, Hkv, S, D] layout in the activations' dtype, buffers of the graph."""
    qkv, kc, vc = m.val(0), m.val(1), m.val(2)
    if qkv.shape[0] != 1 or qkv.shape[1] != 1:
        return f"qkv {tuple(qkv.shape)} is not one token of one sequence (the fused attention is batch-1 decode)"
    if kc.dim() != 4 or tuple(kc.shape) != tuple(vc.shape) or kc.dtype != qkv.dtype:
        return f"caches {tuple(kc.shape)} / {tuple(vc.shape)} {kc.dtype} are not one [B, Hkv, S, D] layout"
    if m.tensor(1) is None or m.tensor(2) is None:
        return "the caches are not buffers of the graph"
    return None


def step_mask_and_rotary(m, *, pos: int, cos: int, sin: int, mask: int, kv_len: int, whole: bool = False,
                         half_table: bool = False, interleaved_table: bool = False):
    """Why a matched region's mask and rotary table are not the step's own, or None: the mask is the step's
    causal mask over the ``kv_len``-position cache at the cache positions (``whole``: with no window), boolean or
    made additive (``additive_mask_of``), and cos/sin are one ``rotary_cos_sin`` at those positions (``half_table``:
    their first halves; ``interleaved_table``: their first halves, each element twice; ``rotary_table_of``).
    Arguments are the region's input indices."""
    why = step_mask(m, pos=pos, mask=mask, kv_len=kv_len, whole=whole)
    if why:
        return why
    rot = rotary_table_of(m.inputs[cos], 0, half_table, interleaved_table)
    if rot is None or rotary_table_of(m.inputs[sin], 1, half_table, interleaved_table) is not rot:
        form = "the first halves of " if half_table else "the first halves, each element twice, of " \
            if interleaved_table else ""
        return f"cos/sin are not {form}the step's rotary table"
    if not _is_positions_of(rot.args[1], m.inputs[pos]):
        return "the rotary positions are not the cache positions"
    return None


def step_mask(m, *, pos: int, mask: int, kv_len: int, whole: bool = False):
    """Why a matched region's mask is not the step's causal mask over the ``kv_len``-position cache at the cache
    positions (``whole``: with no window), boolean or made additive (``additive_mask_of``), or None."""
    mnode = m.inputs[mask]
    if _val(mnode) is not None and _val(mnode).dtype != torch.bool:
        mnode = additive_mask_of(mnode, m.gm)
        if mnode is None:
            return "the additive attention mask is not where(mask, 0, the dtype's minimum) of a boolean mask"
    causal = _producer(mnode, torch.ops.tkcc.causal_mask.default)
    if causal is None:
        return "the attention mask is not the step's causal mask (padding, a custom mask)"
    if causal.args[0] is not m.inputs[pos] or causal.args[1] != kv_len or (
            whole and len(causal.args) > 2 and causal.args[2]):
        return f"the causal mask is not over the {'whole ' if whole else ''}cache at these positions"
    return None


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


_PASS_THROUGH = (torch.ops.aten.detach_.default, torch.ops.aten.detach.default, torch.ops.aten.lift_fresh_copy.default,
                 torch.ops.aten.clone.default)


def _constant(node, gm):
    """The value of a graph constant (a literal, or a lifted tensor behind its copies), else None."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _PASS_THROUGH:
        node = node.args[0]
    if isinstance(node, (int, float)):
        return float(node)
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in (
            torch.ops.aten.new_zeros.default, torch.ops.aten.zeros.default) and _val(node) is not None \
            and _val(node).numel() == 1:
        return 0.0
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.Tensor) and obj.numel() == 1:
            return float(obj.reshape(()))
    return None


def additive_mask_of(node, gm):
    """The boolean mask that ``node`` makes additive, as transformers' ``eager_mask`` does
    (``where(mask, 0, finfo(dtype).min)``: eager attention adds it to the scores), else None."""
    w = node if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in (
        torch.ops.aten.where.ScalarOther, torch.ops.aten.where.self, torch.ops.aten.where.Scalar) else None
    if w is None or len(w.args) != 3 or _val(w) is None or not _val(w).is_floating_point():
        return None
    cond = w.args[0]
    if _val(cond) is None or _val(cond).dtype != torch.bool:
        return None
    if _constant(w.args[1], gm) != 0.0 or _constant(w.args[2], gm) != torch.finfo(_val(w).dtype).min:
        return None
    return cond


def rotary_table_of(node, index: int, half: bool = False, interleaved: bool = False):
    """The ``rotary_cos_sin`` whose cos (``index`` 0) or sin (1) ``node`` is, or (``half``) whose first half along
    the last dim it is (gpt-oss's table over half the head: ``rotary.cos_sin_half``), or (``interleaved``) whose
    first half it repeats (Cohere's ``repeat_interleave``d table: ``rotary.cos_sin_interleaved``), else None."""
    if interleaved:
        node = repeated_half_of(node)
    elif half:
        node = _first_half_of(node)
    return _getitem_of(node, torch.ops.tkcc.rotary_cos_sin.default, index)


def _first_half_of(node):
    """The tensor whose first half along the last dim ``node`` is (a slice), else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is torch.ops.aten.slice.Tensor):
        return None
    src, dim, start, end, step = _all_args(node)
    val = _val(src)
    if val is None or dim not in (-1, val.dim() - 1) or start not in (0, None) or step != 1 \
            or end != val.shape[-1] // 2:
        return None
    return src


def repeated_half_of(node):
    """The tensor whose first half along the last dim ``node`` repeats, each element twice in place
    (``x[..., :n // 2].repeat_interleave(2, -1)``), else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is torch.ops.aten.repeat_interleave.self_int):
        return None
    src, repeats, dim, output_size = _all_args(node)
    val = _val(src)
    if val is None or repeats != 2 or dim not in (-1, val.dim() - 1) or output_size not in (None, 2 * val.shape[-1]):
        return None
    return _first_half_of(src)


def _params(m, ctx, q_gated: bool = False):
    node = m.inputs[4]
    rot = rotary_table_of(node, 0) or rotary_table_of(node, 0, half=True) or \
        rotary_table_of(node, 0, interleaved=True)
    return {**_layout_params(m, ctx, mask=6, q_gated=q_gated), "inv_freq": rot.args[0],
            "rope_scale": float(rot.args[2])}


def _layout_params(m, ctx, *, mask: int, q_gated: bool = False):
    """The fused attention's parameters but the rotation's, for a region whose inputs are (qkv, k cache, v cache, ...)
    and whose mask is input ``mask``: its tile and chunk for this device, the arrival counters, the heads, the
    window, PDL. ``q_gated``: a gate follows each q head in qkv."""
    kc = m.val(1)
    hkv, S, D = kc.shape[1], kc.shape[2], kc.shape[3]
    hq = (m.val(0).shape[-1] // D - 2 * hkv) // (2 if q_gated else 1)
    mnode = _producer(m.inputs[mask], torch.ops.tkcc.causal_mask.default) or \
        _producer(additive_mask_of(m.inputs[mask], m.gm), torch.ops.tkcc.causal_mask.default)
    chunk, (block_s, num_warps) = ctx.options["attention_layout"](hq, hkv, D, S)
    if block_s is None:
        raise Refused("no attention tile fits the device")
    count = ctx.tensor("count", torch.zeros(max(hkv, 1), dtype=torch.int32, device=kc.device),
                       share_key=("count", hkv, str(kc.device)))
    return {"count": count, "num_heads": int(hq), "window": int(mnode.args[2]) if len(mnode.args) > 2 else 0,
            "chunk": int(chunk), "block_s": int(block_s), "num_warps": int(num_warps),
            "pdl": bool(ctx.options.get("pdl"))}


def _check_sinks(m, half_table: bool = False) -> str | None:
    """``_check``, the mask is additive (the eager attention adds it to the scores: a boolean one would add 0/1), and
    the sink logits are a per-head vector in the activations' dtype."""
    if m.val(6).dtype == torch.bool:
        return "the eager attention adds a boolean mask to its scores"
    why = _check(m, half_table)
    if why:
        return why
    sinks, hq = m.val(len(m.inputs) - 1), m.val(0).shape[-1] // m.val(1).shape[3] - 2 * m.val(1).shape[1]
    if sinks.dim() != 1 or sinks.shape[0] != hq or sinks.dtype != m.val(0).dtype:
        return f"sink logits {tuple(sinks.shape)} {sinks.dtype} for {hq} heads of {m.val(0).dtype}"
    return None


def _attention_rewrites():
    out = []
    for qk_norm in ("full", "head", "head_transposed", "head_offset", ""):
        pattern, replacement = _attention_pattern(qk_norm)
        for kind, (hq, hkv) in (("gqa", (4, 2)), ("mha", (4, 4))):
            name = f"attention[{kind}{'+' + qk_norm + '_qk_norm' if qk_norm else ''}]"
            out.append(Rewrite(name, pattern, replacement, _example(qk_norm, hq, hkv), region="attention",
                               check=_check, params=_params))
    pattern, replacement = _attention_pattern("", sinks=True)
    for kind, (hq, hkv) in (("gqa", (4, 2)), ("mha", (4, 4))):
        out.append(Rewrite(f"attention[{kind}, sinks]", pattern, replacement, _example("", hq, hkv, sinks=True),
                           region="attention", check=_check_sinks, params=_params))
    out.append(Rewrite("attention[mqa, fused heads]", fused_heads_mqa, _fused_heads_mqa_replacement,
                       _fused_heads_mqa_example, region="attention", check=_fused_heads_mqa_check,
                       params=_fused_heads_mqa_params))
    return out


ATTENTION = _attention_rewrites()
