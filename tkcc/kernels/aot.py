"""Compile every kernel variant ahead of time for a GPU target, with no GPU present.

The Triton interpreter is lenient about types; the real compiler is not. This
renders each template variant the decode kernels use and compiles it for
``sm_90`` (or another target), returning per-kernel register/shared-memory
use and spills, so a broken kernel is caught before any device time is spent.
"""
from __future__ import annotations

from tkcc.kernels.render import load

# (template, hooks, kernel name, signature, constexprs)
_P = "*bf16"


def variants():
    return _variants(False) + [x for x in _variants(True) if x[0] != "gemv.py.jinja"]


def _variants(pdl):
    v = []
    base = {"x_ptr": _P, "w_ptr": _P, "y_ptr": _P, "nw_ptr": _P, "res_ptr": _P, "N": "i32", "K": "i32",
            "stride_wn": "i32", "eps": "fp32"}
    blocks = {"BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "EVEN_K": "constexpr", "FULL_K": "constexpr"}
    for norm, gated, res in ((True, False, False), (False, False, True), (True, True, False)):
        for gpdl, bk in ((False, 512), (True, 2048)) if not pdl else ():
            v.append(("gemv.py.jinja", dict(norm=norm, gated=gated, residual=res, pdl=gpdl, gather=False, argmax=False),
                      "gemv_kernel", {**base, **blocks},
                      dict(BLOCK_N=4, BLOCK_K=bk, EVEN_K=True, FULL_K=bk == 2048)))
    if not pdl:  # the decode step's two ends: layer 0's QKV (embedding gather), the lm_head (argmax)
        gather = {"idx_ptr": "*i64", "xout_ptr": _P, "stride_x": "i32"}
        amax = {"slots_ptr": "*i64", "count_ptr": "*i32", "tok_ptr": "*i64", "pos_ptr": "*i32", "seq_ptr": "*i32",
                "GROUP": "i32", "NSLOT": "constexpr"}
        for gpdl, bk in ((False, 512), (True, 2048)):
            for hook, extra in (("gather", gather), ("argmax", amax)):
                consts = dict(BLOCK_N=2, BLOCK_K=bk, EVEN_K=True, FULL_K=bk == 2048)
                if hook == "argmax":
                    consts["NSLOT"] = 256
                hooks = dict(norm=True, gated=False, residual=False, pdl=gpdl, gather=hook == "gather",
                             argmax=hook == "argmax")
                v.append(("gemv.py.jinja", hooks, "gemv_kernel", {**base, **extra, **blocks}, consts))
    route = dict(TOPK=8, E_PAD=64, NORM_TOPK=False, FORCED=False)
    sig = {"x_ptr": _P, "nw_ptr": _P, "logits_ptr": _P, "forced_ptr": "*i32", "w_ptr": _P, "act_ptr": _P, "I": "i32",
           "H": "i32", "E": "i32", "eps": "fp32", "stride_we": "i64", "stride_wn": "i32", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "TOPK": "constexpr", "E_PAD": "constexpr", "NORM_TOPK": "constexpr",
           "FORCED": "constexpr", "NORM": "constexpr", "EVEN_K": "constexpr"}
    for forced in (False, True):
        v.append(("moe.py.jinja", dict(pdl=pdl), "moe_gate_up_kernel", sig,
                  dict(route, FORCED=forced, BLOCK_N=4, BLOCK_K=512, NORM=True, EVEN_K=True)))
    sig = {"act_ptr": _P, "logits_ptr": _P, "forced_ptr": "*i32", "w_ptr": _P, "res_ptr": _P, "y_ptr": _P, "I": "i32",
           "H": "i32", "E": "i32", "stride_we": "i64", "stride_wn": "i32", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "TOPK": "constexpr", "E_PAD": "constexpr", "NORM_TOPK": "constexpr",
           "FORCED": "constexpr", "RESIDUAL": "constexpr", "EVEN_K": "constexpr"}
    for forced in (False, True):
        v.append(("moe.py.jinja", dict(pdl=pdl), "moe_down_kernel", sig,
                  dict(route, FORCED=forced, BLOCK_N=4, BLOCK_K=512, RESIDUAL=True, EVEN_K=True)))
    sig = {"q_ptr": _P, "k_ptr": _P, "v_ptr": _P, "out_ptr": _P, "po_ptr": "*fp32", "plse_ptr": "*fp32",
           "seqlen_ptr": "*i32", "qk_scale": "fp32", "chunk": "i32", "stride_kh": "i32", "stride_ks": "i32",
           "S_MAX": "i32", "SPLITS": "i32", "G": "constexpr", "G_PAD": "constexpr", "D": "constexpr",
           "BLOCK_S": "constexpr", "SINGLE": "constexpr"}
    for G, single in ((1, True), (4, False)):
        v.append(("attention.py.jinja", dict(pdl=pdl), "attn_partial_kernel", sig,
                  dict(G=G, G_PAD=16, D=128, BLOCK_S=64, SINGLE=single)))
    sig = {"po_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": _P, "seqlen_ptr": "*i32", "chunk": "i32",
           "SPLITS": "i32", "D": "constexpr", "BLOCK_SP": "constexpr"}
    v.append(("attention.py.jinja", dict(pdl=pdl), "attn_combine_kernel", sig, dict(D=128, BLOCK_SP=16)))
    sig = {"qkv_ptr": _P, "q_out_ptr": _P, "k_cache_ptr": _P, "v_cache_ptr": _P, "pos_ptr": "*i64",
           "inv_freq_ptr": "*fp32", "qn_ptr": _P, "kn_ptr": _P, "eps": "fp32", "stride_ch": "i32", "stride_cs": "i32",
           "S_MAX": "i32", "HQ": "i32", "HKV": "i32", "D": "constexpr", "HALF": "constexpr", "QK_NORM": "constexpr",
           "BLOCK_K": "constexpr"}
    for qk in (True, False):
        v.append(("rotary.py.jinja", dict(pdl=pdl), "qkv_rope_kernel", sig, dict(D=128, HALF=64, QK_NORM=qk, BLOCK_K=2048)))
    v += _routed_variants(pdl)
    sig = {"x_ptr": _P, "r_ptr": _P, "w_ptr": _P, "y_ptr": _P, "h_ptr": _P, "K": "i32", "eps": "fp32",
           "offset": "fp32", "BLOCK_K": "constexpr"}
    for res, cast_first in ((True, True), (False, True), (False, False)):
        v.append(("rmsnorm.py.jinja", dict(residual=res, cast_first=cast_first, gated=False), "rmsnorm_kernel", sig,
                  dict(BLOCK_K=2048)))
    v.append(("router.py.jinja", {}, "router_kernel", {"logits_ptr": _P, "ids_ptr": "*i64", "w_ptr": _P, "E": "i32",
                                                       "TOPK": "constexpr", "E_PAD": "constexpr",
                                                       "NORM_TOPK": "constexpr"},
              dict(TOPK=8, E_PAD=64, NORM_TOPK=True)))
    return v


def _routed_variants(pdl):
    """moe_routed.py.jinja and attention_rope.py.jinja at the olmoe-16l / llama-1b-16l shapes the decoder uses."""
    v = []
    sig = {"x_ptr": _P, "nw_ptr": _P, "w_ptr": _P, "logits_ptr": _P, "forced_ptr": "*i32", "ids_ptr": "*i32",
           "wts_ptr": "*fp32", "xn_ptr": _P, "count_ptr": "*i32", "E": "i32", "H": "i32", "stride_wn": "i32",
           "eps": "fp32", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "TOPK": "constexpr", "K_PAD": "constexpr",
           "E_PAD": "constexpr", "NORM_TOPK": "constexpr", "FORCED": "constexpr", "FULL_K": "constexpr"}
    for forced, full in ((False, True), (True, True), (False, False)):
        v.append(("moe_routed.py.jinja", dict(pdl=pdl), "router_topk_kernel", sig,
                  dict(BLOCK_N=2, BLOCK_K=2048 if full else 512, TOPK=8, K_PAD=8, E_PAD=64, NORM_TOPK=False,
                       FORCED=forced, FULL_K=full)))
    sig = {"xn_ptr": _P, "ids_ptr": "*i32", "w_ptr": _P, "act_ptr": _P, "I": "i32", "H": "i32", "stride_we": "i64",
           "stride_wn": "i32", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "FULL_K": "constexpr"}
    for bn, full in ((2, True), (4, True), (8, False)):
        v.append(("moe_routed.py.jinja", dict(pdl=pdl), "moe_gate_up_routed_kernel", sig,
                  dict(BLOCK_N=bn, BLOCK_K=2048 if full else 1024, FULL_K=full)))
    sig = {"act_ptr": _P, "ids_ptr": "*i32", "wts_ptr": "*fp32", "w_ptr": _P, "res_ptr": _P, "y_ptr": _P, "I": "i32",
           "H": "i32", "stride_we": "i64", "stride_wn": "i32", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "TOPK": "constexpr", "K_PAD": "constexpr", "RESIDUAL": "constexpr", "FULL_K": "constexpr"}
    for bn, full in ((1, True), (2, True), (4, False)):
        v.append(("moe_routed.py.jinja", dict(pdl=pdl), "moe_down_routed_kernel", sig,
                  dict(BLOCK_N=bn, BLOCK_K=1024 if full else 512, TOPK=8, K_PAD=8, RESIDUAL=True, FULL_K=full)))
    sig = {"qkv_ptr": _P, "k_ptr": _P, "v_ptr": _P, "out_ptr": _P, "po_ptr": "*fp32", "plse_ptr": "*fp32",
           "count_ptr": "*i32", "pos_ptr": "*i32", "inv_freq_ptr": "*fp32", "qn_ptr": _P, "kn_ptr": _P, "eps": "fp32",
           "qk_scale": "fp32", "chunk": "i32", "stride_kh": "i32", "stride_ks": "i32", "S_MAX": "i32", "SPLITS": "i32",
           "HQ": "i32", "HKV": "i32", "G": "constexpr", "G_PAD": "constexpr", "D": "constexpr", "HALF": "constexpr",
           "BLOCK_S": "constexpr", "BLOCK_Q": "constexpr", "QK_NORM": "constexpr", "SINGLE": "constexpr",
           "BLOCK_SP": "constexpr", "MERGE": "constexpr", "DYN": "constexpr"}
    # olmoe-16l (G=1, D=128, q/k norm), llama-1b-16l (G=4, D=64)
    # (and the attention tiles tune_step picks at the ends of its range: 32 positions for olmoe, 256 for llama)
    for G, D, qk, single, merge, bs in ((1, 128, True, True, True, 64), (1, 128, True, False, True, 64),
                                        (4, 64, False, False, True, 64), (4, 64, False, True, True, 64),
                                        (4, 64, False, False, False, 64), (1, 128, True, False, False, 32),
                                        (4, 64, False, True, True, 256)):
        v.append(("attention_rope.py.jinja", dict(pdl=pdl), "attn_rope_kernel", sig,
                  dict(G=G, G_PAD=16, D=D, HALF=D // 2, BLOCK_S=bs, BLOCK_Q=2048, QK_NORM=qk, SINGLE=single,
                       BLOCK_SP=16, MERGE=merge, DYN=False)))
    return v


def lowered_variants():
    """The hooks only the lowered decode step (``tkcc.kernels.lowered``) launches: GEMV bias and GELU epilogues, the
    activations over a non-gated up projection, the per-head q|k|v rows stored split, a scaled residual, a second one,
    scaled rotary / per-head q/k norm / sliding window / paired and fp32 rotations / a scaled q / ALiBi in the fused
    attention, the combine reading the position, the routed MoE on an input normed already, with fp32 routing
    weights, and under the grouped and the biased routers (also with the norm prologue), with a scaled residual; the
    gated DeltaNet step, the short convolution before it and the gated norm after (and MiniMax's, sigmoid-gated)."""
    out = []
    base = {"x_ptr": _P, "w_ptr": _P, "y_ptr": _P, "nw_ptr": _P, "res_ptr": _P, "N": "i32", "K": "i32",
            "stride_wn": "i32", "eps": "fp32"}
    blocks = {"BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "EVEN_K": "constexpr", "FULL_K": "constexpr"}
    for act, bias, pdl in (("silu", True, True), ("gelu", False, True), ("gelu_tanh", True, False)):
        sig = {**base, **({"b_ptr": _P} if bias else {}), **blocks}
        out.append(("gemv.py.jinja", dict(norm=True, gated=True, residual=False, pdl=pdl, gather=False, argmax=False,
                                          bias=bias, act=act), "gemv_kernel", sig,
                    dict(BLOCK_N=4, BLOCK_K=2048 if pdl else 512, EVEN_K=True, FULL_K=pdl)))
    for up_act, bias, pdl in (("gelu", True, True), ("gelu_tanh", True, False), ("relu2", False, True)):
        sig = {**base, **({"b_ptr": _P} if bias else {}), **blocks}
        out.append(("gemv.py.jinja", dict(norm=False, gated=False, residual=False, pdl=pdl, gather=False, argmax=False,
                                          bias=bias, up_act=up_act), "gemv_kernel", sig,
                    dict(BLOCK_N=4, BLOCK_K=2048 if pdl else 512, EVEN_K=True, FULL_K=pdl)))
    for bias, pdl in ((True, True), (False, False)):  # per-head q|k|v rows stored as [q | k | v] (GPT-NeoX)
        sig = {**base, **({"b_ptr": _P} if bias else {}), "HEAD_D": "constexpr", **blocks}
        out.append(("gemv.py.jinja", dict(norm=False, gated=False, residual=False, pdl=pdl, gather=False, argmax=False,
                                          bias=bias, split_heads=True), "gemv_kernel", sig,
                    dict(HEAD_D=64, BLOCK_N=4, BLOCK_K=2048 if pdl else 512, EVEN_K=True, FULL_K=pdl)))
    for pdl in (True, False):  # MiniMax's projections before its residual, scaled first (h * alpha + y)
        out.append(("gemv.py.jinja", dict(norm=False, gated=False, residual=True, pdl=pdl, gather=False, argmax=False,
                                          res_scale=True), "gemv_kernel", {**base, "res_scale": "fp32", **blocks},
                    dict(BLOCK_N=4, BLOCK_K=2048 if pdl else 512, EVEN_K=True, FULL_K=pdl)))
    for pdl in (True, False):  # DeepSeek's shared down projection: + the routed experts' output, + the layer's residual
        out.append(("gemv.py.jinja", dict(norm=False, gated=False, residual=True, pdl=pdl, gather=False, argmax=False,
                                          residual2=True), "gemv_kernel", {**base, "res2_ptr": _P, **blocks},
                    dict(BLOCK_N=4, BLOCK_K=2048 if pdl else 512, EVEN_K=True, FULL_K=pdl)))
    sig = {**base, "b_ptr": _P, "idx_ptr": "*i64", "xout_ptr": _P, "stride_x": "i32", **blocks}
    out.append(("gemv.py.jinja", dict(norm=True, gated=False, residual=False, pdl=True, gather=True, argmax=False,
                                      bias=True), "gemv_kernel", sig, dict(BLOCK_N=2, BLOCK_K=2048, EVEN_K=True,
                                                                           FULL_K=True)))
    rope = [x for x in _routed_variants(True) if x[2] == "attn_rope_kernel"][0]
    for hooks, extra in ((dict(rope_scale=True), {"rope_scale": "fp32"}), (dict(head_norm=True), {}),
                         (dict(window=True), {"window": "i32"})):
        sig = {**rope[3], "pos_ptr": "*i64", **extra}
        out.append(("attention_rope.py.jinja", dict(pdl=True, **hooks), "attn_rope_kernel", sig,
                    dict(rope[4], QK_NORM="head_norm" in hooks, G=4, D=64, HALF=32)))
    # GLM's pairs; Ernie's, rotated in fp32; Cohere's, rotated in fp32 by the table rounded to the activations' dtype;
    # none (GPT-2's learned positions, NoPE layers: nothing paired)
    for hooks in (dict(pairs=True), dict(pairs=True, rope_fp32=True), dict(pairs=True, rope_fp32=True,
                                                                            rope_table_rounded=True),
                  dict(pairs=True, rope=False)):
        sig = {**rope[3], "pos_ptr": "*i64", "ROT_DIM": "constexpr", "INTERLEAVED": "constexpr"}
        out.append(("attention_rope.py.jinja", dict(pdl=True, **hooks), "attn_rope_kernel", sig,
                    dict(rope[4], QK_NORM=False, G=4, D=64, HALF=32, ROT_DIM=64 if hooks.get("rope", True) else 0,
                         INTERLEAVED=True)))
    # OPT's: nothing rotated, q scaled and rounded before the dot
    sig = {**rope[3], "pos_ptr": "*i64", "ROT_DIM": "constexpr", "INTERLEAVED": "constexpr", "q_scale": "fp32"}
    out.append(("attention_rope.py.jinja", dict(pdl=True, pairs=True, rope=False, q_scale=True), "attn_rope_kernel",
                sig, dict(rope[4], QK_NORM=False, G=1, D=64, HALF=32, ROT_DIM=0, INTERLEAVED=False)))
    # BLOOM's ALiBi: nothing rotated, slope_h * j added to each score, rounded as baddbmm rounds it (bloom-7b1's heads)
    sig = {**rope[3], "pos_ptr": "*i64", "ROT_DIM": "constexpr", "INTERLEAVED": "constexpr", "alibi_ptr": "*fp32",
           "alibi_beta": "fp32"}
    out.append(("attention_rope.py.jinja", dict(pdl=True, pairs=True, rope=False, alibi=True), "attn_rope_kernel",
                sig, dict(rope[4], QK_NORM=False, G=1, D=128, HALF=64, ROT_DIM=0, INTERLEAVED=False)))
    # Qwen3-Next's gated attention: a gate after each q head, (1 + w) per-head norms in fp32, a quarter of the head rotated
    sig = {**rope[3], "pos_ptr": "*i64", "ROT_DIM": "constexpr", "INTERLEAVED": "constexpr", "norm_offset": "fp32"}
    out.append(("attention_rope.py.jinja", dict(pdl=True, pairs=True, head_norm=True, norm_fp32=True, q_gated=True),
                "attn_rope_kernel", sig, dict(rope[4], QK_NORM=True, G=8, D=256, HALF=128, ROT_DIM=64,
                                              INTERLEAVED=False)))
    sig = {"po_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": _P, "seqlen_ptr": "*i64", "chunk": "i32",
           "SPLITS": "i32", "D": "constexpr", "BLOCK_SP": "constexpr"}
    out.append(("attention.py.jinja", dict(pdl=True, from_pos=True), "attn_combine_kernel", sig,
                dict(D=128, BLOCK_SP=64)))
    for x in _routed_variants(True):
        if x[2] == "router_topk_kernel" and not x[4]["FORCED"] and x[4]["FULL_K"]:
            out.append((x[0], dict(pdl=True, norm=False), x[2], x[3], x[4]))
            out.append((x[0], dict(pdl=True, fp32_weights=True), x[2], x[3], x[4]))
            out.append((x[0], dict(pdl=True, norm=False, grouped=True), x[2],
                        {**x[3], "logits_ptr": "*fp32", "bias_ptr": "*fp32", "scaling": "fp32", "NG": "constexpr",
                         "NG_PAD": "constexpr", "TOPK_GROUP": "constexpr"},
                        dict(x[4], NG=8, NG_PAD=8, TOPK_GROUP=4, NORM_TOPK=True)))
            out.append((x[0], dict(pdl=True, grouped=True), x[2],  # DeepSeek's, its post-attention norm as prologue
                        {**x[3], "logits_ptr": "*fp32", "bias_ptr": "*fp32", "scaling": "fp32", "NG": "constexpr",
                         "NG_PAD": "constexpr", "TOPK_GROUP": "constexpr"},
                        dict(x[4], NG=8, NG_PAD=8, TOPK_GROUP=4, NORM_TOPK=True)))
            out.append((x[0], dict(pdl=True, norm=False, logit_bias=True), x[2], {**x[3], "lb_ptr": _P},
                        dict(x[4], NORM_TOPK=True)))  # gpt-oss's router, its linear's bias in the epilogue
            for norm in (False, True):  # Ernie 4.5-MoE's router (its post-attention norm as the prologue, or not)
                out.append((x[0], dict(pdl=True, norm=norm, biased=True), x[2],
                            {**x[3], "logits_ptr": "*fp32", "bias_ptr": "*fp32", "norm_min": "fp32"},
                            dict(x[4], NORM_TOPK=True)))
        if x[2] == "moe_down_routed_kernel" and x[4]["FULL_K"]:
            out += _gptoss_experts()
            out.append((x[0], dict(pdl=True, fp32_weights=True), x[2], x[3], x[4]))
            # MiniMax's: the normed input scaled as the residual, after fp32 routing weights and after rounded ones
            sig = {k: v for k, v in x[3].items() if v != "constexpr"}
            sig = {**sig, "res_scale": "fp32", **{k: v for k, v in x[3].items() if v == "constexpr"}}
            out.append((x[0], dict(pdl=True, norm=False, fp32_weights=True, res_scale=True), x[2], sig, x[4]))
            out.append((x[0], dict(pdl=False, norm=False, res_scale=True), x[2], sig, x[4]))
            break
    # the gated DeltaNet step at Qwen3-Next's head dims (fp32 state, any strides of q / k / v): given g and beta, and
    # as Qwen3-Next's lowered step launches it, its 16 key heads over 32 value heads and its gates from a and b
    sig = {"q_ptr": _P, "k_ptr": _P, "v_ptr": _P, "g_ptr": "*fp32", "beta_ptr": _P, "alog_ptr": "*fp32",
           "dtb_ptr": "*fp32", "s_ptr": "*fp32", "out_ptr": _P, "pos_ptr": "*i64", "stride_slot": "i32",
           "stride_h": "i32", "sq": "i32", "eq": "i32", "sk": "i32", "ek": "i32", "sv": "i32", "ev": "i32", "sg": "i32",
           "eg": "i32", "sb": "i32", "eb": "i32", "DK": "constexpr", "DV": "constexpr", "BLOCK_V": "constexpr",
           "L2": "constexpr", "GROUP": "constexpr", "GATES": "constexpr"}
    gates = {**sig, "g_ptr": _P, "alog_ptr": _P, "dtb_ptr": _P}
    for pdl, bv, group, s in ((False, 32, 1, sig), (True, 64, 1, sig), (True, 64, 2, sig), (False, 32, 2, gates),
                              (True, 64, 2, gates)):
        out.append(("gated_delta.py.jinja", dict(pdl=pdl), "gated_delta_kernel", s,
                    dict(DK=128, DV=128, BLOCK_V=bv, L2=True, GROUP=group, GATES=s is gates)))
    # Qwen3-Next's gated norm after the delta rule: z read in place at its strides (2 value heads of 128 per key head)
    sig = {"x_ptr": _P, "r_ptr": _P, "w_ptr": _P, "y_ptr": _P, "h_ptr": _P, "K": "i32", "eps": "fp32",
           "offset": "fp32", "z_ptr": _P, "stride_z": "i32", "ZR": "i32", "BLOCK_K": "constexpr"}
    out.append(("rmsnorm.py.jinja", dict(residual=False, cast_first=True, gated=True), "rmsnorm_kernel", sig,
                dict(BLOCK_K=128)))
    # MiniMax's: the norm after its lightning attention times sigmoid of the output gate (a slice of a projection)
    out.append(("rmsnorm.py.jinja", dict(residual=False, cast_first=True, gated=True, gate_act="sigmoid"),
                "rmsnorm_kernel", sig, dict(BLOCK_K=2048)))
    # the short convolution over its cached window (Qwen3-Next: 8192 channels, kernel 4, no bias; Mamba2: a bias)
    sig = {"x_ptr": _P, "s_ptr": _P, "w_ptr": _P, "b_ptr": _P, "out_ptr": _P, "pos_ptr": "*i64", "C": "i32",
           "stride_x": "i32", "stride_slot": "i32", "K": "constexpr", "K_PAD": "constexpr", "BLOCK_C": "constexpr",
           "HAS_BIAS": "constexpr", "ACT": "constexpr"}
    for pdl, bias in ((False, False), (True, True)):
        out.append(("causal_conv.py.jinja", dict(pdl=pdl), "causal_conv_kernel", sig,
                    dict(K=4, K_PAD=4, BLOCK_C=128, HAS_BIAS=bias, ACT=1)))
    return out


def _gptoss_experts():
    """gpt-oss's transposed, biased experts (``moe_gptoss.py.jinja``) at gpt-oss-20b's shape's configs."""
    from tkcc.kernels.moe_gptoss import DOWN_CONFIGS, GATE_UP_CONFIGS

    out = []
    sig = {"xn_ptr": _P, "ids_ptr": "*i32", "w_ptr": _P, "b_ptr": _P, "act_ptr": _P, "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "I": "i32", "H": "i32", "KCH": "i32", "stride_we": "i64", "stride_wh": "i32",
           "stride_be": "i32", "alpha": "fp32", "limit": "fp32", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "TOPK": "constexpr", "SPLIT": "constexpr"}
    for bn, bk, split, _nw in GATE_UP_CONFIGS:
        out.append(("moe_gptoss.py.jinja", dict(pdl=True), "oss_gate_up_kernel", sig,
                    dict(BLOCK_N=bn, BLOCK_K=bk, TOPK=4, SPLIT=split)))
    sig = {"act_ptr": _P, "ids_ptr": "*i32", "wts_ptr": "*fp32", "w_ptr": _P, "b_ptr": _P, "y_ptr": _P,
           "part_ptr": "*fp32", "cnt_ptr": "*i32", "I": "i32", "H": "i32", "KCH": "i32", "stride_we": "i64",
           "stride_wi": "i32", "stride_be": "i32", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "TOPK": "constexpr", "SPLIT": "constexpr"}
    for bn, bk, split, _nw in DOWN_CONFIGS:
        out.append(("moe_gptoss.py.jinja", dict(pdl=True), "oss_down_kernel", sig,
                    dict(BLOCK_N=bn, BLOCK_K=bk, TOPK=4, SPLIT=split)))
    return out


def compile_all(arch: int = 90, warp_size: int = 32, templates=None, which=None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for tpl, hooks, kname, sig, consts in (which if which is not None else variants()):
        if templates and tpl not in templates:
            continue
        fn = getattr(load(tpl, **hooks), kname)
        # the JIT specialises pointers and ints divisible by 16 (what makes loads 16 bytes wide); do the same
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
                 if sig[n].startswith("*") or n in ("K", "N", "I", "H", "stride_wn", "stride_we", "stride_kh",
                                                    "stride_ks", "stride_ch", "stride_cs", "chunk", "stride_wh",
                                                    "stride_wi", "KCH")}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", arch, warp_size))
        md = k.metadata
        rows.append(dict(template=tpl, hooks=hooks, kernel=kname, consts={a: b for a, b in consts.items()},
                         shared=getattr(md, "shared", None), num_warps=getattr(md, "num_warps", None),
                         wide_loads=k.asm["ptx"].count(".v4.")))
    return rows


if __name__ == "__main__":
    for r in compile_all():
        print(r["kernel"], r["hooks"], {k: r[k] for k in ("shared", "wide_loads")})
