"""lowered_decode on families it was not written for (``lowered_families.FAMILIES``: gpt-oss, Phi-3, Gemma 2 and 3,
Qwen3 dense, Granite, StableLM, EXAONE 4, Helium, StarCoder2, Nemotron, GPT-NeoX, Falcon, Cohere and Cohere 2, OLMo 2,
Ernie 4.5-MoE, the hybrids Qwen3-Next and LFM2, OPT, BioGPT, BLOOM's ALiBi), by op pattern only.

CPU under the Triton interpreter (one subprocess: it must be on before triton is imported): the sink, Gemma q/k-norm
and Cohere rewrites against their patterns on fresh random inputs and several shapes with the kernels live; each
family captured and built through the lowered_decode plan into an artifact, holding exactly the kernel ops claimed
(counted by kind) and leaving in aten only what is listed, bit-exact with the captured step while the ops take their
references, and keeping its greedy tokens over a few steps with the kernels live. CPU in-process (the ops take
their references): gpt-oss's per-layer sinks and windows, and its bf16 graph bit-exact; the fp32 rotations of Ernie
4.5-MoE, OLMo 2 and Cohere in bf16. Bad input: a mask that is
not the step's, an ALiBi bias the kernel cannot compute, a context past the cache. GPU: the rewrites in bf16, greedy
through tkcc.compile.
"""
import json
import operator
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fake_clock import every_nth_fastest  # noqa: E402
from interp_proc import module_run  # noqa: E402
from lowered_families import FAMILIES, A, build, capture, op_counts, same_decode  # noqa: E402


INTERP_TEST = "test_kernels_and_greedy_with_the_kernels_live_under_the_interpreter"


@pytest.fixture(scope="module", autouse=True)
def interpreter_run(request):
    """The interpreter's subprocess, started with the module when its test is selected, so that it runs beside the
    in-process tests (the machine has 2 cores); its test, the module's last, collects it (interp_proc.py)."""
    yield from module_run(request, (INTERP_TEST,), [str(HERE / "interp_lowered_families.py"),
                                                   str(int(torch.randint(0, 1000, (1,))))])


def _lower(prog):
    from tkcc.passes.manager import apply_plan

    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    return new, logs[0].notes


