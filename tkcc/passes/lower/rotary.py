"""Rotary embedding: the cos/sin table of a step (``LlamaRotaryEmbedding.forward``), full or scaled, and the
rotations that are not the full rotate-half one (partial, interleaved), each as its attention rewrite.

The table is computed once per step from ``inv_freq`` and the positions, and shared by every layer; the
rewrite names it ``tkcc.rotary_cos_sin`` (same arithmetic, bit-exact), so that the attention rewrite can
see what the rotation is (which ``inv_freq``, which positions, which ``attention_scaling``) and compute it
inside the fused attention kernel instead; once every layer's attention is fused the table is dead code.
Scaled variants whose scaling lives in ``inv_freq`` (Llama 3, linear, dynamic-at-capture) are this same
pattern with another buffer; YaRN-style ``attention_scaling`` is its ``scale``.

Rotations (``ATTENTION``: the attention block of ``attention.py`` with another rotation, lowered to the same
fused ``tkcc.attention_rope`` with its ``rotary_dim`` / ``interleaved``):

- partial (Phi-3, StableLM, GPT-NeoX, Qwen3-Next's ``partial_rotary_factor``): only the first ``rotary_dim``
  elements of each head rotate, as halves of ``rotary_dim`` (the table is ``rotary_dim`` wide, ``inv_freq``
  ``rotary_dim / 2``); the rest passes through;
- interleaved (GLM; GPT-J's pairs): pairs ``(2i, 2i + 1)`` rotate at frequency i (the table's first half
  ``repeat_interleave``d), full or partial; Helium writes the full one without GLM's slices
  (``rope_interleaved_unsliced``); Cohere's rotary embedding interleaves the table itself (``cos_sin_interleaved``,
  named the step's table's first half repeated) and its rotation upcasts q and k (``rope_interleaved_upcast``).

Only the packed-projection form of the block is matched: ``canonical_split`` first turns a projection's three
slices that tile its last dim (Phi-3's ``qkv[..., :q]``, ...) into the one ``split`` the packer emits.
"""
from __future__ import annotations

import itertools

import torch

from tkcc.passes.lower.pattern import Refused, Rewrite, at_one

SCALE = 0.8125  # sentinel


def cos_sin(inv_freq, position_ids, *, scale, dtype):
    """As transformers writes it (autocast off: fp32 throughout, then rounded to the activations' dtype)."""
    inv_freq_expanded = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(
        dtype=torch.float, device=position_ids.device)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * scale
    sin = emb.sin() * scale
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def _to_op(inv_freq, position_ids, *, scale, dtype):
    return torch.ops.tkcc.rotary_cos_sin(inv_freq, position_ids, scale, dtype)


def _check(m) -> str | None:
    inv, pos = m.val(0), m.val(1)
    if inv.dim() != 1 or not inv.is_floating_point():
        return f"inv_freq {tuple(inv.shape)} {inv.dtype} is not a float vector"
    if pos.dim() != 2 or pos.dtype not in (torch.int64, torch.int32):
        return f"positions {tuple(pos.shape)} {pos.dtype} are not [batch, tokens] integers"
    return None


def _example(inv_dtype):
    def example(dt):
        return ((torch.empty(12, dtype=inv_dtype or dt), torch.empty(1, 1, dtype=torch.int64)),
                {"scale": SCALE, "dtype": dt})
    return example


def _fp32_example(inv_dtype):
    def example(dt):
        return ((torch.empty(12, dtype=inv_dtype or dt), torch.empty(1, 1, dtype=torch.int64)),
                {"scale": SCALE, "dtype": torch.float32})
    return example


def cos_sin_upcast(inv_freq, position_ids, *, scale, dtype):
    """Qwen2's ``RotaryEmbedding.forward`` (and some 40 other families': Qwen3, OLMo, Gemma 2, MiniMax, ...):
    ``inv_freq`` upcast before its expand and again at the product. Upcasts of fp32 are no-ops, so a model run in
    fp32 traces ``cos_sin``; one cast to bf16 (``model.to(torch.bfloat16)``: ``inv_freq`` with it) traces this."""
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(position_ids.device)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * scale
    sin = emb.sin() * scale
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def cos_sin_half(inv_freq, position_ids, *, scale, dtype):
    """gpt-oss's ``GptOssRotaryEmbedding.forward``: the table over half the head (``emb = freqs``, no cat: its rotation
    pairs the halves of each head itself, ``rope_chunked``)."""
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(position_ids.device)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    cos = freqs.cos() * scale
    sin = freqs.sin() * scale
    return cos.to(dtype), sin.to(dtype)


