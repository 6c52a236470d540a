"""Checks of the rotary, sink, linear-attention, gated-delta, causal-convolution and Cohere rewrites (``checks.py``'s machinery, on their own
regions): each region written as the model's code writes it, captured, lowered, and compared with its eager run on
fresh random inputs and several shapes (caches and recurrent states compared too). ``checks.py`` imports
this module, so it imports ``checks`` inside the functions. Also OPT's q scaled before the attention, and BLOOM's
ALiBi attention."""
from __future__ import annotations

import torch



def check_linear_attention(device, dtype, g, shapes=((3, 16, 16), (4, 32, 16), (2, 64, 32))):
    """MiniMax's lightning decode step over the [2, B, H, D, D] state double buffer: both slots, position 0
    (a fresh sequence reads zeros), one and several column blocks per head."""
    from tkcc.passes.lower import linear_attention as la
    from tkcc.passes.lower.checks import Region, _options, _rand, run_case

    rows = []
    for H, D, bv in shapes:
        for act in ("silu", ""):
            pattern = la._lightning_pattern(act)[0]
            slope = (torch.rand(H, 1, 1, generator=g) * 0.5 + 0.01).to(device=device, dtype=dtype)
            t = {"state": _rand((2, 1, H, D, D), g, device, dtype, 0.5), "slope": slope}

            def fn(s, qkv, pos, pattern=pattern):
                return pattern(qkv, s.state, pos, s.slope)[0]

            def make(H=H, D=D):
                pos = torch.randint(0, 3, (1,), generator=g).to(device)
                return _rand((1, 1, 3 * H * D), g, device, dtype), pos

            opts = dict(_options(), linear_block_v=bv)
            rows += run_case(f"linear_attention[{H}x{D}, block_v={bv}{', ' + act if act else ''}]", Region(fn, t),
                             make, "tkcc.linear_attention.default", False, dtype, opts, state=("state",))
    return rows


def check_gated_delta(device, dtype, g, shapes=((3, 1, 16, 16, 16, False), (2, 2, 32, 48, 32, True),
                                                (1, 4, 16, 16, 16, False), (2, 1, 64, 128, 64, True),
                                                (4, 2, 128, 128, 64, True))):
    """Gated DeltaNet's decode step over the [2, B, H, DK, DV] float32 state double buffer (transformers' recurrent
    rule for one token, as the model's code writes it): both slots, position 0 (a fresh sequence reads zeros), one
    and several column blocks per head, a value head dim that is not a power of two, q / k / v as strided views of
    the convolution's output (where DV != DK); with ``group`` value heads per key head, Qwen3-Next's
    ``repeat_interleave`` of q and k first, and with ``gates``, its gates from the per-key-head b and a of its
    projection, all folded into the one op: (HK, group, DK, DV, block_v, gates)."""
    from tkcc.kernels.gated_delta import gated_delta_step
    from tkcc.passes.lower.checks import Region, _options, _rand, run_case

    rows = []
    for HK, group, DK, DV, bv, gates in shapes:
        H = HK * group
        t = {"state": _rand((2, 1, H, DK, DV), g, device, torch.float32, 0.5)}
        if gates:
            t["A_log"] = (torch.rand(H, generator=g) * 3).to(device=device, dtype=dtype)
            t["dt_bias"] = _rand((H,), g, device, dtype)

        def fn(s, q, k, v, decay, beta, pos, group=group, gates=gates, H=H):
            if gates:  # Qwen3-Next's code, from the a and b (in decay's and beta's places) it splits per key head
                a, b = decay.reshape(1, 1, H), beta.reshape(1, 1, H)
                beta = b.sigmoid()
                decay = -s.A_log.float().exp() * torch.nn.functional.softplus(a.float() + s.dt_bias)
            if group > 1:
                q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
            return gated_delta_step(q, k, v, decay, beta, s.state, pos)[0]

        def make(H=H, HK=HK, DK=DK, DV=DV, group=group, gates=gates, strided=DV != DK):
            pos = torch.randint(0, 3, (1,), generator=g).to(device)
            if gates:  # a and b, strided views of the projection's [b | a] per key head
                ba = _rand((1, 1, HK, 2 * group), g, device, dtype, 3.0)
                beta, decay = ba[..., :group], ba[..., group:]
            else:
                decay = -torch.rand(1, 1, H, generator=g).to(device)
                beta = torch.rand(1, 1, H, generator=g).to(device=device, dtype=dtype)
            if strided:  # views of the convolution's output, its last column transposed, as Qwen3-Next's graph has
                conv = _rand((1, 2 * HK * DK + H * DV, 5), g, device, dtype)[:, :, -1:].transpose(1, 2)
                q, k, v = torch.split(conv, [HK * DK, HK * DK, H * DV], dim=-1)
                return (q.reshape(1, 1, HK, DK), k.reshape(1, 1, HK, DK), v.reshape(1, 1, H, DV), decay, beta, pos)
            return (_rand((1, 1, HK, DK), g, device, dtype), _rand((1, 1, HK, DK), g, device, dtype),
                    _rand((1, 1, H, DV), g, device, dtype), decay, beta, pos)

        opts = dict(_options(), gated_delta_block_v=bv)
        gone = ("aten.repeat_interleave.self_int",) * (group > 1) + \
            ("aten.sigmoid.default", "aten.softplus.default", "aten.exp.default") * gates
        name = f"gated_delta[{H}/{HK}x{DK}x{DV}, block_v={bv}{', gates' if gates else ''}]"
        rows += run_case(name, Region(fn, t), make, "tkcc.gated_delta.default", False, dtype, opts, state=("state",),
                         gone=gone)
    return rows