def test_gpt_oss_attention_keeps_its_sinks_and_windows_per_layer():
    """Each layer's fused attention takes that layer's sink logits; the sliding layer its window, the full layer
    none; each MoE block becomes one ``tkcc.moe_gptoss`` reading that layer's router, experts and biases; nothing of
    the masks or the rotary table is left."""
    from tkcc.passes.lower.pattern import _all_args

    prog = capture("gpt-oss")
    new, notes = _lower(prog)
    gm = new.graphs["decode"]
    attn = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.tkcc.attention_rope.default]
    kinds = prog.model.config.layer_types
    assert len(attn) == len(kinds) == 2
    for i, (n, kind) in enumerate(zip(attn, kinds)):
        args = _all_args(n)
        assert args[20].op == "get_attr" and args[20].target == f"lm.model.layers.{i}.self_attn.sinks", args[20]
        assert args[11] == (prog.model.config.sliding_window if kind == "sliding_attention" else 0), (kind, args[11])
        assert args[17] is False and args[18] == 0 and args[19] is False  # no q/k norm; rotate-half over the head
    targets = {str(n.target) for n in gm.graph.nodes}
    assert not targets & {"tkcc.causal_mask.default", "tkcc.rotary_cos_sin.default", "aten.where.ScalarOther",
                          "aten.lift_fresh_copy.default", "aten.detach_.default", "aten.cat.default"}, targets
    moes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.tkcc.moe_gptoss.default]
    assert len(moes) == 2 and any("moe[gpt-oss" in n and "2 region(s) lowered" in n for n in notes), notes
    cfg = prog.model.config
    for i, n in enumerate(moes):
        args = _all_args(n)
        names = [a.target for a in args[:7] if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
        assert names == [f"lm.model.layers.{i}.mlp.{w}" for w in ("router.weight", "router.bias", "experts.gate_up_proj",
                                                                "experts.gate_up_proj_bias", "experts.down_proj",
                                                                "experts.down_proj_bias")], names
        experts = prog.model.model.layers[i].mlp.experts
        assert args[7] == cfg.num_experts_per_tok and (args[8], args[9]) == (experts.alpha, experts.limit), args[7:10]
    assert same_decode(prog, gm) is None


def test_gpt_oss_bf16_lowers_and_stays_bit_exact():
    """bf16 (the GPU dtype) has other casts: the RMSNorm's fp32 product, inv_freq cast with the model."""
    prog = capture("gpt-oss", torch.bfloat16)
    new, notes = _lower(prog)
    ops, _ = op_counts(new.graphs["decode"])
    assert ops == {"tkcc.attention_rope.default": 2, "tkcc.gemv.default": 5, "tkcc.rms_norm.default": 5,
                   "tkcc.moe_gptoss.default": 2}, notes[-1]
    assert same_decode(prog, new.graphs["decode"]) is None


@pytest.mark.parametrize("family", ["ernie4_5-moe", "olmo2", "cohere"])
def test_bf16_rotations_in_fp32_lower(family):
    """Cast to bf16, Ernie 4.5-MoE and OLMo 2 keep their rotary tables fp32 and rotate q and k in fp32 (the
    attention's ``rope_fp32``); Cohere rotates them in fp32 by its table rounded to bf16 (and ``rope_table_rounded``);
    OLMo 2's q/k norms are ``w * norm(x)`` in fp32 (``norm_offset`` 0 over the whole projection); Ernie's router
    chooses on the softmax plus a correction bias (``softmax_biased``). Every attention (and the MoE block) lowers.
    Off the kernel path the step is within bf16's rounding, not bit for bit: the packed q|k|v projection's CPU bf16
    matmul over all the rows can round a key differently from the k projection's own (it does for one of Ernie's, by
    5e-7). The fp32 step is bit-exact (the families test), and so is the rotation in bf16 (the next test)."""
    from tkcc.passes.lower.pattern import _all_args

    prog = capture(family, torch.bfloat16)
    new, notes = _lower(prog)
    ops, left = op_counts(new.graphs["decode"])
    want = FAMILIES[family][1]
    assert ops[A] == want[A] and ops.get("tkcc.moe.default") == want.get("tkcc.moe.default"), notes[-1]
    assert left <= FAMILIES[family][2], notes[-1]
    nodes = [n for n in new.graphs["decode"].graph.nodes if n.op == "call_function"]
    for a in [_all_args(n) for n in nodes if n.target is torch.ops.tkcc.attention_rope.default]:
        assert a[22] is True and a[23] is (family == "cohere"), a[17:]  # rope_fp32, rope_table_rounded
        if family == "olmo2":
            assert a[6] is not None and a[17] is False and a[21] == 0.0, a[17:]  # fp32 norms over the projection
        else:
            assert a[19] is True and a[6] is None, a[17:]  # interleaved, no q/k norm
    if family == "ernie4_5-moe":
        (moe,) = [n for n in nodes if n.target is torch.ops.tkcc.moe.default]
        args = _all_args(moe)
        assert args[12] == "softmax_biased" and args[18] == prog.model.config.moe_norm_min, args[12:]
    assert same_decode(prog, new.graphs["decode"], tol=1e-2) is None


@pytest.mark.parametrize("form", ["ernie", "olmo2", "olmo2-no-norm", "cohere"])
def test_fp32_rotation_is_bit_exact_off_the_kernels_in_bf16(form):
    """The attention under an fp32 rotation (q and k rotated in fp32, rounded back once: Ernie 4.5's interleaved pairs
    and OLMo 2's rotate-half after its fp32 q/k norms over the whole projection, by the table kept fp32; Cohere's
    interleaved pairs by its own interleaved table rounded to bf16) against its region, bit for bit in bf16 with the op
    on its reference: positions, GQA and MHA, a scaled table, a window."""
    from tkcc.passes.lower import attention, rotary
    from tkcc.passes.lower.checks import Region, _capture, _options, attention_case
    from tkcc.passes.lower.decode import lower

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    qk_norm = "full_fp32" if form == "olmo2" else ""
    ropes = {"ernie": rotary.rope_interleaved_fp32, "cohere": rotary.rope_interleaved_upcast}
    pattern = attention._attention_pattern(qk_norm, ropes.get(form, rotary.rope_half_fp32))[0]
    table = dict(table=rotary.cos_sin_interleaved) if form == "cohere" else dict(table_dtype=torch.float32)
    for hq, hkv, D, S, window, rope_scale in ((4, 2, 16, 32, 0, 1.0), (4, 4, 32, 64, 12, 0.75), (8, 1, 64, 40, 0, 1.0)):
        t, fn, make = attention_case(pattern, hq, hkv, D, S, window, qk_norm, rope_scale, D, g, "cpu", torch.bfloat16,
                                     **table)
        m = Region(fn, t)
        gm = _capture(m, make())
        info = lower(gm, torch.bfloat16, _options())
        lowered = "interleaved table]" if form == "cohere" else "fp32 table"
        assert any(lowered in n and "lowered" in n for n in info.notes), info.notes
        for _ in range(4):
            x = make()
            before = m.kc.clone()
            want, want_k = m(*x), m.kc.clone()
            m.kc.copy_(before)
            got = gm(*x)
            assert torch.equal(want, got) and torch.equal(want_k, m.kc), (hq, hkv, D, int(x[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_next_gates_and_key_heads_fold_into_the_gated_delta_op(dtype):
    """Each gated DeltaNet layer's gates (sigmoid; exp, softplus and their casts) and its ``repeat_interleave`` of q
    and k are gone from the lowered step: its tkcc.gated_delta reads the 2 key heads, the layer's own A_log and
    dt_bias, and a and b as the projection's strided per-key-head halves (no reshape's copy between). Off the kernel
    path the step is the captured one (bit for bit in fp32; within bf16's rounding in bf16, see the test above)."""
    from tkcc.passes.lower.pattern import _all_args

    prog = capture("qwen3-next", dtype)
    new, notes = _lower(prog)
    gm = new.graphs["decode"]
    assert any("gated_delta[l2 qk, qwen3-next gates, grouped heads]: 3 region(s) lowered" in n for n in notes), notes
    targets = {str(n.target) for n in gm.graph.nodes}
    assert not targets & {"aten.repeat_interleave.self_int", "aten.softplus.default", "aten.exp.default"}, targets
    cfg = prog.model.config
    group = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    deltas = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.tkcc.gated_delta.default]
    layers = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    assert len(deltas) == len(layers) == 3
    for i, n in zip(layers, deltas):
        args = _all_args(n)
        assert [a.meta["val"].shape[2] for a in args[:3]] == [cfg.linear_num_key_heads] * 2 + [cfg.linear_num_value_heads]
        assert [tuple(a.meta["val"].shape) for a in args[3:5]] == [(1, 1, cfg.linear_num_key_heads, group)] * 2
        assert [a.target for a in args[10:12]] == [f"lm.model.layers.{i}.linear_attn.{w}" for w in ("A_log", "dt_bias")]
        assert all(a.op == "call_function" and a.target is operator.getitem for a in args[3:5]), args[3:5]
    if dtype == torch.float32:
        assert same_decode(prog, gm) is None
    else:
        assert same_decode(prog, gm, tol=1e-2) is None


def _region_cases(dtype):
    """(rewrite name, region fn, its tensors, inputs maker) of every exact rewrite the families brought, in ``dtype``."""
    from tkcc.passes.lower import attention, rotary

    cases = []
    for S, window in ((24, 0), (40, 8), (100, 33)):
        def fn(s, pos, S=S, window=window):
            m = attention.sliding_mask(pos, kv_len=S, window=window) if window else attention.causal_mask(pos, kv_len=S)
            return torch.where(m, torch.tensor(0.0, device=m.device, dtype=dtype), torch.finfo(dtype).min)
        cases.append(("additive_mask", fn, {}, lambda S=S: (torch.randint(0, S, (1,)),)))
    # gpt-oss's half table and Cohere's, each frequency twice in place (widths whole vectors and not); inv_freq kept
    # in fp32, or cast with the model (in fp32 the two are one program: the first takes it)
    for kind, table, base, scale, widths, cast_width in (
            ("half", rotary.cos_sin_half, 150000, 1.3465735902799727, (8, 32), 16),
            ("interleaved", rotary.cos_sin_interleaved, 10000, 1.0, (16, 128, 22), 64)):
        for R, inv_dtype in tuple((R, torch.float32) for R in widths) + (
                ((cast_width, dtype),) if dtype != torch.float32 else ()):
            def fn(s, pos, table=table, scale=scale):
                return table(s.inv_freq, pos.unsqueeze(0), scale=scale, dtype=dtype)
            inv = (1.0 / (base ** (torch.arange(0, R, 2, dtype=torch.float32) / R))).to(inv_dtype)
            name = f"rotary_cos_sin[{kind} table]" if inv_dtype == torch.float32 else \
                f"rotary_cos_sin[{kind} table, inv_freq in the model dtype]"
            cases.append((name, fn, {"inv_freq": inv}, lambda: (torch.randint(0, 5000, (1,)),)))
    if dtype != torch.float32:  # Ernie 4.5 and OLMo 2 keep the table fp32 (in an fp32 graph it is rotary_cos_sin's)
        for R, inv_dtype in ((16, torch.float32), (64, dtype)):
            def fn(s, pos):
                return rotary.cos_sin_upcast(s.inv_freq, pos.unsqueeze(0), scale=1.0, dtype=torch.float32)
            inv = (1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))).to(inv_dtype)
            name = "rotary_cos_sin[kept fp32]" if inv_dtype == torch.float32 else \
                "rotary_cos_sin[inv_freq in the model dtype, upcast, kept fp32]"
            cases.append((name, fn, {"inv_freq": inv}, lambda: (torch.randint(0, 5000, (1,)),)))
    for n in (16, 96, 256):
        def fn(s, y):
            gate, up = y.chunk(2, dim=-1)
            return up * torch.nn.functional.silu(gate)
        cases.append(("canonical_gate[chunked, silu]", fn, {}, lambda n=n: (torch.randn(1, 1, 2 * n).to(dtype),)))
    from tkcc.passes.lower import attention_plain

    for H, D in ((4, 16), (6, 32)):  # BLOOM's per-head q|k|v selected out of a (B, T, H, 3, D) view
        def fn(s, y, H=H, D=D):
            return attention_plain.per_head_qkv_select(y, heads=H, head_dim=D)
        cases.append(("canonical_qkv_per_head[view (B, T, H, 3, D), select]", fn, {},
                      lambda H=H, D=D: (torch.randn(1, 1, 3 * H * D).to(dtype),)))
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_rewrites_are_bit_exact(dtype):
    """Each exact rewrite (the additive mask, gpt-oss's half table, Cohere's interleaved one, Phi-3's chunked gate) on
    fresh random inputs at several shapes: it lowers its region (the note says so) and the result is the region's, bit
    for bit."""
    from tkcc.passes.lower.checks import Region, _capture, _options
    from tkcc.passes.lower.decode import lower

    for name, fn, tensors, make in _region_cases(dtype):
        m = Region(fn, tensors)
        gm = _capture(m, make())
        info = lower(gm, dtype, _options())
        # (a table at scale 1, whose product canonicalize drops, is its twin's: at_one)
        assert any((f": {name}: " in n or f": {name}[scale 1]: " in n) and "lowered" in n for n in info.notes), \
            (name, info.notes)
        for _ in range(3):
            inputs = make()
            want, got = m(*inputs), gm(*inputs)
            want, got = (list(want), list(got)) if isinstance(want, tuple) else ([want], [got])
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(want, got)), name