def _to_op_half(inv_freq, position_ids, *, scale, dtype):
    """The step's table, first halves: ``cat(f, f).cos()[..., :n]`` is ``f.cos()`` element for element."""
    cos, sin = torch.ops.tkcc.rotary_cos_sin(inv_freq, position_ids, scale, dtype)
    n = inv_freq.shape[0]
    return cos[..., :n], sin[..., :n]


def cos_sin_interleaved(inv_freq, position_ids, *, scale, dtype):
    """Cohere's (and Cohere 2's) ``RotaryEmbedding.forward``: each frequency twice in place (``repeat_interleave``,
    not ``cat``), for its rotation's pairs ``(2i, 2i + 1)``."""
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    emb = torch.repeat_interleave(freqs, 2, dim=-1)
    cos = emb.cos() * scale
    sin = emb.sin() * scale
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def _to_op_interleaved(inv_freq, position_ids, *, scale, dtype):
    """The step's table, first halves repeated in place: ``f.cos()`` at ``2i`` and ``2i + 1`` is
    ``repeat_interleave(f, 2).cos()`` element for element (what ``attention.rotary_table_of`` reads as the table)."""
    cos, sin = _to_op_half(inv_freq, position_ids, scale=scale, dtype=dtype)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


# inv_freq kept in fp32 (a model loaded in its dtype), or cast with the model (``model.to(torch.bfloat16)``)
REWRITES = [
    Rewrite("rotary_cos_sin", cos_sin, _to_op, _example(torch.float32), region="rotary", exact=True, check=_check),
    Rewrite("rotary_cos_sin[inv_freq in the model dtype]", cos_sin, _to_op, _example(None), region="rotary",
            exact=True, check=_check),
    Rewrite("rotary_cos_sin[inv_freq in the model dtype, upcast]", cos_sin_upcast, _to_op, _example(None),
            region="rotary", exact=True, check=_check),
    # Ernie 4.5, OLMo 2 and 3: the table left fp32 (no cast back to the activations' dtype)
    Rewrite("rotary_cos_sin[kept fp32]", cos_sin_upcast, _to_op, _fp32_example(torch.float32), region="rotary",
            exact=True, check=_check),
    Rewrite("rotary_cos_sin[inv_freq in the model dtype, upcast, kept fp32]", cos_sin_upcast, _to_op,
            _fp32_example(None), region="rotary", exact=True, check=_check),
    Rewrite("rotary_cos_sin[inv_freq in the model dtype, kept fp32]", cos_sin, _to_op, _fp32_example(None),
            region="rotary", exact=True, check=_check),  # (OLMo 3)
    Rewrite("rotary_cos_sin[half table]", cos_sin_half, _to_op_half, _example(torch.float32), region="rotary",
            exact=True, check=_check),
    Rewrite("rotary_cos_sin[half table, inv_freq in the model dtype]", cos_sin_half, _to_op_half, _example(None),
            region="rotary", exact=True, check=_check),
    Rewrite("rotary_cos_sin[interleaved table]", cos_sin_interleaved, _to_op_interleaved, _example(torch.float32),
            region="rotary", exact=True, check=_check),
    Rewrite("rotary_cos_sin[interleaved table, inv_freq in the model dtype]", cos_sin_interleaved, _to_op_interleaved,
            _example(None), region="rotary", exact=True, check=_check),
]
REWRITES += [at_one(rw, "scale") for rw in REWRITES]  # most models' attention_scaling: 1, its product dropped


# ---- rotations -------------------------------------------------------------------------------------------

