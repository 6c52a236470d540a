"""lowered_decode on DeepSeek-V3: MLA attention absorbed over the latent cache, the grouped sigmoid router, shared
experts, the dense first layer.

CPU: the MLA rewrite against its pattern with the kernels live (Triton interpreter, fp32 and fp16) and greedy
tokens over 8 steps with every kernel live (one subprocess); in-process, where the ops take their references,
the lowered step must be bit-exact with the captured one (a wrong rewiring shows), per-region fallbacks with
their reasons, a context past the cache. GPU: the same checks in bf16 at DeepSeek's widths, greedy through the
front door.
"""
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from interp_proc import module_run  # noqa: E402

INTERP_TEST = "test_mla_kernels_and_greedy_tokens_under_the_interpreter"


@pytest.fixture(scope="module", autouse=True)
def interpreter_run(request):
    """The MLA rewrite against its pattern (fp32, fp16), then deepseekv3-tiny's greedy tokens, every kernel live:
    one subprocess started with the module (interp_proc.py), read by the module's last test."""
    yield from module_run(request, (INTERP_TEST,), [str(HERE / "interp_lowered.py"), "float32:mla", "float16:mla",
                                                   "--", "deepseekv3-tiny"])


def _ops(gm):
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _same_decode(prog, new, seeds=(1, 2)):
    """Both decode graphs on the same cache contents and fresh inputs (a random position): identical logits and
    caches."""
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        tok, _pos = prog.inputs("decode", generator=g)
        pos = torch.randint(0, prog.meta["max_cache_len"], (1,), generator=g)
        for b in prog.state.buffers():
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
        saved = [b.clone() for b in prog.state.buffers()]
        ref = prog.graphs["decode"](tok, pos)
        ref_cache = [b.clone() for b in prog.state.buffers()]
        for b, v in zip(prog.state.buffers(), saved):
            b.copy_(v)
        got = new.graphs["decode"](tok, pos)
        assert torch.equal(ref, got), float((ref.float() - got.float()).abs().max())
        assert all(torch.equal(a, b) for a, b in zip(ref_cache, prog.state.buffers()))


@pytest.fixture(scope="module")
def lowered():
    """deepseekv3-tiny's decode phase captured and lowered, per dtype: (program, lowered program, pass log)."""
    from tkcc.frontend.capture import capture_model
    from tkcc.passes.manager import apply_plan

    out = {}
    for dt in ("float32", "bfloat16"):
        prog = capture_model("deepseekv3-tiny", dt, "cpu", max_cache_len=32, phases=["decode"])
        new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
        out[dt] = prog, new, logs[0]
    return out


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_deepseek_v3_step_lowers_whole_and_keeps_eager_arithmetic(lowered, dt):
    """Every region of the step becomes a kernel op: per layer the packed q_a|kv_a GEMV (norm prologue; layer 0's
    gathers the embedding), q_b (q_a_layernorm prologue), the absorbed MLA attention, o-proj (+residual); the dense
    first layer's gated MLP as two GEMVs; each MoE layer's grouped sigmoid router + routed experts as one tkcc.moe
    and its shared experts as two GEMVs, the shared down projection adding the routed experts' output and the
    decoder's residual (two residuals: no aten add left), the post-attention norm that both read the prologue of
    each (no norm left standalone)."""
    prog, new, log = lowered[dt]
    ops = _ops(new.graphs["decode"])
    L, dense = prog.num_blocks, prog.model.config.first_k_dense_replace
    assert ops["tkcc.mla_attention.default"] == L
    assert ops["tkcc.moe.default"] == L - dense
    assert ops["tkcc.gemv.default"] + ops["tkcc.gemv_gather.default"] == 3 * L + 2 * L + 1
    assert ops["tkcc.gemv_gather.default"] == 1
    left = {k: v for k, v in ops.items() if not k.startswith("tkcc.") and k not in
            ("<built-in function getitem>", "aten.split_with_sizes.default")}
    assert left == {}, left
    assert "tkcc.rms_norm.default" not in ops, ops
    assert all(n.args[1] is not None for n in new.graphs["decode"].graph.nodes
               if n.target is torch.ops.tkcc.moe.default)  # (the norm weight: the prologue's)
    downs = [n for n in new.graphs["decode"].graph.nodes if n.target is torch.ops.tkcc.gemv.default
             and len(n.args) > 12 and n.args[12] is not None]
    assert len(downs) == L - dense and all(n.args[5].target is torch.ops.tkcc.moe.default for n in downs), downs
    moes = [n for n in new.graphs["decode"].graph.nodes if n.target is torch.ops.tkcc.moe.default]
    cfg = prog.model.config
    assert all(n.args[12] == "sigmoid_grouped" and n.args[13] is not None and n.args[14:17] ==
               (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) and n.args[7] is cfg.norm_topk_prob
               for n in moes), [n.args for n in moes]
    assert any("mla_attention[interleaved rope]: 3 region(s) lowered" in n for n in log.notes), log.notes
    _same_decode(prog, new)


def _deepseek(seed=0, **overrides):
    from tkcc.frontend.models import build_model

    return build_model("deepseekv3-tiny", torch.float32, "cpu", seed=seed, **overrides)