def check_causal_conv(device, dtype, g, shapes=((40, 4, True, "silu", 16), (300, 4, False, "silu", 128),
                                                (64, 3, True, "", 64))):
    """A short causal convolution's decode step over its [2, B, C, K] window double buffer (tkcc's update_conv_state,
    then transformers' causal_conv1d_fn and the slice to the token): both slots, position 0 (a fresh sequence
    reads zeros), one and several channel blocks, with and without a bias and the SiLU: (C, K, bias, act,
    block_c)."""
    from tkcc.kernels.causal_conv import causal_conv_step
    from tkcc.passes.lower.checks import Region, _options, _rand, run_case

    rows = []
    for C, K, bias, act, bc in shapes:
        t = {"state": _rand((2, 1, C, K), g, device, dtype), "w": _rand((C, K), g, device, dtype, 0.5)}
        if bias:
            t["b"] = _rand((C,), g, device, dtype, 0.5)

        def fn(s, x, pos, act=act, bias=bias):
            return causal_conv_step(x, s.state, s.w, s.b if bias else None, pos, act)[0]

        def make(C=C):
            pos = torch.randint(0, 3, (1,), generator=g).to(device)
            return _rand((1, 1, C), g, device, dtype).transpose(1, 2), pos

        opts = dict(_options(), causal_conv_block_c=bc)
        rows += run_case(f"causal_conv[{C}x{K}{', bias' if bias else ''}{', ' + act if act else ''}, block_c={bc}]",
                         Region(fn, t), make, "tkcc.causal_conv.default", False, dtype, opts, state=("state",))
    return rows