# ---- bad input ---------------------------------------------------------------------------------------------------

def test_a_region_another_rewrite_lowers_is_not_logged_as_left_in_aten():
    """GPT-BigCode's up projection ends in a tanh-GELU: the exact GELU's GEMV pattern matches its ops and refuses it
    on the ``approximate`` literal, then the tanh-GELU's takes it. The pass log says it was lowered, and does not
    also say it was left in aten; a region no rewrite takes keeps its note (test_lowered.py's masked attention)."""
    prog = capture("gpt-bigcode")
    new, notes = _lower(prog)
    assert any("gemv[bias+gelu_tanh]: 2 region(s) lowered" in n for n in notes), notes
    assert not [n for n in notes if "region(s) left in aten" in n], notes
    ops, left = op_counts(new.graphs["decode"])
    assert "aten.gelu.default" not in left and ops["tkcc.gemv.default"] == 9


def test_a_mask_that_is_not_the_steps_is_refused_with_its_reason():
    """gpt-oss's attention block under an additive mask the graph takes as input (padding, a custom mask): the
    kernel attends causally, so the rewrite refuses the region, says why, and the region computes as captured."""
    from tkcc.passes.lower import attention, rotary
    from tkcc.passes.lower.checks import Region, _capture, _options
    from tkcc.passes.lower.decode import lower

    g = torch.Generator().manual_seed(0)
    hq, hkv, D, S = 4, 2, 16, 24
    t = {"kc": torch.randn(1, hkv, S, D, generator=g), "vc": torch.randn(1, hkv, S, D, generator=g),
         "inv_freq": 1.0 / (150000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)),
         "sinks": torch.randn(hq, generator=g)}
    pattern = attention._attention_pattern("", rotary.rope_chunked, sinks=True)[0]

    def fn(s, qkv, pos, mask):
        cos, sin = rotary.cos_sin_half(s.inv_freq, pos.unsqueeze(0), scale=1.0, dtype=qkv.dtype)
        return pattern(qkv, s.kc, s.vc, pos, cos, sin, mask, s.sinks, scale=D ** -0.5)

    m = Region(fn, t)
    mask = torch.zeros(1, 1, 1, S)
    mask[..., 3] = torch.finfo(torch.float32).min  # a padded position the causal mask would show
    inputs = (torch.randn(1, 1, (hq + 2 * hkv) * D, generator=g), torch.tensor([7]), mask)
    gm = _capture(m, inputs)
    info = lower(gm, torch.float32, _options())
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.tkcc.attention_rope.default]
    why = "not where(mask, 0"
    assert any("attention[gqa, sinks, chunked rotary]" in n and why in n for n in info.notes), info.notes
    kc, vc = m.kc.clone(), m.vc.clone()
    want = m(*inputs)
    m.kc.copy_(kc), m.vc.copy_(vc)
    assert torch.equal(gm(*inputs), want)


