"""lowered_decode beyond Llama/OLMoE: partial and interleaved rotary, attention sinks, OPT's q scaled before the
attention, BLOOM's ALiBi, MiniMax's linear-attention recurrence, and the MoE families (Mixtral, Qwen3-MoE,
Qwen2-MoE, MiniMax).

CPU: the kernels against their references under the Triton interpreter (fp32/fp16, fresh random inputs, several
shapes; in a subprocess: the interpreter must be on before triton is imported); each family's decode graph
lowered in-process, where the ops take their references, so the lowered step must be bit-exact with the
captured one; MiniMax's greedy tokens over 8 steps with the kernels live; bad input refused with its reason.
GPU: the same rewrites in bf16 and every family's greedy tokens through tkcc.compile.
"""
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tkcc.passes.lower.decode import VIEWS

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from interp_proc import module_run  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
INTERP_TESTS = ("test_kernels_match_their_references_under_the_interpreter",
                "test_greedy_tokens_identical_with_the_kernels_live")


@pytest.fixture(scope="module", autouse=True)
def interpreter_run(request):
    """The kernels against their references, then MiniMax's greedy tokens, every kernel live: one subprocess started
    with the module (interp_proc.py), read by the module's last tests."""
    yield from module_run(request, INTERP_TESTS, [str(HERE / "interp_variants_check.py"),
                                                  str(int(torch.randint(0, 1000, (1,)))), "minimax-tiny"])


def _ops(gm):
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _same_decode(prog, new, seeds=(1, 2, 3)):
    """Both decode graphs from the same state on fresh inputs: identical logits and state (KV caches and
    recurrent states). Positions 0 and 1 too: a fresh sequence and the other slot of a double buffer."""
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        inp = list(prog.inputs("decode", generator=g))
        if s <= 2:
            inp[1] = torch.full_like(inp[1], s - 1)
        for b in prog.state.buffers():
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
        saved = [b.clone() for b in prog.state.buffers()]
        ref = prog.graphs["decode"](*inp)
        ref_state = [b.clone() for b in prog.state.buffers()]
        for b, v in zip(prog.state.buffers(), saved):
            b.copy_(v)
        got = new.graphs["decode"](*inp)
        assert torch.equal(ref, got), float((ref.float() - got.float()).abs().max())
        assert all(torch.equal(a, b) for a, b in zip(ref_state, prog.state.buffers()))


def _lower(prog):
    from tkcc.passes.manager import apply_plan

    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    return new, _ops(new.graphs["decode"]), logs[0].notes


def _hf(cfg_cls, model_cls, **kw):
    import transformers

    from tkcc.frontend.capture import capture

    cfg = getattr(transformers, cfg_cls)(**{**SHAPE, **kw})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return capture(getattr(transformers, model_cls)(cfg).eval(), phases=["decode"], max_cache_len=32)


def test_minimax_lowers_linear_attention_and_moe_per_region():
    """MiniMax (hybrid): every lightning layer's recurrence -> tkcc.linear_attention (the state double buffer
    updated in place), every full-attention layer -> the fused attention, every MoE -> tkcc.moe; the residuals (the
    normed hidden state times alpha, plus the sublayer's output times 1) in the epilogues of the GEMV before them and
    of the MoE, the output gate's sigmoid in the norm before it: no aten arithmetic left but the embedding (its norm
    is also the residual, so no GEMV takes it); bit-exact off the kernels."""
    from tkcc.frontend.capture import capture_model
    from tkcc.passes.lower.pattern import _all_args

    prog = capture_model("minimax-tiny", "float32", "cpu", max_cache_len=32, phases=["decode"])
    kinds = prog.model.config.layer_types
    alpha = prog.model.config.full_attn_alpha_factor
    new, ops, notes = _lower(prog)
    assert ops["tkcc.linear_attention.default"] == kinds.count("linear_attention")
    assert ops["tkcc.attention_rope.default"] == kinds.count("full_attention")
    assert ops["tkcc.moe.default"] == len(kinds)
    left = {k for k in ops if not k.startswith("tkcc.") and k not in VIEWS}
    assert left == {"aten.embedding.default"}, left
    nodes = [n for n in new.graphs["decode"].graph.nodes if n.op == "call_function"]
    scales = [_all_args(n)[[a.name for a in n.target._schema.arguments].index("residual_scale")] for n in nodes
              if n.target in (torch.ops.tkcc.gemv.default, torch.ops.tkcc.moe.default)]
    assert sum(s == alpha for s in scales) == 2 * len(kinds) and alpha != 1.0, (scales, alpha)
    gates = [_all_args(n)[-1] for n in nodes if n.target is torch.ops.tkcc.rms_norm.default]
    assert gates.count("sigmoid") == kinds.count("linear_attention"), gates
    _same_decode(prog, new)