def check_rotary(device, dtype, g, shapes=((4, 2, 16, 40, 16, 8, 0), (4, 4, 32, 64, 64, 16, 0), (8, 1, 16, 100, 16, 16, 24),
                                          (4, 2, 32, 300, 16, 8, 0), (2, 1, 64, 48, 16, 32, 10))):
    """The fused attention under the partial and interleaved rotations (with and without q/k norms, scaled
    tables, one and several splits, sliding windows): (hq, hkv, D, S, chunk, rotary dim, window)."""
    from tkcc.passes.lower import attention, rotary
    from tkcc.passes.lower.checks import Region, _options, attention_case, run_case

    rows = []
    for i, (hq, hkv, D, S, chunk, R, window) in enumerate(shapes):
        for j, (kind, qk_norm) in enumerate((("partial", ""), ("interleaved", "head"), ("partial", "full"),
                                             ("interleaved", ""))):
            rope = rotary.ROPES[kind][0]
            R_ = D if (kind == "interleaved" and (i + j) % 3 == 0) else R  # interleaved over the whole head too
            if kind == "interleaved" and R_ == D and j == 3:  # ... as Helium writes it, with no slices
                rope, kind = rotary.rope_interleaved_unsliced, "interleaved (unsliced)"
            rope_scale = 1.0 if (i + j) % 2 == 0 else 0.75
            pattern = attention._attention_pattern(qk_norm, rope)[0]
            t, fn, make = attention_case(pattern, hq, hkv, D, S, window, qk_norm, rope_scale, R_, g, device, dtype)
            name = f"attention[{hq}/{hkv}x{D}, S={S}, chunk={chunk}, {kind} rotary {R_}/{D}" \
                   f"{', ' + qk_norm + ' qk_norm' if qk_norm else ''}{', rope x0.75' if rope_scale != 1.0 else ''}" \
                   f"{f', window {window}' if window else ''}]"
            rows += run_case(name, Region(fn, t), make, "tkcc.attention_rope.default", False, dtype,
                             _options(chunk=chunk), state=("kc", "vc"))
        # Ernie 4.5: the interleaved pairs over the whole head, upcast and rotated by the fp32 table
        pattern = attention._attention_pattern("", rotary.rope_interleaved_fp32)[0]
        rope_scale = 1.0 if i % 2 == 0 else 0.75
        t, fn, make = attention_case(pattern, hq, hkv, D, S, window, "", rope_scale, D, g, device, dtype,
                                     table_dtype=torch.float32)
        rows += run_case(f"attention[{hq}/{hkv}x{D}, S={S}, chunk={chunk}, interleaved rotary in fp32 by an fp32 "
                         f"table{', rope x0.75' if rope_scale != 1.0 else ''}{f', window {window}' if window else ''}]",
                         Region(fn, t), make, "tkcc.attention_rope.default", False, dtype, _options(chunk=chunk),
                         state=("kc", "vc"))
        # OLMo 2: [q/k norms over the whole projection, w * norm(x) in fp32 rounded once,] rotate-half by the fp32 table
        qk_norm = "full_fp32" if i % 2 == 0 else ""
        pattern = attention._attention_pattern(qk_norm, rotary.rope_half_fp32)[0]
        t, fn, make = attention_case(pattern, hq, hkv, D, S, window, qk_norm, rope_scale, D, g, device, dtype,
                                     table_dtype=torch.float32)
        rows += run_case(f"attention[{hq}/{hkv}x{D}, S={S}, chunk={chunk}, rotate-half in fp32 by an fp32 table"
                         f"{', fp32 full qk_norm' if qk_norm else ''}{', rope x0.75' if rope_scale != 1.0 else ''}"
                         f"{f', window {window}' if window else ''}]",
                         Region(fn, t), make, "tkcc.attention_rope.default", False, dtype, _options(chunk=chunk),
                         state=("kc", "vc"))
    return rows


def sink_region(hq, hkv, D, S, window, rope_scale, g, device, dtype, rope="chunked"):
    """(tensors, fn, make) of gpt-oss's attention block as its code writes it: the rotary table over half the head
    (``rotary.cos_sin_half``; ``rope="partial"``: MiMo-V2's table over the first half of the head, rotate-half),
    the step's boolean mask made additive as ``eager_mask`` does, the packed q|k|v (biases already added), the
    chunked rotation, the cache write and the eager attention with per-head sink logits."""
    from tkcc.passes.lower import attention, rotary
    from tkcc.passes.lower.checks import _rand, step_mask

    R = D if rope == "chunked" else D // 2
    t = {"kc": _rand((1, hkv, S, D), g, device, dtype), "vc": _rand((1, hkv, S, D), g, device, dtype),
         "inv_freq": 1.0 / (150000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R)).to(device),
         "sinks": _rand((hq,), g, device, dtype, 2.0)}
    table = rotary.cos_sin_half if rope == "chunked" else rotary.cos_sin
    pattern = attention._attention_pattern("", rotary.rope_chunked if rope == "chunked" else rotary.rope_partial,
                                           sinks=True)[0]

    def fn(s, qkv, pos):
        cos, sin = table(s.inv_freq, pos.unsqueeze(0), scale=rope_scale, dtype=qkv.dtype)
        mask = step_mask(pos, S, window)
        mask = torch.where(mask, torch.tensor(0.0, device=mask.device, dtype=qkv.dtype), torch.finfo(qkv.dtype).min)
        return pattern(qkv, s.kc, s.vc, pos, cos, sin, mask, s.sinks, scale=D ** -0.5)

    def make():
        pos = torch.randint(0, S, (1,), generator=g).to(device)
        return _rand((1, 1, (hq + 2 * hkv) * D), g, device, dtype), pos

    return t, fn, make