def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x):
    """GLM's ``rotate_half``: pairs (2i, 2i + 1) -> (-x_{2i+1}, x_{2i})."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rope_partial(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb`` with a partial rotary (Phi-3, StableLM, GPT-NeoX)."""
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def rope_interleaved(q, k, cos, sin):
    """GLM's ``apply_rotary_pos_emb``: the table's first half repeated per pair, full or partial."""
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_pairs(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_pairs(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def rope_interleaved_unsliced(q, k, cos, sin):
    """Helium's (and, in an fp32 graph, Ernie 4.5's) ``apply_rotary_pos_emb``: GLM's interleaved pairs over the whole
    head, written without GLM's rotary/pass-through slices (``rope_interleaved`` over the whole head still traces
    them, empty, so it does not match this code)."""
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    return (q * cos) + (rotate_pairs(q) * sin), (k * cos) + (rotate_pairs(k) * sin)


def rope_interleaved_fp32(q, k, cos, sin):
    """Ernie 4.5's ``apply_rotary_pos_emb``: GLM's interleaved pairs over the whole head, q and k upcast and rotated by
    the fp32 table (its rotary embedding keeps the table fp32), then rounded back. In an fp32 graph the casts are
    gone: it is ``rope_interleaved_unsliced``."""
    original_dtype = q.dtype
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    q_embed = (q.float() * cos) + (rotate_pairs(q).float() * sin)
    k_embed = (k.float() * cos) + (rotate_pairs(k).float() * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)


def rope_interleaved_upcast(q, k, cos, sin):
    """Cohere's (and Cohere 2's) ``apply_rotary_pos_emb``: q and k upcast and rotated in GLM's interleaved pairs by the
    table as its rotary embedding leaves it (interleaved already: ``cos_sin_interleaved``; rounded to the activations'
    dtype), in fp32, then rounded back once. In an fp32 graph the casts are gone."""
    dtype = q.dtype
    q = q.float()
    k = k.float()
    q_embed = (q * cos) + (rotate_pairs(q) * sin)
    k_embed = (k * cos) + (rotate_pairs(k) * sin)
    return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)


def rope_half_fp32(q, k, cos, sin):
    """OLMo 2's ``apply_rotary_pos_emb``: rotate-half by the table its rotary embedding keeps fp32 (q and k are
    promoted by the products), rounded back. In an fp32 graph: the plain rotate-half."""
    q_type, k_type = q.dtype, k.dtype
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(q_type), k_embed.to(k_type)


def _rotate_chunked(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)


def rope_chunked(q, k, cos, sin):
    """gpt-oss's ``apply_rotary_pos_emb``: each head's halves rotated by the half table (``cos_sin_half``). The same
    arithmetic as rotate-half over the whole table, element for element (``a - b * s`` is ``a + (-b) * s``)."""
    return _rotate_chunked(q, cos, sin), _rotate_chunked(k, cos, sin)


ROPES = {"partial": (rope_partial, False), "interleaved": (rope_interleaved, True)}


def _attention_rewrites():
    from tkcc.passes.lower import attention

    out = []
    # the table over part of the head, or over all of it (the same code with nothing to pass through traces to
    # other ops: its empty slices are gone)
    for (kind, (rope, interleaved)), whole in itertools.product(ROPES.items(), (False, True)):
        for qk_norm in ("full", "head", ""):
            pattern, replacement = attention._attention_pattern(qk_norm, rope)
            for heads, (hq, hkv) in (("gqa", (4, 2)), ("mha", (4, 4))):
                base = attention._example(qk_norm, hq, hkv)

                def example(dt, base=base, whole=whole):
                    ts, sc = base(dt)
                    if whole:
                        return ts, sc
                    ts = list(ts)
                    ts[4], ts[5] = ts[4][..., :8].clone(), ts[5][..., :8].clone()  # a table for half the head
                    return tuple(ts), sc

                params = _rotary_params(interleaved)
                name = f"attention[{heads}{'+' + qk_norm + '_qk_norm' if qk_norm else ''}, {kind} rotary" \
                       f"{' over the whole head' if whole else ''}]"
                out.append(Rewrite(name, pattern, replacement, example, region="attention", check=attention._check,
                                   params=params))
    # Helium: the interleaved pairs over the whole head, with no slices to trace
    for qk_norm in ("full", "head", ""):
        pattern, replacement = attention._attention_pattern(qk_norm, rope_interleaved_unsliced)
        for heads, (hq, hkv) in (("gqa", (4, 2)), ("mha", (4, 4))):
            name = f"attention[{heads}{'+' + qk_norm + '_qk_norm' if qk_norm else ''}, interleaved rotary, unsliced]"
            out.append(Rewrite(name, pattern, replacement, attention._example(qk_norm, hq, hkv), region="attention",
                               check=attention._check, params=_rotary_params(True)))
    # Ernie 4.5: the interleaved pairs rotated in fp32 by the fp32 table
    pattern, replacement = attention._attention_pattern("", rope_interleaved_fp32)
    for heads, (hq, hkv) in (("gqa", (4, 2)), ("mha", (4, 4))):
        out.append(Rewrite(f"attention[{heads}, interleaved rotary in fp32 by an fp32 table]", pattern, replacement,
                           _fp32_table(attention._example("", hq, hkv)), region="attention", check=_fp32_table_check,
                           params=_rotary_params(True, fp32=True)))
    # Cohere: the interleaved pairs rotated in fp32 by its own interleaved table, in the activations' dtype
    pattern, replacement = attention._attention_pattern("", rope_interleaved_upcast)
    for heads, (hq, hkv) in (("gqa", (4, 2)), ("mha", (4, 4))):
        out.append(Rewrite(f"attention[{heads}, interleaved rotary in fp32 by an interleaved table]", pattern,
                           replacement, attention._example("", hq, hkv), region="attention",
                           check=_interleaved_table_check, params=_interleaved_table_params))
    # OLMo 2: rotate-half by the fp32 table, after q/k norms over the whole projection in fp32 (or none)
    for qk_norm in ("full_fp32", ""):
        pattern, replacement = attention._attention_pattern(qk_norm, rope_half_fp32)
        for heads, (hq, hkv) in (("gqa", (4, 2)), ("mha", (4, 4))):
            out.append(Rewrite(f"attention[{heads}{'+fp32 full_qk_norm' if qk_norm else ''}, rotate-half in fp32 by an "
                               "fp32 table]", pattern, replacement, _fp32_table(attention._example(qk_norm, hq, hkv)),
                               region="attention", check=_fp32_table_check, params=_rotary_params(False, fp32=True)))
    # Qwen3-Next's gated attention: a gate after each q head, (1 + w) q/k norms per head before the heads are
    # transposed, a partial rotary (or one over the whole head), the output times sigmoid(gate)
    pattern, replacement = attention._attention_pattern("head_offset_view", rope_partial, gated=True)
    for (heads, (hq, hkv)), whole in itertools.product((("gqa", (4, 2)), ("mha", (4, 4))), (False, True)):
        base = attention._example("head_offset_view", hq, hkv, table=None if whole else 8, gated=True)
        out.append(Rewrite(f"attention[{heads}+head_offset_view_qk_norm, gated q, partial rotary"
                           f"{' over the whole head' if whole else ''}]", pattern, replacement, base,
                           region="attention", check=attention._check, params=_rotary_params(False, q_gated=True)))
    # StableLM: the partial rotary with q, k and v viewed as heads by their counts
    pattern, replacement = attention._attention_pattern("", rope_partial, explicit_heads=True)
    for heads, (hq, hkv) in (("gqa", (4, 2)), ("mha", (4, 4))):
        base = attention._example("", hq, hkv)

        def example(dt, base=base):
            ts, sc = base(dt)
            ts = list(ts)
            ts[4], ts[5] = ts[4][..., :8].clone(), ts[5][..., :8].clone()
            return tuple(ts), sc

        out.append(Rewrite(f"attention[{heads}, partial rotary, explicit head counts]", pattern, replacement, example,
                           region="attention", check=attention._check, params=_rotary_params(False)))
    return out + _sink_rewrites()


def _rotary_params(interleaved, fp32=False, q_gated=False):
    from tkcc.passes.lower import attention

    def params(m, ctx):
        got = attention._params(m, ctx, q_gated)
        D, R = m.val(1).shape[-1], m.val(4).shape[-1]
        if R % 2 or R > D:
            raise Refused(f"rotary table of {R} for heads of {D}")
        got.update(rotary_dim=0 if R == D else int(R), interleaved=interleaved, **({"rope_fp32": True} if fp32 else {}))
        return got

    return params


def _interleaved_table_check(m) -> str | None:
    """The step's table, its first halves repeated (``attention.step_mask_and_rotary``'s ``interleaved_table``), in
    fp32 or the activations' dtype; the rest as ``attention._check`` has it."""
    from tkcc.passes.lower import attention

    if m.val(4).dtype not in (torch.float32, m.val(0).dtype):
        return f"the rotary table is {m.val(4).dtype}, neither fp32 nor the activations' {m.val(0).dtype}"
    return attention._check(m, interleaved_table=True)


def _interleaved_table_params(m, ctx):
    """The interleaved pairs over the whole head in fp32; the kernel rounds the table to the activations' dtype as
    the model does, unless the model keeps it fp32."""
    got = _rotary_params(True, fp32=True)(m, ctx)
    got.update(rope_table_rounded=m.val(4).dtype != torch.float32)
    return got


def _fp32_table_check(m) -> str | None:
    """The fp32 rotation reads an fp32 table (a table in the activations' dtype is the plain rotation's, rounded)."""
    from tkcc.passes.lower import attention

    if m.val(4).dtype != torch.float32 or m.val(5).dtype != torch.float32:
        return f"the rotary table is {m.val(4).dtype}, not fp32"
    return attention._check(m)


def _fp32_table(example):
    """``example`` with its cos / sin tables fp32, whatever the activations' dtype."""
    def fp32(dt):
        ts, sc = example(dt)
        ts = list(ts)
        ts[4], ts[5] = (torch.empty(t.shape, dtype=torch.float32) for t in ts[4:6])
        return tuple(ts), sc
    return fp32


def _sink_rewrites():
    """The eager attention with per-head sink logits (``attention.sink_attention``) under gpt-oss's chunked rotation
    (its half table) and under a partial one (MiMo-V2's sliding layers)."""
    from tkcc.passes.lower import attention

    out = []
    for kind, rope in (("chunked", rope_chunked), ("partial", rope_partial)):
        pattern, replacement = attention._attention_pattern("", rope, sinks=True)
        for heads, (hq, hkv) in (("gqa", (4, 2)), ("mha", (4, 4))):
            example = attention._example("", hq, hkv, sinks=True, table=8)

            def check(m, kind=kind):
                return attention._check_sinks(m, half_table=kind == "chunked")

            def params(m, ctx, kind=kind):
                got = attention._params(m, ctx)
                D, R, n = m.val(1).shape[-1], m.val(4).shape[-1], got["inv_freq"].meta["val"].numel()
                if kind == "chunked" and not (2 * R == D == 2 * n):
                    raise Refused(f"a half table of {R} from {n} frequencies for heads of {D}")
                if kind == "partial" and (R % 2 or R >= D or 2 * n != R):
                    raise Refused(f"rotary table of {R} from {n} frequencies for heads of {D}")
                got.update(rotary_dim=0 if kind == "chunked" else int(R), interleaved=False)
                return got

            out.append(Rewrite(f"attention[{heads}, sinks, {kind} rotary]", pattern, replacement, example,
                               region="attention", check=check, params=params))
    return out


# ---- canonical form: a packed projection's slices -> one split ----------------------------------------------

A, B = 40, 56  # sentinels (the example is 72 wide)


def three_slices(x, *, a, b):
    return x[..., :a], x[..., a:b], x[..., b:]


def _to_split(x, *, a, b):
    return torch.split(x, [a, b - a, x.shape[-1] - b], -1)


def _check_slices(m) -> str | None:
    n = m.val(0).shape[-1]
    a, b = m.scalars["a"], m.scalars["b"]
    if not 0 < a < b < n:
        return f"slices at {a}, {b} of {n} do not tile the dim"
    return None


CANONICAL = [Rewrite("canonical_split[3 slices]", three_slices, _to_split,
                     lambda dt: ((torch.empty(1, 1, 72, dtype=dt),), {"a": A, "b": B}), region="projection",
                     exact=True, check=_check_slices)]
ATTENTION = _attention_rewrites()