def test_an_alibi_bias_the_kernel_cannot_compute_is_refused_with_its_reason():
    """BLOOM's attention block under a bias that is not slope_h * j over the cache's positions, computed from
    constants: MPT's positions relative to the last (j - (S - 1)), and a bias the graph takes as input. The kernel
    adds slope_h * j itself, so the rewrite refuses each region, says why, and the region computes as captured."""
    from tkcc.passes.lower import attention_plain
    from tkcc.passes.lower.checks import Region, _capture, _options, step_mask
    from tkcc.passes.lower.checks_variants import bloom_alibi
    from tkcc.passes.lower.decode import lower

    g = torch.Generator().manual_seed(0)
    H, D, S = 4, 16, 24
    t = {"kc": torch.randn(1, H, S, D, generator=g), "vc": torch.randn(1, H, S, D, generator=g)}
    slopes = bloom_alibi(torch.ones(1, 2, dtype=torch.int64), H, torch.float32)[:, 0, 1]

    def relative(s, qkv, pos):
        alibi = (slopes[:, None] * torch.arange(1 - S, 1)).reshape(H, 1, S)
        mask = torch.where(step_mask(pos, S), torch.tensor(0.0), torch.finfo(torch.float32).min)
        return attention_plain.alibi_attention(qkv, s.kc, s.vc, pos, mask, alibi, scale=D ** -0.5, beta=1.0)

    def given(s, qkv, pos, alibi):
        mask = torch.where(step_mask(pos, S), torch.tensor(0.0), torch.finfo(torch.float32).min)
        return attention_plain.alibi_attention(qkv, s.kc, s.vc, pos, mask, alibi, scale=D ** -0.5, beta=1.0)

    qkv = torch.randn(1, 1, 3 * H * D, generator=g)
    for fn, inputs, why in ((relative, (qkv, torch.tensor([7])), "is not slope[h] * j over the cache's positions"),
                            (given, (qkv, torch.tensor([7]), torch.randn(H, 1, S, generator=g)),
                             "is not a constant of the step")):
        m = Region(fn, {k: v.clone() for k, v in t.items()})
        gm = _capture(m, inputs)
        info = lower(gm, torch.float32, _options())
        assert not [n for n in gm.graph.nodes if n.target is torch.ops.tkcc.attention_rope.default]
        assert any("attention[mha, alibi, no rotary]" in n and why in n for n in info.notes), info.notes
        kc, vc = m.kc.clone(), m.vc.clone()
        want = m(*inputs)
        m.kc.copy_(kc), m.vc.copy_(vc)
        assert torch.equal(gm(*inputs), want)