def check_sink_attention(device, dtype, g, shapes=((4, 2, 16, 40, 16, 0), (4, 4, 32, 64, 64, 12), (8, 1, 16, 100, 16, 24),
                                                   (4, 2, 16, 300, 16, 8), (2, 1, 64, 48, 16, 0))):
    """The sink attention rewrites (gpt-oss's chunked rotation over its half table, a partial rotate-half one) against
    the block run eagerly: GQA, MHA, MQA, one split and several (the fourth shape: more than the kernel merges),
    YaRN-scaled tables, causal and sliding-window masks: (hq, hkv, D, S, chunk, window)."""
    from tkcc.passes.lower.checks import Region, _options, run_case

    rows = []
    for i, (hq, hkv, D, S, chunk, window) in enumerate(shapes):
        for rope in ("chunked",) + (("partial",) if i % 2 else ()):
            rope_scale = 1.0 if i % 2 == 0 else 1.3465735902799727
            t, fn, make = sink_region(hq, hkv, D, S, window, rope_scale, g, device, dtype, rope)
            name = f"attention[{hq}/{hkv}x{D}, S={S}, chunk={chunk}, sinks, {rope} rotary" \
                   f"{f', rope x{rope_scale:.3f}' if rope_scale != 1.0 else ''}{f', window {window}' if window else ''}]"
            rows += run_case(name, Region(fn, t), make, "tkcc.attention_rope.default", False, dtype,
                             _options(chunk=chunk), state=("kc", "vc"))
    return rows


def check_gemma_qk_norm(device, dtype, g, shapes=((4, 2, 16, 40, 16, 0), (4, 4, 32, 64, 64, 12), (8, 1, 16, 100, 16, 24),
                                                  (4, 2, 16, 300, 16, 0), (2, 1, 64, 48, 16, 10))):
    """The fused attention with Gemma 3's per-head q/k norms (``norm(x) * (1 + w)`` in fp32, on the transposed
    heads), rotate-half rotary, causal and sliding masks, one split and several: (hq, hkv, D, S, chunk, window)."""
    from tkcc.passes.lower import attention, rotary
    from tkcc.passes.lower.checks import Region, _options, _rand, run_case, step_mask

    rows = []
    pattern = attention._attention_pattern("head_offset")[0]
    for hq, hkv, D, S, chunk, window in shapes:
        t = {"kc": _rand((1, hkv, S, D), g, device, dtype), "vc": _rand((1, hkv, S, D), g, device, dtype),
             "inv_freq": 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)).to(device),
             "qn": _rand((D,), g, device, dtype, 0.5), "kn": _rand((D,), g, device, dtype, 0.5)}

        def fn(s, qkv, pos, S=S, window=window, D=D):
            cos, sin = rotary.cos_sin(s.inv_freq, pos.unsqueeze(0), scale=1.0, dtype=qkv.dtype)
            mask = step_mask(pos, S, window)
            return pattern(qkv, s.kc, s.vc, pos, cos, sin, mask, s.qn, s.kn, scale=D ** -0.5, eps=1e-6, offset=1.0)

        def make(S=S, hq=hq, hkv=hkv, D=D):
            pos = torch.randint(0, S, (1,), generator=g).to(device)
            return _rand((1, 1, (hq + 2 * hkv) * D), g, device, dtype, 2.0), pos

        name = f"attention[{hq}/{hkv}x{D}, S={S}, chunk={chunk}, gemma head qk_norm{f', window {window}' if window else ''}]"
        rows += run_case(name, Region(fn, t), make, "tkcc.attention_rope.default", False, dtype, _options(chunk=chunk),
                         state=("kc", "vc"))
    return rows