@pytest.mark.parametrize("family", ["phi3_partial", "glm_partial_interleaved", "glm_interleaved", "llama_yarn"])
def test_rotary_variants_are_fused_into_the_attention(family):
    """Real HF families' rotations, as their graphs carry them: Phi-3's partial rotary (its packed q|k|v sliced),
    GLM's interleaved pairs over half the head and over all of it, Llama with YaRN (its attention_scaling
    scales the table); each layer's attention becomes one fused op that knows the rotation; bit-exact."""
    if family == "phi3_partial":
        prog, want = _hf("Phi3Config", "Phi3ForCausalLM", partial_rotary_factor=0.5), (8, False, 1.0)
    elif family == "glm_partial_interleaved":
        prog, want = _hf("GlmConfig", "GlmForCausalLM", head_dim=16, partial_rotary_factor=0.5), (8, True, 1.0)
    elif family == "glm_interleaved":
        prog, want = _hf("GlmConfig", "GlmForCausalLM", head_dim=16, partial_rotary_factor=1.0), (0, True, 1.0)
    else:
        prog = _hf("LlamaConfig", "LlamaForCausalLM",
                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
        want = (0, False, prog.model.model.rotary_emb.attention_scaling)
    new, ops, notes = _lower(prog)
    fused = [n for n in new.graphs["decode"].graph.nodes if n.target is torch.ops.tkcc.attention_rope.default]
    assert len(fused) == 2 and "aten.scaled_dot_product_attention.default" not in ops, notes
    from tkcc.passes.lower.pattern import _all_args

    got = [tuple(_all_args(n)[i] for i in (18, 19, 5)) for n in fused]  # rotary_dim, interleaved, rope_scale
    assert all(g == want for g in got), (got, want)
    _same_decode(prog, new)


@pytest.mark.parametrize("name", ["mixtral-tiny", "qwen3moe-tiny", "qwen2moe-tiny"])
def test_moe_families_lower(name):
    """Mixtral and Qwen3-MoE (per-head q/k norms) lower whole; Qwen2-MoE per region (its shared expert's sigmoid
    gate stays in aten); bit-exact off the kernel path."""
    from tkcc.frontend.capture import capture_model

    prog = capture_model(name, "float32", "cpu", max_cache_len=32, phases=["decode"])
    new, ops, _ = _lower(prog)
    L = prog.num_blocks
    assert ops["tkcc.attention_rope.default"] == L and ops["tkcc.moe.default"] == L, ops
    left = {k for k in ops if not k.startswith("tkcc.") and k not in VIEWS}
    assert left <= ({"aten.sigmoid.default", "aten.mul.Tensor", "aten.add.Tensor"} if name == "qwen2moe-tiny"
                    else set()), left
    _same_decode(prog, new)


@pytest.mark.parametrize("name", ["qwen2", "qwen2moe-tiny", "minimax-tiny", "llama-tiny"])
def test_a_model_cast_to_bf16_lowers_its_attention_whichever_way_its_rotary_upcasts(name):
    """``model.to(torch.bfloat16)`` casts ``inv_freq`` too. Qwen2, Qwen2-MoE, MiniMax (and ~40 families more) then
    upcast it before its expand, Llama after: both tables are the step's, so every attention lowers (an H200 run
    of qwen2moe-16l left all 16 in aten: "cos/sin are not the step's rotary table"); bit-exact in bf16."""
    from tkcc.frontend.capture import capture, capture_model

    if name == "qwen2":
        import transformers

        cfg = transformers.Qwen2Config(**SHAPE)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        prog = capture(transformers.Qwen2ForCausalLM(cfg).eval().to(torch.bfloat16), phases=["decode"],
                       max_cache_len=32)
    else:
        prog = capture_model(name, "bfloat16", "cpu", max_cache_len=32, phases=["decode"])
    new, ops, notes = _lower(prog)
    full = sum(1 for b in range(prog.num_blocks) if not _is_linear_layer(prog, b))
    assert ops["tkcc.attention_rope.default"] == full, notes
    assert not any("rotary table" in n for n in notes), notes
    _same_decode(prog, new)


def _is_linear_layer(prog, block) -> bool:
    """MiniMax's lightning (linear-attention) layers have no softmax attention to lower."""
    types = getattr(prog.model.config, "layer_types", None) or []
    return block < len(types) and "linear" in str(types[block])


def test_bad_state_layout_is_refused_or_falls_back_with_its_reason():
    """A recurrent state the kernel cannot take runs the reference with the reason logged (never a wrong
    result); a state that is not a buffer of the graph is refused by the rewrite."""
    from tkcc.kernels.common import fallbacks
    from tkcc.kernels.linear_attention import linear_attention_ref
    from tkcc.passes.lower import linear_attention as la
    from tkcc.passes.lower.checks import Region, _capture
    from tkcc.passes.lower.decode import lower

    g = torch.Generator().manual_seed(0)
    H, D = 2, 16
    state = torch.randn(2, 1, H, D, D, generator=g).transpose(-1, -2)  # strided: the kernel wants it contiguous
    slope = torch.rand(H, 1, 1, generator=g)
    qkv, pos = torch.randn(1, 1, 3 * H * D, generator=g), torch.tensor([3])
    s2 = state.clone()
    got = torch.ops.tkcc.linear_attention(qkv, state, pos, slope, "silu", 16, False)
    want = linear_attention_ref(qkv, s2, pos, slope)
    assert torch.equal(got, want) and torch.equal(state, s2)
    assert any(k.startswith("tkcc.linear_attention:") for k in fallbacks())

    pattern = la._lightning_pattern("silu")[0]
    m = Region(lambda s, qkv, st, pos: pattern(qkv, st, pos, s.slope)[0], {"slope": slope})
    gm = _capture(m, (qkv, torch.zeros(2, 1, H, D, D), pos))
    info = lower(gm, torch.float32, {"pdl": False, "attention_layout": None, "gemv_configs": {}})
    assert "tkcc.linear_attention.default" not in _ops(gm)
    assert any("the recurrent state is not a buffer of the graph" in n for n in info.notes), info.notes


def test_gated_delta_state_the_kernel_cannot_take_runs_the_reference_with_its_reason():
    """A state that is not float32 (or not contiguous) runs transformers' arithmetic with the reason logged, never
    a wrong result; a state that is not a buffer of the graph is refused by the rewrite."""
    from tkcc.kernels.common import fallbacks
    from tkcc.kernels.gated_delta import gated_delta_ref, gated_delta_step
    from tkcc.passes.lower.checks import Region, _capture
    from tkcc.passes.lower.decode import lower

    g = torch.Generator().manual_seed(0)
    H, DK, DV = 2, 16, 16
    q, k = torch.randn(1, 1, H, DK, generator=g), torch.randn(1, 1, H, DK, generator=g)
    v, beta = torch.randn(1, 1, H, DV, generator=g), torch.rand(1, 1, H, generator=g)
    decay, pos = -torch.rand(1, 1, H, generator=g), torch.tensor([3])
    state = torch.randn(2, 1, H, DK, DV, generator=g, dtype=torch.float64)
    s2 = state.clone()
    got = torch.ops.tkcc.gated_delta(q, k, v, decay, beta, state, pos, True, 16, False)
    assert torch.equal(got, gated_delta_ref(q, k, v, decay, beta, s2, pos)) and torch.equal(state, s2)
    assert any(k_.startswith("tkcc.gated_delta:") for k_ in fallbacks())

    m = Region(lambda s, q, k, v, decay, beta, st, pos: gated_delta_step(q, k, v, decay, beta, st, pos)[0], {})
    gm = _capture(m, (q, k, v, decay, beta, torch.zeros(2, 1, H, DK, DV), pos))
    info = lower(gm, torch.float32, {"pdl": False, "attention_layout": None, "gemv_configs": {}})
    assert "tkcc.gated_delta.default" not in _ops(gm)
    assert any("the recurrent state is not a buffer of the graph" in n for n in info.notes), info.notes


def test_gated_delta_with_key_heads_and_gates_off_the_kernel_is_transformers_code():
    """Given key heads (fewer than the value heads) and Qwen3-Next's a, b, A_log and dt_bias, the op off the kernel
    path (a float64 state) is transformers' layer: its gates from the per-key-head projection halves, its
    ``repeat_interleave`` of q and k, its recurrent rule from the state's slot, bit for bit; the state written is
    the rule's final state, and the reason is logged."""
    import torch.nn.functional as F
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    from tkcc.kernels.common import fallbacks

    g = torch.Generator().manual_seed(0)
    for HK, group, p in ((2, 2, 3), (1, 4, 0), (3, 1, 6)):
        H, DK, DV = HK * group, 16, 32
        q, k = torch.randn(1, 1, HK, DK, generator=g), torch.randn(1, 1, HK, DK, generator=g)
        v = torch.randn(1, 1, H, DV, generator=g)
        ba = torch.randn(1, 1, HK, 2 * group, generator=g) * 3
        b, a = torch.split(ba, [group, group], dim=3)
        a_log, dt_bias = torch.rand(H, generator=g) * 3, torch.randn(H, generator=g)
        state = torch.randn(2, 1, H, DK, DV, generator=g, dtype=torch.float64)
        pos = torch.tensor([p])
        initial = state[p % 2].clone() if p else None
        got = torch.ops.tkcc.gated_delta(q, k, v, a, b, state, pos, True, 16, False, a_log, dt_bias)

        beta = b.reshape(1, 1, H).sigmoid()  # Qwen3NextGatedDeltaNet.forward, for one token
        decay = -a_log.float().exp() * F.softplus(a.reshape(1, 1, H).float() + dt_bias)
        if group > 1:
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        want, final = torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=initial,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.equal(got, want), (HK, group, float((got - want).abs().max()))
        assert torch.equal(state[(p + 1) % 2], final.to(state.dtype)), (HK, group)
    assert any(k_.startswith("tkcc.gated_delta:") for k_ in fallbacks())


def test_a_window_the_conv_kernel_cannot_take_runs_the_reference_with_its_reason():
    from tkcc.kernels.causal_conv import causal_conv_ref
    from tkcc.kernels.common import fallbacks

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 40, generator=g).transpose(1, 2)
    state = torch.randn(2, 1, 40, 4, generator=g, dtype=torch.float64)  # not the activations' dtype
    w, pos = torch.randn(40, 4, generator=g), torch.tensor([2])
    s2 = state.clone()
    got = torch.ops.tkcc.causal_conv(x, state, w, None, pos, "silu", 16, False)
    assert torch.equal(got, causal_conv_ref(x, s2, w, None, pos, "silu")) and torch.equal(state, s2)
    assert any(k.startswith("tkcc.causal_conv:") for k in fallbacks())