def test_a_context_past_the_cache_is_an_error():
    from tkcc.errors import TkccError

    prog = capture("gpt-oss", max_cache_len=16)
    new, _ = _lower(prog)
    inp = list(prog.inputs("decode"))
    inp[1] = torch.full_like(inp[1], 16)
    with pytest.raises(TkccError, match="longer than the static cache"):
        new.graphs["decode"](*inp)


def test_the_sink_check_detects_a_replacement_that_drops_the_sinks(monkeypatch):
    """The comparison can fail: the sink rewrite's replacement without its sink logits is caught."""
    from tkcc.passes.lower import pattern, rotary
    from tkcc.passes.lower.checks_variants import check_sink_attention

    rw = next(r for r in rotary.ATTENTION if r.name == "attention[gqa, sinks, chunked rotary]")
    good = rw.replacement
    monkeypatch.setattr(pattern, "_TRACES", dict(pattern._TRACES))  # the wrong replacement's traces go with the test

    def dropped(qkv, kc, vc, pos, cos, sin, mask, sinks, **kw):
        return good(qkv, kc, vc, pos, cos, sin, mask, torch.full_like(sinks, -1e4), **kw)

    monkeypatch.setattr(rw, "replacement", dropped)
    rows = check_sink_attention("cpu", torch.float32, torch.Generator().manual_seed(0), shapes=((4, 2, 16, 40, 16, 0),))
    assert rows and all(not r["ok"] and r["rel_err"] > 1e-2 for r in rows), rows