def check_gated_attention(device, dtype, g, shapes=((4, 2, 16, 40, 16, 4), (4, 4, 32, 64, 64, 32), (8, 1, 16, 100, 16, 8),
                                                    (4, 2, 16, 300, 16, 4), (2, 1, 64, 48, 16, 16))):
    """Qwen3-Next's gated attention (``attention._attention_pattern("head_offset_view", rope_partial, gated=True)``):
    a gate after each q head of the projection, (1 + w) q/k norms per head before the transpose, a partial rotary
    (a quarter of the head) or one over the whole head, the output times sigmoid(gate); GQA, MHA, MQA, one split,
    several, more than the kernel merges (the fourth): (hq, hkv, D, S, chunk, rotary dim)."""
    from tkcc.passes.lower import attention, rotary
    from tkcc.passes.lower.checks import Region, _options, _rand, run_case, step_mask

    rows = []
    pattern = attention._attention_pattern("head_offset_view", rotary.rope_partial, gated=True)[0]
    for hq, hkv, D, S, chunk, R in shapes:
        t = {"kc": _rand((1, hkv, S, D), g, device, dtype), "vc": _rand((1, hkv, S, D), g, device, dtype),
             "inv_freq": 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R)).to(device),
             "qn": _rand((D,), g, device, dtype, 0.5), "kn": _rand((D,), g, device, dtype, 0.5)}

        def fn(s, qkv, pos, S=S, D=D):
            cos, sin = rotary.cos_sin(s.inv_freq, pos.unsqueeze(0), scale=1.0, dtype=qkv.dtype)
            return pattern(qkv, s.kc, s.vc, pos, cos, sin, step_mask(pos, S), s.qn, s.kn, scale=D ** -0.5, eps=1e-6,
                           offset=1.0)

        def make(S=S, hq=hq, hkv=hkv, D=D):
            pos = torch.randint(0, S, (1,), generator=g).to(device)
            return _rand((1, 1, (2 * hq + 2 * hkv) * D), g, device, dtype, 2.0), pos

        rows += run_case(f"attention[{hq}/{hkv}x{D}, S={S}, chunk={chunk}, gated q, rotary {R}]", Region(fn, t), make,
                         "tkcc.attention_rope.default", False, dtype, _options(chunk=chunk), state=("kc", "vc"),
                         gone=("aten.scaled_dot_product_attention.default", "aten.pow.Tensor_Scalar"))
    return rows


def check_q_scaled_attention(device, dtype, g, shapes=((4, 16, 40, 16, 0, 1.0), (4, 32, 64, 64, 12, 1.0),
                                                       (2, 64, 300, 16, 0, 1.0), (8, 32, 100, 16, 24, 0.5))):
    """OPT's attention block (``attention_plain._pattern("q_scaled")``): q times 1/sqrt(D) before the heads (at D 32
    and 64 not a power of two: its rounding shows), sdpa at ``scale`` (OPT's 1, and one other); one split, several,
    more than the kernel merges (the third), sliding windows: (heads, D, S, chunk, window, scale)."""
    from tkcc.passes.lower import attention_plain
    from tkcc.passes.lower.checks import Region, _options, attention_case, run_case, step_mask

    rows = []
    pattern = attention_plain._pattern("q_scaled")
    for h, D, S, chunk, window, scale in shapes:
        t, _fn, make = attention_case(None, h, h, D, S, window, "", 1.0, D, g, device, dtype)

        def fn(s, qkv, pos, S=S, D=D, window=window, scale=scale):
            return pattern(qkv, s.kc, s.vc, pos, step_mask(pos, S, window), scale=scale, q_scale=D ** -0.5)

        rows += run_case(f"attention[{h}/{h}x{D}, S={S}, chunk={chunk}, q scaled, no rotary, scale {scale}"
                         f"{f', window {window}' if window else ''}]", Region(fn, t), make,
                         "tkcc.attention_rope.default", False, dtype, _options(chunk=chunk), state=("kc", "vc"),
                         gone=("aten.mul.Tensor", "aten.scaled_dot_product_attention.default"))
    return rows