def test_a_negative_position_is_a_clear_error_in_every_recurrent_op():
    """A recurrent step at a negative position would read the wrong slot: each op says which op and position."""
    from tkcc.errors import TkccError

    H, D, pos = 2, 16, torch.tensor([-1])
    calls = {
        "gated delta": lambda: torch.ops.tkcc.gated_delta(
            torch.randn(1, 1, H, D), torch.randn(1, 1, H, D), torch.randn(1, 1, H, D), -torch.rand(1, 1, H),
            torch.rand(1, 1, H), torch.zeros(2, 1, H, D, D), pos, True, 16, False),
        "causal conv": lambda: torch.ops.tkcc.causal_conv(torch.randn(1, 8, 1), torch.zeros(2, 1, 8, 4),
                                                          torch.randn(8, 4), None, pos, "silu", 16, False),
        "linear attention": lambda: torch.ops.tkcc.linear_attention(
            torch.randn(1, 1, 3 * H * D), torch.zeros(2, 1, H, D, D), pos, torch.rand(H, 1, 1), "silu", 16, False),
    }
    for op, call in calls.items():
        with pytest.raises(TkccError, match=f"{op}: negative position -1"):
            call()


def test_a_product_by_one_is_dropped_where_it_is_the_tensor_itself():
    """``x * 1`` (MiniMax's ``h * beta``, a rotary table's ``attention_scaling``) is x bit for bit: the canonical form
    reads x. Kept where the product changes the dtype (an integer times 1.0), is the graph's output, or is not by
    one; a pattern whose scale is 1 in the model still matches (``at_one``'s twins: the rotary table)."""
    from tkcc.passes.lower import pattern
    from tkcc.passes.lower.checks import Region, _capture

    def fn(s, x, i):
        return (x * 1 + x * 1.0) * 0.5 + i * 1.0 + (x * 2.0) * 1, x * 1

    g = torch.Generator().manual_seed(0)
    x, i = torch.randn(3, 4, generator=g), torch.arange(4)
    gm = _capture(Region(fn, {}), (x, i))
    ref = gm(x, i)
    pattern.canonicalize(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    muls = [n.args for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mul.Tensor]
    # left: the half, the integer's cast to float, the product by 2, the output's product
    assert sorted(str(a[1]) for a in muls) == ["0.5", "1", "1.0", "2.0"], muls
    got = gm(x, i)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    from tkcc.passes.lower import rotary

    names = {rw.name for rw in rotary.REWRITES}
    assert "rotary_cos_sin[scale 1]" in names and "rotary_cos_sin" in names


def test_a_copy_that_overwrites_a_fresh_tensor_whole_becomes_data_flow():
    """transformers' one-token loop writes its output as ``out = zeros_like(v); out[:, :, 0] = x``: the canonical
    form reads ``x.unsqueeze(2)`` instead (so a pattern's output depends on its inputs by data flow), bit for bit;
    a reader of the zeros before the copy keeps the graph as it was."""
    from tkcc.passes.lower import pattern
    from tkcc.passes.lower.checks import Region, _capture

    def write_whole(s, v, x):
        out = torch.zeros_like(v)
        out[:, :, 0] = x * 2
        return out.transpose(1, 2) + 1

    def read_first(s, v, x):
        out = torch.zeros_like(v)
        before = out.sum()
        out[:, :, 0] = x * 2
        return out.transpose(1, 2) + before

    g = torch.Generator().manual_seed(0)
    v, x = torch.randn(1, 3, 1, 4, generator=g), torch.randn(1, 3, 4, generator=g)
    for fn, rewritten in ((write_whole, True), (read_first, False)):
        gm = _capture(Region(fn, {}), (v, x))
        ref = gm(v, x)
        pattern.canonicalize(gm.graph)
        gm.graph.lint()
        gm.recompile()
        ops = _ops(gm)
        assert ("aten.copy_.default" not in ops) == rewritten, ops
        assert torch.equal(gm(v, x), ref)


# ---- GPU -----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["linear_attention", "gated_delta", "causal_conv", "rotary", "sinks", "gemma_qk_norm",
                                    "cohere", "gated_norm", "gated_attention", "q_scaled_attention",
                                    "alibi_attention"])