def test_mla_without_q_lora_and_with_half_rope_lowers_by_the_other_variant():
    """deepseekv3-16l's layout (a plain q_proj, no q LoRA) with rotate_half rotary (rope_interleave off): the
    q_proj packs with kv_a into one GEMV, the half-rope MLA rewrite takes the attention; bit-exact off kernels."""
    from tkcc.frontend.capture import capture
    from tkcc.passes.manager import apply_plan

    prog = capture(_deepseek(q_lora_rank=None, rope_interleave=False, num_hidden_layers=2), phases=["decode"],
                   max_cache_len=32)
    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    fused = [n for n in new.graphs["decode"].graph.nodes if n.target is torch.ops.tkcc.mla_attention.default]
    assert len(fused) == 2 and all(n.args[12] is False for n in fused)  # interleave off
    assert any("mla_attention[half rope]: 2 region(s) lowered" in n for n in logs[0].notes), logs[0].notes
    _same_decode(prog, new)


def test_checks_detect_a_wrong_mla_replacement(monkeypatch):
    """The comparison can fail: a replacement that rotates the rope part in the other layout is caught (off the
    interpreter the op runs its reference, so the check compares the pattern with the reference's arithmetic)."""
    from tkcc.passes.lower import checks_mla, mla

    rw = mla.REWRITES[0]
    good = rw.replacement

    def wrong(*ts, **kw):
        o, _, _ = good(*ts, **kw)
        return o * 1.01, o, o

    monkeypatch.setattr(rw, "replacement", wrong)
    g = torch.Generator().manual_seed(0)
    rows = checks_mla.check_mla("cpu", torch.float32, g, shapes=checks_mla.SHAPES[:1])
    assert rows and all(not r["ok"] and r["rel_err"] > 5e-3 for r in rows), rows


def test_kv_b_proj_in_an_unexpected_layout_stays_in_aten_with_its_reason():
    """A matched MLA region whose kv_b_proj weight is stored column-major (the absorbed kernels stream its rows):
    refused with the layout in the pass log, left in aten; the other layer is fused; the step computes the same."""
    from tkcc.frontend.capture import capture
    from tkcc.passes.manager import apply_plan

    m = _deepseek(num_hidden_layers=2)
    p = m.model.layers[1].self_attn.kv_b_proj
    p.weight = torch.nn.Parameter(p.weight.detach().t().contiguous().t(), requires_grad=False)
    prog = capture(m, phases=["decode"], max_cache_len=32)
    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    ops = _ops(new.graphs["decode"])
    assert ops["tkcc.mla_attention.default"] == 1 and ops["aten.scaled_dot_product_attention.default"] == 1
    assert any("left in aten: kv_b_proj weight (128, 32) strides (1, 128) is not [4 heads x (N + V), 32] stored as "
               "rows" in n for n in logs[0].notes), logs[0].notes
    _same_decode(prog, new)


def test_a_context_past_the_cache_is_a_clear_error(lowered):
    from tkcc.errors import TkccError

    prog, new, _ = lowered["float32"]
    S = prog.meta["max_cache_len"]
    with pytest.raises(TkccError, match=rf"MLA attention: cache position {S} .* longer than the static cache "
                                        rf"\({S} positions\)"):
        new.graphs["decode"](torch.tensor([[3]]), torch.tensor([S]))