def bloom_alibi(attention_mask, num_heads: int, dtype):
    """transformers' ``build_alibi_tensor`` (BLOOM), as its code computes it: slopes of a power-of-two base (and the
    interleaved extra ones past the largest power of two below ``num_heads``) times the positions of the mask."""
    import math

    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), device=attention_mask.device,
                      dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, device=attention_mask.device, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    if closest_power_of_2 != num_heads:
        extra_base = torch.full((), 2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))),
                                device=attention_mask.device, dtype=torch.float32)
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining_heads, 2, device=attention_mask.device, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def check_alibi_attention(device, dtype, g, shapes=((4, 16, 40, 16, 0, 1.0), (6, 32, 64, 64, 12, 1.0),
                                                    (2, 64, 300, 16, 0, 1.0), (12, 16, 100, 16, 24, 0.5))):
    """BLOOM's ALiBi attention block (``attention_plain.alibi_attention``) with its bias built from the all-ones mask
    over the cache (``bloom_alibi``: power-of-two heads and not, whose slopes are a ``cat`` of two bases), the additive
    causal or sliding mask, baddbmm at beta 1 (BLOOM's) and another; one split, several, more than the kernel merges
    (the third): (heads, D, S, chunk, window, beta)."""
    from tkcc.passes.lower import attention_plain
    from tkcc.passes.lower.checks import Region, _options, attention_case, run_case, step_mask

    rows = []
    for h, D, S, chunk, window, beta in shapes:
        t, _fn, make = attention_case(None, h, h, D, S, window, "", 1.0, D, g, device, dtype)

        def fn(s, qkv, pos, S=S, D=D, h=h, window=window, beta=beta):
            alibi = bloom_alibi(torch.ones(1, S, dtype=torch.int64, device=qkv.device), h, qkv.dtype)
            mask = step_mask(pos, S, window)
            mask = torch.where(mask, torch.tensor(0.0, device=mask.device, dtype=qkv.dtype), torch.finfo(qkv.dtype).min)
            return attention_plain.alibi_attention(qkv, s.kc, s.vc, pos, mask, alibi, scale=D ** -0.5, beta=beta)

        rows += run_case(f"attention[{h}/{h}x{D}, S={S}, chunk={chunk}, alibi, beta {beta}, no rotary"
                         f"{f', window {window}' if window else ''}]", Region(fn, t), make,
                         "tkcc.attention_rope.default", False, dtype, _options(chunk=chunk), state=("kc", "vc"),
                         gone=("aten.baddbmm.default", "aten.bmm.default", "aten.softmax.int",
                               "aten.cumsum.default", "aten.pow.Tensor_Tensor"))
    return rows


def check_cohere(device, dtype, g, shapes=((4, 2, 16, 40, 16, 0, 48), (4, 4, 32, 64, 64, 12, 200),
                                           (8, 1, 16, 100, 16, 24, 2048), (4, 2, 16, 300, 16, 8, 64),
                                           (2, 1, 64, 48, 16, 0, 1000))):
    """Cohere's attention block (its own ``repeat_interleave``d table in the activations' dtype, the interleaved pairs
    rotated in fp32: ``rotary.cos_sin_interleaved``, ``rotary.rope_interleaved_upcast``) over GQA, MHA and MQA, one
    split and several (the fourth shape: more than the kernel merges), scaled tables, sliding windows; and its
    LayerNorm written out in fp32 (``norms.layer_norm_two_pass``): (hq, hkv, D, S, chunk, window, norm width)."""
    from tkcc.passes.lower import attention, norms, rotary
    from tkcc.passes.lower.checks import Region, _options, _rand, attention_case, run_case

    rows = []
    pattern = attention._attention_pattern("", rotary.rope_interleaved_upcast)[0]
    for i, (hq, hkv, D, S, chunk, window, H) in enumerate(shapes):
        rope_scale = 1.0 if i % 2 == 0 else 0.75
        t, fn, make = attention_case(pattern, hq, hkv, D, S, window, "", rope_scale, D, g, device, dtype,
                                     table=rotary.cos_sin_interleaved)
        name = f"attention[{hq}/{hkv}x{D}, S={S}, chunk={chunk}, interleaved rotary in fp32 by an interleaved table" \
               f"{', rope x0.75' if rope_scale != 1.0 else ''}{f', window {window}' if window else ''}]"
        rows += run_case(name, Region(fn, t), make, "tkcc.attention_rope.default", False, dtype, _options(chunk=chunk),
                         state=("kc", "vc"))
        w = _rand((H,), g, device, dtype, 0.5) + 1
        rows += run_case(f"layer_norm_two_pass[{H}]",
                         Region(lambda s, x: norms.layer_norm_two_pass(x, s.w, eps=1e-5), {"w": w}),
                         lambda H=H: (_rand((1, 1, H), g, device, dtype, 2.0) + 0.5,), "tkcc.layer_norm.default",
                         False, dtype)
    return rows