def test_rewrites_match_their_patterns_gpu_bf16(family):
    from tkcc.passes.lower.checks import run_checks

    rows = run_checks("cuda", torch.bfloat16, [family])
    bad = [r for r in rows if not r["ok"]]
    assert rows and not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sink_kernel_gpu_bf16():
    sys.path.insert(0, str(HERE))
    from interp_variants_check import check_sinks  # noqa: E402 (the same cases, on the device)

    rows = check_sinks(torch.bfloat16, torch.Generator().manual_seed(0), device="cuda")
    assert rows and all(r["ok"] for r in rows), rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dynamic_split_kernel_gpu_bf16():
    sys.path.insert(0, str(HERE))
    from interp_variants_check import check_dynamic_splits  # noqa: E402 (the same cases, on the device)

    rows = check_dynamic_splits(torch.bfloat16, torch.Generator().manual_seed(0), device="cuda")
    assert rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["minimax-tiny", "mixtral-tiny", "qwen3moe-tiny", "qwen2moe-tiny"])
def test_family_greedy_on_gpu_bf16(name, tmp_path):
    """Through the front door: the lowered step (PDL, replayed from the decode CUDA graph) keeps the captured
    graph's greedy tokens over 32 steps."""
    import tkcc
    from tkcc.frontend.models import build_model

    m = build_model(name, torch.bfloat16, "cuda", seed=4)
    compiled = tkcc.compile(m, plan=[{"name": "lowered_decode", "params": {"tune": False}}], mode="tolerance",
                            measure=False, max_cache_len=256, out_dir=tmp_path, progress=False)
    assert compiled.serves == "artifact"
    src = compiled.artifact.source("decode")
    assert "torch.ops.tkcc.moe.default(" in src
    if name == "minimax-tiny":
        assert "torch.ops.tkcc.linear_attention.default(" in src
    sys.path.insert(0, str(HERE))
    from greedy_rule import assert_greedy_agrees  # noqa: E402 (the engine's tolerance-mode rule)

    assert_greedy_agrees(compiled, steps=32)