def test_the_absorbed_reference_is_the_expanded_one():
    """The kernels' plain arithmetic (absorbed) against Hugging Face's (the cache expanded through kv_b_proj), fp64
    on random inputs at several shapes and positions: the same function, to rounding (HF's latent norm takes its
    statistic in fp32, hence 1e-6, where a wrong head split or rotation is off by O(1))."""
    from tkcc.kernels.lowered import causal_mask_ref, rotary_cos_sin_ref
    from tkcc.kernels.lowered_mla import mla_expanded_ref
    from tkcc.kernels.mla_attention import mla_absorbed_ref

    g = torch.Generator().manual_seed(3)
    for H, N, R, V, C, S, il in ((4, 16, 8, 16, 32, 20, True), (5, 12, 6, 10, 24, 33, False)):
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        q, ckv, nw, kv_b = r(1, 1, H * (N + R)), r(1, 1, C + R), r(C) + 1, r(H * (N + V), C) * C ** -0.5
        kc, rc = r(1, 1, S, C), r(1, 1, S, R)
        inv = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
        for p in (0, S // 2, S - 1):
            pos = torch.tensor([p])
            cos, sin = rotary_cos_sin_ref(inv, pos[None], 1.0, torch.float64)
            k1, r1, k2, r2 = kc.clone(), rc.clone(), kc.clone(), rc.clone()
            want = mla_expanded_ref(q, ckv, nw, kv_b, k1, r1, pos, cos, sin, causal_mask_ref(pos, S), 1e-6, 0.2, N, il)
            got = mla_absorbed_ref(q.view(-1), ckv.view(-1), nw, kv_b, k2[0, 0], r2[0, 0], p, cos[0, 0], sin[0, 0],
                                   1e-6, 0.2, N, il)
            assert torch.allclose(got, want.view(-1), rtol=1e-6, atol=1e-6), float((got - want.view(-1)).abs().max())
            assert torch.allclose(k1, k2, atol=1e-6) and torch.allclose(r1, r2, atol=1e-12)


@pytest.mark.slow
def test_mla_kernels_compile_for_sm90():
    """The interpreter is lenient about types; the real compiler is not: the three MLA kernels at DeepSeek's widths
    (latent 512 + rope 64, bf16, with and without PDL, both rotary forms) compile for sm_90 (no GPU needed), and
    the split kernel's tile fits an H200's shared memory."""
    from tkcc.kernels.aot import compile_all
    from tkcc.kernels.mla_attention import aot_variants

    rows = compile_all(90, which=aot_variants())
    assert len(rows) == 6
    assert all(r["shared"] < 232448 for r in rows), rows
    assert all(r["wide_loads"] > 0 for r in rows if r["kernel"] == "mla_split_kernel"), rows


# ---- GPU -----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mla_rewrite_matches_its_pattern_gpu_bf16():
    """bf16 on the device, DeepSeek's widths among the shapes (latent 512 + rope 64, 16 and 128 heads)."""
    from tkcc.passes.lower.checks import run_checks

    rows = run_checks("cuda", torch.bfloat16, ["mla"])
    bad = [r for r in rows if not r["ok"]]
    assert len(rows) >= 12 and not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deepseek_v3_lowered_greedy_on_gpu_bf16(tmp_path):
    """Through the front door: the lowered DeepSeek-V3 step (PDL, replayed from the decode CUDA graph, tuned on the
    device) keeps the captured graph's greedy tokens over 32 steps."""
    import tkcc
    from tkcc.frontend.models import build_model

    m = build_model("deepseekv3-tiny", torch.bfloat16, "cuda", seed=4)
    plan = [{"name": "lowered_decode", "params": {"tune": True, "tune_context": 128}}]
    compiled = tkcc.compile(m, plan=plan, mode="tolerance", measure=False, max_cache_len=256, out_dir=tmp_path,
                            progress=False)
    assert compiled.serves == "artifact"
    src = compiled.artifact.source("decode")
    assert "torch.ops.tkcc.mla_attention.default(" in src and "aten.scaled_dot_product_attention" not in src
    sys.path.insert(0, str(HERE))
    from greedy_rule import assert_greedy_agrees  # noqa: E402 (the engine's tolerance-mode rule)

    assert_greedy_agrees(compiled, steps=32)


def test_mla_layout_is_tuned_into_every_mla_node(lowered):
    """The lowered step's attention tuning also times MLA's (chunk, tile) over every layer's latent cache (fake
    clock: the third layout is the fastest), writes the pick into each node and puts the caches back."""
    from tkcc.passes.graph_pass import clone_graph_module
    from tkcc.passes.lower import space, tune

    prog, new, _ = lowered["float32"]
    gm = clone_graph_module(new.graphs["decode"])
    before = [b.clone() for b in prog.state.buffers()]
    S = 32
    layouts = [(c, t) for c in [c for c in space.ATTN_CHUNKS if c and c < S] + [S] for t in space.MLA_TILES]
    order = iter(range(len(layouts)))
    picked = tune.tune_attention(gm, lambda fn: (fn(), 0.5 if next(order) == 2 else 1.0)[1], 20, ["32x4"])
    assert (picked["mla_attn_chunk"], picked["mla_attn_tile"]) == layouts[2] and "attn_chunk" not in picked
    assert next(order, None) is None  # every layout was timed, once
    bs, nw = space.parse_tile(layouts[2][1])
    nodes = [n for n in gm.graph.nodes if n.target is torch.ops.tkcc.mla_attention.default]
    assert nodes and all(tuple(n.args[13:16]) == (layouts[2][0], bs, nw) for n in nodes)
    assert all(torch.equal(a, b) for a, b in zip(before, prog.state.buffers()))


# ---- under the interpreter (one subprocess, started with the module: read last) -------------------------------

def test_mla_kernels_and_greedy_tokens_under_the_interpreter(interpreter_run):
    *groups, greedy = interpreter_run.lines()
    rows = [r for g in groups for r in g["rows"]]
    assert len(rows) >= 16 and {r["dtype"] for r in rows} == {"float32", "float16"}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert not [k for k in groups[-1]["fallbacks"] if k.startswith("tkcc.")], groups[-1]["fallbacks"]  # kernels ran
    assert greedy["got"] == greedy["ref"], greedy
    assert len(set(greedy["ref"])) > 4, greedy  # the tokens move: a broken step would show
    assert greedy["logits_rel_err"] < 1e-4, greedy
    assert {"mla_attention", "moe", "gemv", "gemv_gather"} <= set(greedy["ops"]), greedy
    assert "add" not in greedy["aten"], greedy  # the decoder's residual is the shared down GEMV's second
    assert "rms_norm" not in greedy["ops"], greedy  # the post-attention norm is its readers' prologue
    assert not [k for k in greedy["fallbacks"] if k.startswith("tkcc.")], greedy