def check_gated_norm(device, dtype, g, shapes=((2, 2, 16), (4, 1, 48), (1, 4, 128), (3, 2, 200))):
    """Qwen3-Next's gated RMSNorm after its gated delta rule (``norms.rms_norm_gated_grouped``): z a strided per-key-
    head slice of a wider projection (read in place by the kernel), and (``norms.rms_norm_gated``) z given as rows,
    over head dims a block covers and one it does not: (key heads, value heads per key head, head dim); MiniMax's
    ``sigmoid(g) * norm(x)`` (``norms.rms_norm_sigmoid_gated``), g a slice of its projection."""
    from tkcc.passes.lower import norms
    from tkcc.passes.lower.checks import Region, _rand, run_case

    rows = []
    for HK, r, D in shapes:
        w = _rand((D,), g, device, dtype, 0.5) + 1

        def grouped(HK=HK, r=r, D=D):  # [q | k | v | z] per key head, z the last r * D columns
            proj = _rand((1, 1, HK, 2 * 16 + 2 * r * D), g, device, dtype, 2.0)
            return _rand((HK * r, D), g, device, dtype), proj[..., 32 + r * D:]

        rows += run_case(f"rms_norm_gated[{HK}x{r}x{D}, grouped z in place]",
                         Region(lambda s, x, z: norms.rms_norm_gated_grouped(x, s.w, z, eps=1e-6), {"w": w}), grouped,
                         "tkcc.rms_norm.default", False, dtype, gone=("aten.silu.default", "aten.reshape.default"))
        rows += run_case(f"rms_norm_gated[{HK}x{r}x{D}, z as rows]",
                         Region(lambda s, x, z: norms.rms_norm_gated(x, s.w, z, eps=1e-6), {"w": w}),
                         lambda HK=HK, r=r, D=D: (_rand((HK * r, D), g, device, dtype),
                                                  _rand((HK * r, D), g, device, dtype, 2.0)),
                         "tkcc.rms_norm.default", False, dtype, gone=("aten.silu.default",))
        # MiniMax's: sigmoid(g) * norm(x), g a strided slice of a projection (its output gate's, read in place)
        rows += run_case(f"rms_norm_gated[sigmoid, {HK * r}x{D}, g a slice of a projection]",
                         Region(lambda s, x, g: norms.rms_norm_sigmoid_gated(x, s.w, g, eps=1e-6), {"w": w}),
                         lambda HK=HK, r=r, D=D: (_rand((1, HK * r, D), g, device, dtype),
                                                  _rand((1, HK * r, 4 * D), g, device, dtype, 2.0)[..., 3 * D:]),
                         "tkcc.rms_norm.default", False, dtype, gone=("aten.sigmoid.default", "aten.mul.Tensor"))
    return rows


FAMILIES = {"linear_attention": check_linear_attention, "gated_delta": check_gated_delta,
            "causal_conv": check_causal_conv, "rotary": check_rotary, "sinks": check_sink_attention,
            "gemma_qk_norm": check_gemma_qk_norm, "cohere": check_cohere,
            "gated_norm": check_gated_norm, "gated_attention": check_gated_attention,
            "q_scaled_attention": check_q_scaled_attention, "alibi_attention": check_alibi_attention}