def test_kernels_and_greedy_with_the_kernels_live_under_the_interpreter(interpreter_run):
    lines = interpreter_run.lines()
    checks, families = lines[0], {r["family"]: r for r in lines[1:]}
    rows = checks["checks"]
    assert {r["dtype"].replace("torch.", "") for r in rows} == {"float32", "float16"}
    assert any("sinks, chunked" in r["case"] and "window" in r["case"] for r in rows), rows
    assert any("gemma" in r["case"] for r in rows) and any(r["case"].startswith("norm_offset_op") for r in rows)
    assert sum(r["case"].startswith("moe_gptoss configs") for r in rows) >= 5, rows
    for dt in ("float32", "float16"):  # Cohere's and Qwen3-Next's rewrites, Cohere's rounded table, in both dtypes
        for case in ("interleaved table", "layer_norm_two_pass", "rounded_table_op", "grouped z in place",
                     "gated q"):
            assert any(case in r["case"] and r["dtype"].endswith(dt) for r in rows), (case, dt)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, json.dumps(bad, indent=1)
    assert not [k for k in checks["fallbacks"] if k.startswith("tkcc.")], checks["fallbacks"]  # the kernels ran
    assert set(families) == set(FAMILIES), set(families)
    for name, r in families.items():
        _spec, want_ops, allowed = FAMILIES[name]
        assert r["ops"] == want_ops, r  # every region claimed lowered is, and nothing more
        assert set(r["left"]) <= allowed, (name, set(r["left"]) - allowed)
        assert r["inexact"] is None, r  # off the kernels, the lowered step is the captured one bit for bit
        assert r["got"] == r["ref"], r
        assert r["logits_rel_err"] < 1e-4, r
        assert not [k for k in r["fallbacks"] if k.startswith("tkcc.")], r