# ---- under the interpreter (one subprocess, started with the module: these read it, last) ----------------------

def test_kernels_match_their_references_under_the_interpreter(interpreter_run):
    res = interpreter_run.lines()[0]
    rows = res["rows"]
    kinds = {r["case"].split("[")[0] for r in rows}
    assert kinds == {"linear_attention", "gated_delta", "causal_conv", "attention", "sinks", "dynamic"}, kinds
    assert any("interleaved" in r["case"] for r in rows) and any("partial" in r["case"] for r in rows)
    assert any("q scaled" in r["case"] for r in rows)
    for dt in ("float32", "float16"):  # BLOOM's ALiBi, one split and more than the kernel merges
        assert any("alibi" in r["case"] and "S=300" in r["case"] and r["dtype"].endswith(dt) for r in rows), dt
    assert {r["dtype"].replace("torch.", "") for r in rows} == {"float32", "float16"}
    bad = [r for r in rows if not r["ok"]]
    assert not bad, json.dumps(bad, indent=1)
    assert not [k for k in res["fallbacks"] if k.startswith("tkcc.")], res["fallbacks"]  # the kernels ran


def test_greedy_tokens_identical_with_the_kernels_live(interpreter_run):
    (r,) = [r for r in interpreter_run.lines() if "model" in r]
    assert r["got"] == r["ref"] and len(set(r["ref"])) > 4, r
    assert r["logits_rel_err"] < 1e-4, r
    assert {"linear_attention", "attention_rope", "moe", "gemv", "rms_norm"} <= set(r["ops"]), r
    assert not [k for k in r["fallbacks"] if k.startswith("tkcc.")], r
    # the scaled residuals and the sigmoid output gate in the kernels (their checks: scaled_residual, gated_norm)
    assert not [n for n in r["notes"] if any(op in n for op in ("aten.mul", "aten.add", "aten.sigmoid"))], r