# ---- GPU -----------------------------------------------------------------------------------------------------------

# (their rewrites against their patterns in bf16: test_lowered_variants.py's GPU check, families sinks and
# gemma_qk_norm)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["gpt-oss", "phi3", "gemma3", "stablelm", "qwen3", "olmo2", "ernie4_5-moe", "cohere",
                                    "cohere2", "falcon", "gpt2", "gpt-bigcode", "smollm3", "bloom"])
def test_family_greedy_on_gpu_bf16(family, tmp_path):
    """Through the front door: the lowered step (PDL, replayed from the decode CUDA graph) keeps the captured
    graph's greedy tokens (the engine's tolerance-mode rule) over 32 steps."""
    import tkcc
    from greedy_rule import assert_greedy_agrees

    m = build(family, torch.bfloat16, seed=4).to("cuda")
    compiled = tkcc.compile(m, plan=[{"name": "lowered_decode", "params": {"tune": False}}], mode="tolerance",
                            measure=False, max_cache_len=256, out_dir=tmp_path, progress=False)
    assert compiled.serves == "artifact"
    src = compiled.artifact.source("decode")
    assert src.count("torch.ops.tkcc.attention_rope.default(") == 2, src
    assert_greedy_agrees(compiled, steps=32)


def test_gpt_neox_per_head_qkv_is_one_gemv_storing_the_split_layout_and_tunes_as_its_own_group():
    """GPT-NeoX's fused projection (rows per head: [q_h | k_h | v_h]) is one GEMV with ``split_heads`` whose output
    every layer's fused attention reads as [q | k | v]; the GEMV tuner (fake clock) groups it apart from the plain
    GEMVs of its shape and writes its config into the graph; the step stays bit-exact with the captured one."""
    from tkcc.kernels import gemv as gemv_mod
    from tkcc.passes.lower import tune

    prog = capture("gpt-neox")
    new, notes = _lower(prog)
    gm = new.graphs["decode"]
    d = prog.model.config.hidden_size // prog.model.config.num_attention_heads
    split = [n for n in gm.graph.nodes if n.target is torch.ops.tkcc.gemv.default and len(n.args) > 10 and n.args[10]]
    assert len(split) == prog.num_blocks and all(n.args[10] == d for n in split), notes
    assert all([u.target for u in n.users] == [torch.ops.tkcc.attention_rope.default] for n in split)
    assert any("qkv_per_head[bias]: 2 region(s) lowered" in n for n in notes), notes

    clock, _ = every_nth_fastest(len(gemv_mod.CONFIGS), 2)  # the 3rd config of every group is the fastest

    got = tune.tune_gemvs(gm, clock)
    heads = [k for k in got if "+heads" in k]
    assert len(heads) == 1 and got[heads[0]][2] == split, list(got)
    assert all(list(n.args[7]) == list(gemv_mod.CONFIGS[2]) for n in split)
    gm.recompile()
    assert same_decode(prog, gm) is None


def test_gpt_oss_moe_configs_tune_launch_by_launch_into_the_graph():
    """The MoE tuner takes gpt-oss's op too: each launch's config list in turn (router, gate_up, down), the fastest
    by the (fake) clock kept, and the one flat ``configs`` written into every ``moe_gptoss`` node of the graph."""
    from tkcc.kernels import moe_gptoss as mg, moe_routed as mr
    from tkcc.passes.lower import tune

    prog = capture("gpt-oss")
    new, _ = _lower(prog)
    gm = new.graphs["decode"]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.tkcc.moe_gptoss.default]
    parts = [(len(mr.ROUTER_CONFIGS), 1), (len(mg.GATE_UP_CONFIGS), 2), (len(mg.DOWN_CONFIGS), 1)]
    calls = []

    def clock(fn):  # the call's place in the three lists' trials says which config it times: fastest at `fast`
        fn()
        c = len(calls)
        calls.append(c)
        for n, fast in parts:
            if c < n:
                return 1.0 if c == fast else 2.0
            c -= n
        raise AssertionError("more trials than configs")

    got = tune.tune_moes(gm, clock)
    want = [*mr.ROUTER_CONFIGS[1], *mg.GATE_UP_CONFIGS[2], *mg.DOWN_CONFIGS[1]]
    assert len(calls) == sum(n for n, _ in parts) and set(got) == {"gptoss_router", "gptoss_gate_up", "gptoss_down"}
    assert len(nodes) == 2 and all(list(n.args[11]) == want for n in nodes), [n.args[11:] for n in nodes]
    gm.recompile()
    assert same_decode(prog, gm) is None


def test_granite_moe_router_top_k_then_softmax_lowers_within_rounding():
    """GraniteMoE's router (top-k of the fp32 logits, then a softmax over those k) picks the experts that a softmax,
    top-k and renormalisation picks, with the same weights up to fp32 rounding: its block lowers to ``tkcc.moe``
    (a rewrite that is not exact), and the lowered step stays within rounding of the captured one at every position
    (the ops take their references here; the interpreter check runs the kernel, ``checks.check_moe``)."""
    import transformers

    from tkcc.frontend.capture import capture as capture_module
    from lowered_families import SHAPE

    cfg = transformers.GraniteMoeConfig(**SHAPE, num_local_experts=8, num_experts_per_tok=2)
    cfg._attn_implementation, cfg._experts_implementation = "sdpa", "batched_mm"
    torch.manual_seed(0)
    model = transformers.GraniteMoeForCausalLM(cfg).float().eval()
    prog = capture_module(model, phases=["decode"], max_cache_len=32)
    new, notes = _lower(prog)
    ops, _ = op_counts(new.graphs["decode"])
    assert ops.get("tkcc.moe.default") == prog.num_blocks, notes
    assert any(n.startswith("decode: moe: moe[top-k then softmax") and "lowered" in n for n in notes), notes
    for p in (0, 9, 30):
        g = torch.Generator().manual_seed(p)
        inp = list(prog.inputs("decode", generator=g))
        inp[1] = torch.full_like(inp[1], p)
        for b in prog.state.buffers():
            b.copy_(torch.randn(b.shape, generator=g))
        saved = [b.clone() for b in prog.state.buffers()]
        ref = prog.graphs["decode"](*inp)
        for b, v in zip(prog.state.buffers(), saved):
            b.copy_(v)
        got = new.graphs["decode"](*inp)
        got = got[0] if isinstance(got, (tuple, list)) else got
        assert float((got - ref).norm() / ref.norm()) < 1e-5 and torch.equal(got.argmax(-1), ref.argmax(-1)), p
