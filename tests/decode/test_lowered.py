"""lowered_decode: the decode step rewritten region by region from the captured aten graph.

CPU: every rewrite against its pattern with the kernels live (Triton interpreter, fp32/fp16, in a
subprocess: the interpreter must be on before triton is imported); the pass on llama-tiny / olmoe-tiny
in-process, where the ops take their references, so the lowered graph must be bit-exact with the captured
one and a wrong rewiring shows; greedy tokens over 8 steps with the kernels live; per-region fallbacks with
their reasons; the artifact through tkcc.compile, save and load. GPU: the same in bf16.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fake_clock import every_nth_fastest  # noqa: E402
from interp_proc import module_run  # noqa: E402

# the rewrites against their patterns under the interpreter, per dtype; then the greedy models
CHECKS = {"float32": ["norms", "gemv", "gather", "packing", "attention", "moe", "scaled_residual", "residual2",
                      "norm_readers"],
          "float16": ["gemv", "gather", "attention", "moe", "scaled_residual", "residual2", "norm_readers"]}
FIRST_SHAPES = {"float16": 1}  # fp16 checks its arithmetic at each family's first shape; fp32 covers the rest
GREEDY = ["llama-tiny", "olmoe-tiny"]
INTERP_TESTS = ("test_every_rewrite_matches_its_pattern_under_the_interpreter",
                "test_greedy_tokens_identical_to_the_captured_graph_under_the_interpreter")


@pytest.fixture(scope="module", autouse=True)
def interpreter_run(request):
    """Every interpreter case of this module, in one subprocess started with the module (interp_proc.py)."""
    groups = [f"{dt}:{','.join(fams)}" + (f":{FIRST_SHAPES[dt]}" if dt in FIRST_SHAPES else "")
              for dt, fams in CHECKS.items()]
    yield from module_run(request, INTERP_TESTS, [str(HERE / "interp_lowered.py"), *groups, "--", *GREEDY])


def test_checks_detect_a_wrong_replacement(monkeypatch):
    """The comparison can fail: a GEMV replacement that drops the residual is caught (and bit-exactness of an
    exact rewrite is asserted, not assumed)."""
    from tkcc.passes.lower import checks, projections

    rw = next(r for r in projections.GEMV if r.name == "gemv[bias+residual]")
    good = rw.replacement

    def wrong(x, w, b, r, **kw):
        return good(x, w, b, torch.zeros_like(r), **kw)

    monkeypatch.setattr(rw, "replacement", wrong)
    g = torch.Generator().manual_seed(0)
    rows = checks.check_gemv("cpu", torch.float32, g, shapes=((40, 48),))
    bad = [r for r in rows if "residual" in r["case"] and not r["ok"]]
    assert bad and all(r["rel_err"] > 0.1 for r in bad)


def test_moe_checks_draw_no_routing_tie():
    """A router whose top-1 is always a tie (two equal rows, and their negatives) gets no input: a tie's two
    choices differ by a whole expert, so a case drawn on one would fail a correct kernel (it did, in CI, fp16)."""
    from tkcc.passes.lower.checks import _clear_routing, _logits, _near

    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 16, generator=g)
    tied = torch.cat([w, w, -w, -w]).half()
    with pytest.raises(RuntimeError, match="top-1 tie"):
        _clear_routing(lambda: (torch.randn(1, 16, generator=g).half(),), _logits(tied), 1, _near(torch.float16),
                       tries=20)
    clear = torch.randn(4, 16, generator=g).half()
    (x,) = _clear_routing(lambda: (torch.randn(1, 16, generator=g).half(),), _logits(clear), 2, _near(torch.float16))
    top = torch.nn.functional.linear(x, clear).float().sort(descending=True).values[0]
    assert top[1] - top[2] > 16 * torch.finfo(torch.float16).eps * top.abs().max()


@pytest.fixture(scope="module")
def captured():
    from tkcc.frontend.capture import capture_model

    out = {}
    for name in ("llama-tiny", "olmoe-tiny"):
        for dt in ("float32", "bfloat16"):
            out[name, dt] = capture_model(name, dt, "cpu", max_cache_len=32, phases=["decode"])
    return out


def _ops(gm):
    from collections import Counter

    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _same_decode(prog, new, seeds=(1, 2, 3)):
    """Both decode graphs on the same cache contents and fresh inputs: identical logits and caches."""
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        inp = prog.inputs("decode", generator=g)
        for b in prog.state.buffers():
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
        saved = [b.clone() for b in prog.state.buffers()]
        ref = prog.graphs["decode"](*inp)
        ref_cache = [b.clone() for b in prog.state.buffers()]
        for b, v in zip(prog.state.buffers(), saved):
            b.copy_(v)
        got = new.graphs["decode"](*inp)
        assert torch.equal(ref, got), float((ref.float() - got.float()).abs().max())
        assert all(torch.equal(a, b) for a, b in zip(ref_cache, prog.state.buffers()))


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_llama_decode_lowers_to_kernel_ops_and_keeps_eager_arithmetic(captured, dt):
    from tkcc.passes.manager import apply_plan

    prog = captured["llama-tiny", dt]
    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    ops = _ops(new.graphs["decode"])
    L = prog.num_blocks
    # per layer: qkv GEMV (+norm; layer 0's gathers the embedding), o-proj (+residual), gate|up (+norm, gated),
    # down (+residual); lm_head (+norm)
    assert ops["tkcc.gemv.default"] == 4 * L and ops["tkcc.gemv_gather.default"] == 1
    assert ops["tkcc.attention_rope.default"] == L
    left = {k: v for k, v in ops.items() if not k.startswith("tkcc.") and k != "<built-in function getitem>"}
    assert not left, left  # nothing of the step stays in aten
    log = logs[0]
    added = log.phases["decode"].added
    assert added and all(log.phases["decode"].provenance[n] for n in added)
    _same_decode(prog, new)


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_olmoe_decode_lowers_moe_and_attention_with_qk_norm(captured, dt):
    from tkcc.passes.manager import apply_plan

    prog = captured["olmoe-tiny", dt]
    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    ops = _ops(new.graphs["decode"])
    L = prog.num_blocks
    assert ops["tkcc.attention_rope.default"] == L and ops["tkcc.moe.default"] == L
    assert ops["tkcc.gemv.default"] == 2 * L and ops["tkcc.gemv_gather.default"] == 1  # qkv, o-proj; lm_head
    assert not {k: v for k, v in ops.items() if not k.startswith("tkcc.") and k != "<built-in function getitem>"}
    gm = new.graphs["decode"]
    fused = [n for n in gm.graph.nodes if n.target == torch.ops.tkcc.attention_rope.default]
    assert all(n.args[6] is not None and n.args[7] is not None for n in fused)  # q/k norm weights inside
    _same_decode(prog, new)


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "mixtral-tiny"])
def test_other_moe_families_lower_by_the_same_patterns(name):
    """Built for the ops, not the list: Qwen3-MoE (per-head q/k norms) and Mixtral (fp32 routing weights) are
    lowered whole by the same rewrites, bit-exact off the kernel path."""
    from tkcc.frontend.capture import capture_model
    from tkcc.passes.manager import apply_plan

    prog = capture_model(name, "float32", "cpu", max_cache_len=32, phases=["decode"])
    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    ops = _ops(new.graphs["decode"])
    L = prog.num_blocks
    assert ops["tkcc.attention_rope.default"] == L and ops["tkcc.moe.default"] == L, ops
    assert not {k: v for k, v in ops.items() if not k.startswith("tkcc.") and k != "<built-in function getitem>"}, ops
    _same_decode(prog, new)


def test_shared_expert_moe_lowers_per_region():
    """Qwen2-MoE (a config built here): q/k/v with biases packed into one biased GEMV and fused attention; the
    routed experts on the routed kernels (their input normed already: the norm also feeds the shared expert);
    the shared expert's gate|up as a gated GEMV; what is left (its sigmoid gate, the sums) stays in aten in the
    same step; bit-exact off the kernel path."""
    import transformers

    from tkcc.frontend.capture import capture
    from tkcc.passes.manager import apply_plan

    cfg = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=256,
                                      max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None, norm_topk_prob=False)
    cfg._attn_implementation, cfg._experts_implementation = "sdpa", "batched_mm"
    torch.manual_seed(0)
    m = transformers.Qwen2MoeForCausalLM(cfg).eval()
    for layer in m.model.layers:  # non-zero q/k/v biases, so that a dropped bias shows
        for p in layer.self_attn.parameters():
            if p.dim() == 1:
                p.data.normal_()
    prog = capture(m, phases=["decode"], max_cache_len=32)
    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    ops = _ops(new.graphs["decode"])
    assert ops["tkcc.attention_rope.default"] == 2 and ops["tkcc.moe.default"] == 2 and ops["tkcc.gemv_gather.default"] == 1
    gated = [n for n in new.graphs["decode"].graph.nodes if n.target is torch.ops.tkcc.gemv.default
             and len(n.args) > 6 and n.args[6] == "silu"]
    assert len(gated) == 2
    left = {k for k in ops if not k.startswith("tkcc.") and k != "<built-in function getitem>"}
    assert left <= {"aten.sigmoid.default", "aten.mul.Tensor", "aten.add.Tensor", "aten.view.default",
                    "aten.reshape.default"}, left
    # the post-attention norm (read by the routed experts, the shared gate|up and the shared expert's gate, through a
    # view) is each one's prologue
    assert "tkcc.rms_norm.default" not in ops, ops
    _same_decode(prog, new)


def test_a_norm_goes_into_its_readers_prologues_only_where_every_reader_takes_it():
    """DeepSeek-V3's MoE layer end, ``h + block(norm(h))``: the norm becomes the prologue of the routed experts and of
    the shared gate|up. Where the normed value is also the residual, or the norm is Gemma's ``(1 + w)`` form (which
    the prologues do not compute), it stays; bit-exact off the kernel path either way (the references agree)."""
    from tkcc.passes.lower import norms
    from tkcc.passes.lower.checks import Region, _capture, deepseek_moe_block
    from tkcc.passes.lower.decode import lower

    g = torch.Generator().manual_seed(0)
    block = deepseek_moe_block(g=g)
    nw = torch.randn(64, generator=g) * 0.5 + 1
    cases = {"prologues": (lambda s, h: h + s.block(norms.rms_norm(h, s.nw, eps=1e-6)), 0),
             "also the residual": (lambda s, h: (lambda n: n + s.block(n))(norms.rms_norm(h, s.nw, eps=1e-6)), 1),
             "1 + w": (lambda s, h: h + s.block(norms.rms_norm_offset(h, s.nw, eps=1e-6, offset=1.0)), 1)}
    for name, (fn, kept) in cases.items():
        region = Region(fn, {"nw": nw})
        region.block = block
        gm = _capture(region, (torch.randn(1, 1, 64),))
        info = lower(gm, torch.float32, {"pdl": False, "attention_layout": None, "gemv_configs": {}})
        ops = _ops(gm)
        assert ops["tkcc.rms_norm.default"] == kept and ops["tkcc.moe.default"] == 1, (name, ops)
        moe = next(n for n in gm.graph.nodes if n.target is torch.ops.tkcc.moe.default)
        assert (moe.args[1] is None) == bool(kept), (name, moe.args)
        if name == "also the residual":
            assert any("reads it other than as its input" in n for n in info.notes), info.notes
        for _ in range(3):
            x = torch.randn(1, 1, 64, generator=g)
            with torch.no_grad():
                assert torch.equal(region(x), gm(x)), name


def test_deepseek_v3_moe_block_lowers():
    """Hugging Face's own DeepSeek-V3 MoE block (its attention, MLA, is not captured yet): the sigmoid router
    with bias-corrected grouped top-k and the routed experts become one tkcc.moe, the shared experts a gated
    GEMV and a down GEMV whose residual epilogue adds the routed output; bit-exact off the kernel path."""
    from tkcc.passes.lower.checks import _capture, deepseek_moe_block
    from tkcc.passes.lower.decode import lower

    g = torch.Generator().manual_seed(0)
    m = deepseek_moe_block(g=g)
    gm = _capture(m, (torch.randn(1, 1, 64),))
    lower(gm, torch.float32, {"pdl": False, "attention_layout": None, "gemv_configs": {}})
    ops = _ops(gm)
    assert ops["tkcc.moe.default"] == 1 and ops["tkcc.gemv.default"] == 2, ops
    assert not {k for k in ops if not k.startswith("tkcc.") and k not in ("aten.view.default",
                                                                           "<built-in function getitem>")}, ops
    for _ in range(3):
        x = torch.randn(1, 1, 64, generator=g)
        with torch.no_grad():
            assert torch.equal(m(x), gm(x))


def test_sliding_window_attention_is_fused():
    """Mistral with a sliding window (a config built here: no registry model has one): the sliding mask is
    recognised and the window goes into the fused attention; bit-exact off the kernel path."""
    import transformers

    from tkcc.frontend.capture import capture
    from tkcc.passes.manager import apply_plan

    cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=256, sliding_window=8,
                                     max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                                     pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    prog = capture(transformers.MistralForCausalLM(cfg).eval(), phases=["decode"], max_cache_len=32)
    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    fused = [n for n in new.graphs["decode"].graph.nodes if n.target is torch.ops.tkcc.attention_rope.default]
    assert len(fused) == 2 and all(n.args[11] == 8 for n in fused)  # the window
    _same_decode(prog, new, seeds=(4, 5, 6, 7))


def test_a_region_nothing_can_take_stays_in_aten_with_its_reason(captured):
    """Per-region lowering: one layer's attention under a mask that is not the causal one is left in aten
    (the reason in the pass log); the other layers are fused; the step still computes the same."""
    from tkcc.passes.manager import apply_plan

    prog = captured["llama-tiny", "float32"]
    gm = prog.graphs["decode"]
    sdpa = [n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    import copy

    gm2 = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    sdpa2 = [n for n in gm2.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    mask = sdpa2[2].args[3]
    with gm2.graph.inserting_after(mask):
        other = gm2.graph.call_function(torch.ops.aten.logical_or.default, (mask, mask))
    other.meta["val"] = mask.meta["val"]
    sdpa2[2].replace_input_with(mask, other)
    gm2.recompile()
    prog2 = prog.with_graphs({"decode": gm2})
    new, logs = apply_plan(prog2, [{"name": "lowered_decode"}], mode="tolerance")
    ops = _ops(new.graphs["decode"])
    assert ops["tkcc.attention_rope.default"] == len(sdpa) - 1
    assert ops["aten.scaled_dot_product_attention.default"] == 1
    assert any("left in aten: the attention mask is not the step's causal mask" in n for n in logs[0].notes)
    _same_decode(prog2, new)


def test_a_weight_in_an_unexpected_layout_falls_back_with_a_logged_reason():
    """A projection whose weight is stored column-major matches the GEMV pattern but the kernel streams rows:
    the region is refused with the layout in the log, stays a linear, and the step computes the same."""
    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model
    from tkcc.passes.manager import apply_plan

    m = build_model("llama-tiny", torch.float32, "cpu", seed=5)
    o = m.model.layers[1].self_attn.o_proj
    o.weight = torch.nn.Parameter(o.weight.detach().t().contiguous().t())  # same values, strides (1, N)
    prog = capture(m, phases=["decode"], max_cache_len=32)
    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    ops = _ops(new.graphs["decode"])
    assert ops["aten.linear.default"] == 1
    assert ops["tkcc.gemv.default"] + ops["tkcc.gemv_gather.default"] == 4 * prog.num_blocks  # the others are
    assert any("left in aten: weight (64, 64) is stored with strides (1, 64)" in n for n in logs[0].notes), \
        logs[0].notes
    _same_decode(prog, new)


def test_lowered_step_ships_saves_and_loads(tmp_path):
    import tkcc
    from tkcc.frontend.models import build_model

    m = build_model("llama-tiny", torch.float32, "cpu", seed=2)
    plan = [{"name": "lowered_decode", "params": {"attn_tile": "32x4"}}]
    compiled = tkcc.compile(m, plan=plan, mode="tolerance", measure=False, max_cache_len=48, out_dir=tmp_path / "c",
                            progress=False)
    src = compiled.artifact.source("decode") if hasattr(compiled, "artifact") else None
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    want = compiled.generate(prompt, 8)
    compiled.save(tmp_path / "saved")
    from tkcc.codegen.artifact import Artifact

    art = Artifact.open(tmp_path / "saved" / "artifact")
    src = art.source("decode")
    assert "torch.ops.tkcc.attention_rope.default(" in src and "_rt_lowered.pack_rows([" in src
    assert "tkcc.kernels.lowered" in art.manifest["runtime"]
    loaded = tkcc.load(tmp_path / "saved", build_model("llama-tiny", torch.float32, "cpu", seed=2))
    assert torch.equal(loaded.generate(prompt, 8), want)


def test_device_pruning_of_attention_tiles(monkeypatch):
    """A tile the device cannot run leaves the space with its reason, and a plan that names it is refused
    before anything is built (the compile facts are faked here; the real ones come from compiling the kernel
    for the device: see test_tile_shared_memory_from_the_compiled_kernel)."""
    from tkcc.errors import PlanError
    from tkcc.frontend.capture import capture_model
    from tkcc.passes.lower import decode, space
    from tkcc.passes.manager import apply_plan

    fake = lambda arch, G, D, qk, tile, pdl=True: 274432 if tile == "256x8" and D >= 128 else 12288  # noqa: E731
    monkeypatch.setattr(space, "attention_smem", fake)
    monkeypatch.setattr(space, "attention_needs", lambda arch, shapes: {
        (t, G, D, qk): fake(arch, G, D, qk, t) for t in space.ATTN_TILES for G, D, qk in shapes})
    bad = space.pruned_tiles((90, 232448), [(1, 128, True)])
    assert list(bad) == ["256x8"] and "274,432 B" in bad["256x8"] and "232,448 B" in bad["256x8"]
    assert space.pruned_tiles(None, [(1, 128, True)]) == {}  # no device limit (CPU, the interpreter)
    monkeypatch.setattr(space, "device_limits", lambda device: (90, 232448))
    params, pruned = decode.LoweredDecode.space("cuda")
    assert "256x8" not in params["attn_tile"] and "attn_tile=256x8" in pruned
    prog = capture_model("olmoe-tiny", "float32", "cpu", max_cache_len=32, phases=["decode"])
    monkeypatch.setattr(decode, "head_shapes", lambda program: [(1, 128, True)])
    with pytest.raises(PlanError, match="attn_tile '256x8' cannot run.*274,432 B"):
        apply_plan(prog, [{"name": "lowered_decode", "params": {"attn_tile": "256x8"}}], mode="tolerance")
    from tkcc.agents.search import SearchSpace

    sp = SearchSpace.from_registry(["lowered_decode"], exact_only=False, device="cuda")
    assert "256x8" not in sp.space_of(sp.passes[0])["attn_tile"] and sp.pruned["lowered_decode"]


@pytest.mark.slow
def test_tile_shared_memory_from_the_compiled_kernel():
    """The fused attention compiled for sm_90 (no GPU needed): 256x8 at head dim 128 needs more than an H200
    gives a block, 64x4 does not."""
    from tkcc.passes.lower import space

    assert space.attention_smem(90, 1, 128, True, "256x8") > 232448
    assert space.attention_smem(90, 4, 64, False, "64x4") < 232448


# ---- GPU -----------------------------------------------------------------------------------------------------



@pytest.mark.parametrize("family", ["norms", "gemv", "gather", "packing", "attention", "moe", "scaled_residual",
                                    "residual2", "norm_readers"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_rewrite_matches_its_pattern_gpu_bf16(family):
    from tkcc.passes.lower.checks import run_checks

    rows = run_checks("cuda", torch.bfloat16, [family])
    bad = [r for r in rows if not r["ok"]]
    assert rows and not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama-tiny", "olmoe-tiny"])
def test_lowered_decode_greedy_on_gpu_bf16(name, tmp_path):
    """Through the front door: the lowered step (PDL, replayed from the decode CUDA graph; llama-tiny's configs
    tuned on the device) keeps the captured graph's greedy tokens over 32 steps."""
    import tkcc
    from tkcc.frontend.generate import greedy
    from tkcc.frontend.models import build_model

    m = build_model(name, torch.bfloat16, "cuda", seed=4)
    plan = [{"name": "lowered_decode", "params": {"tune": name == "llama-tiny", "tune_context": 128}}]
    compiled = tkcc.compile(m, plan=plan, mode="tolerance", measure=False, max_cache_len=256, out_dir=tmp_path,
                            progress=False)
    if name == "llama-tiny":  # tuned on the device: the picks are literals of the artifact's source
        notes = [n for log in compiled.logs for n in log.notes]
        assert any("tuned GEMV" in n for n in notes) and any("tuned attention" in n for n in notes), notes
    assert compiled.serves == "artifact"
    src = compiled.artifact.source("decode")
    assert "torch.ops.tkcc.attention_rope.default(" in src and "aten.scaled_dot_product_attention" not in src
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1)).cuda()
    ref = greedy(compiled.program, prompt, 32)  # the captured graphs
    got = compiled.generate(prompt, 32)  # the artifact's forwards, the decode step replayed from its CUDA graph
    assert torch.equal(ref.cpu(), got.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_prunes_the_tile_it_cannot_run():
    from tkcc.passes.lower import space

    limits = space.device_limits("cuda")
    bad = space.pruned_tiles(limits, [(1, 128, True)])
    if limits[1] < 274432:
        assert "256x8" in bad
    assert "64x4" not in bad


def test_tuning_picks_the_fastest_config_and_writes_it_into_the_graph(captured):
    """With a fake clock: each GEMV group takes the config its timer said was fastest, the attention layout the
    fastest (chunk, tile), and the timing leaves the cache as it was; the picks are literals of the graph."""
    from tkcc.kernels import gemv as gemv_mod
    from tkcc.passes.lower import space, tune
    from tkcc.passes.manager import apply_plan

    prog = captured["llama-tiny", "float32"]
    new, _ = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance", check_numerics=False)
    gm = new.graphs["decode"]
    clock, calls = every_nth_fastest(len(gemv_mod.CONFIGS), 5)  # the 6th config of every group is the fastest

    got = tune.tune_gemvs(gm, clock)
    assert len(got) == 6 and len(calls) == 6 * len(gemv_mod.CONFIGS)
    # then in the whole step: the top-ranked configs of each group again; a clock that favours none keeps them
    steps = []
    kept = tune.refine_in_step(gm, lambda fn: (fn(), steps.append(1), 1.0)[2], got, 20)
    assert len(kept) == 6 and len(steps) == 6 * 3 and all(v[0] == list(gemv_mod.CONFIGS[5]) for v in kept.values())
    want = list(gemv_mod.CONFIGS[5])
    for n in gm.graph.nodes:
        if n.target is torch.ops.tkcc.gemv.default:
            assert list(n.args[7]) == want
        elif n.target is torch.ops.tkcc.gemv_gather.default:
            assert list(n.args[5]) == want
    before = [b.clone() for b in prog.state.buffers()]
    tiles = ["32x4", "16x4"]
    layouts = [(c, t) for c in [c for c in space.ATTN_CHUNKS if c and c < 32] + [32] for t in tiles]
    order = iter(range(len(layouts)))
    picked = tune.tune_attention(gm, lambda fn: (fn(), 0.5 if next(order) == 1 else 1.0)[1], 20, tiles)
    assert (picked["attn_chunk"], picked["attn_tile"]) == layouts[1]
    assert all(torch.equal(a, b) for a, b in zip(before, prog.state.buffers()))
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.tkcc.attention_rope.default]
    bs, nw = space.parse_tile(layouts[1][1])
    assert all(tuple(n.args[12:15]) == (layouts[1][0], bs, nw) for n in fused)
    gm.recompile()
    _same_decode(prog, new)


def test_the_whole_step_picks_among_the_attention_layouts_fastest_alone(captured):
    """Fake clocks: alone, the first layout is the fastest; inside the whole step, the third. The step's pick goes
    into every fused attention node, the timing leaves the cache as it was, and the step still computes the
    captured graph's logits."""
    from tkcc.passes.lower import space, tune
    from tkcc.passes.manager import apply_plan

    prog = captured["llama-tiny", "float32"]
    new, _ = apply_plan(prog, [{"name": "lowered_decode", "params": {"tune": False}}], mode="tolerance",
                        check_numerics=False)
    gm = new.graphs["decode"]
    order = iter(range(100))
    alone = tune.tune_attention(gm, lambda fn: (fn(), 1.0 + next(order))[1], 20, ["32x4", "16x4", "64x4", "32x2"])
    assert alone["ranked"] == [(32, "32x4"), (32, "16x4"), (32, "64x4"), (32, "32x2")]
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.tkcc.attention_rope.default]
    want = (32, "64x4")

    def in_step(fn):
        fn()
        return 0.5 if tuple(fused[0].args[12:15]) == (32, *space.parse_tile(want[1])) else 1.0

    before = [b.clone() for b in prog.state.buffers()]
    kept = tune.refine_in_step(gm, in_step, {}, 20, attention=alone)
    assert kept["attention layout"] == (want, 0.5)
    assert all(tuple(n.args[12:15]) == (32, *space.parse_tile(want[1])) for n in fused)
    assert all(torch.equal(a, b) for a, b in zip(before, prog.state.buffers()))
    gm.recompile()
    _same_decode(prog, new)


def test_one_layout_for_every_context_is_the_one_least_behind_each_contexts_fastest(captured):
    """Fake clocks: alone (at the middle context) 32x4 ranks first; in the whole step it is the fastest at the
    middle context but twice the best at the short and long ones, where 16x4 is always within 10%. The layout
    kept for every context is 16x4, written into every fused attention node; the timing leaves the cache as it
    was, and the step still computes the captured graph's logits."""
    from tkcc.passes.lower import space, tune
    from tkcc.passes.manager import apply_plan

    prog = captured["llama-tiny", "float32"]
    new, _ = apply_plan(prog, [{"name": "lowered_decode", "params": {"tune": False}}], mode="tolerance",
                        check_numerics=False)
    gm = new.graphs["decode"]
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.tkcc.attention_rope.default]
    tiles = ["32x4", "16x4", "64x4", "32x2"]
    in_step = {"32x4": {5: 2.0, 13: 1.0, 21: 2.0}, "16x4": {5: 1.1, 13: 1.1, 21: 1.1},
               "64x4": {5: 1.0, 13: 3.0, 21: 3.0}, "32x2": {5: 9.0, 13: 9.0, 21: 9.0}}
    alone, seen = iter(range(100)), []

    def clock(fn):
        fn()
        context = getattr(fn, "context", None)
        if context is None:  # an attention timed alone: ranked in the order of ``tiles``
            return 1.0 + next(alone)
        tile = next(t for t in tiles if space.parse_tile(t) == tuple(fused[0].args[13:15]))
        seen.append((tile, context))
        return in_step[tile][context]

    before = [b.clone() for b in prog.state.buffers()]
    got = tune.tune_layout_across(gm, clock, [20, 4, 12], tiles)
    S = tune.cache_length(gm)
    assert got["layout"] == (S, "16x4") and got["us"] == {5: 1.1, 13: 1.1, 21: 1.1}
    assert abs(got["ratio"] - (1.1 / 1.0 + 1.1 / 1.0 + 1.1 / 1.1) / 3) < 1e-9  # the fastest: 1.0, 1.0, 1.1
    # the shortlist (the three fastest alone) each timed at every context; 32x2, ranked last alone, never
    assert sorted(seen) == sorted((t, c) for t in ("32x4", "16x4", "64x4") for c in (5, 13, 21))
    bs, nw = space.parse_tile("16x4")
    assert all(tuple(n.args[12:15]) == (S, bs, nw) for n in fused)
    assert all(torch.equal(a, b) for a, b in zip(before, prog.state.buffers()))
    gm.recompile()
    _same_decode(prog, new)


def test_splits_sized_to_the_context_are_a_layout_the_tuner_times_and_writes():
    """A chunk of -N: N splits the kernel sizes to each step's context (as many as the cache holds chunks of 16,
    one split when not two). With a cache that holds them, the tuner times -4 and -8 after the fixed chunks, with
    the two tiles that ranked fastest there (a fake clock that favours -8), writes the pick into every fused
    attention node, and the step still computes the captured graph's logits."""
    from tkcc.frontend.capture import capture_model
    from tkcc.kernels.lowered import attention_layout
    from tkcc.passes.lower import space, tune
    from tkcc.passes.manager import apply_plan

    assert attention_layout(4096, -8) == (-8, 8) and attention_layout(40, -8) == (-2, 2)
    assert attention_layout(20, -8) == (20, 1) and attention_layout(4096, 256) == (256, 16)
    prog = capture_model("llama-tiny", "float32", "cpu", max_cache_len=128, phases=["decode"])
    new, _ = apply_plan(prog, [{"name": "lowered_decode", "params": {"tune": False}}], mode="tolerance",
                        check_numerics=False)
    gm = new.graphs["decode"]
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.tkcc.attention_rope.default]
    # the tuner's order: chunk 64, then the cache (128), each with the three tiles; then -4 and -8 (-16 needs 256
    # positions) with the two tiles fastest so far (16x4, 64x4) only
    order = [(64, "32x4"), (64, "16x4"), (64, "64x4"), (128, "32x4"), (128, "16x4"), (128, "64x4"),
             (-4, "16x4"), (-4, "64x4"), (-8, "16x4"), (-8, "64x4")]
    us = [3.0, 1.0, 2.0, 3.1, 1.1, 2.1, 1.5, 1.6, 0.5, 0.6]
    calls = iter(range(100))

    def clock(fn):
        fn()
        return us[next(calls)]

    picked = tune.tune_attention(gm, clock, 100, ["32x4", "16x4", "64x4"])
    assert next(calls) == len(order)  # nothing else was timed
    assert picked["ranked"] == [order[i] for i in sorted(range(len(us)), key=us.__getitem__)]
    assert picked["attn_chunk"] == -8 and all(tuple(n.args[12:15]) == (-8, *space.parse_tile("16x4")) for n in fused)
    gm.recompile()
    assert ", -8, 16, 4, " in gm.code and tune.chunk_name(-8) == "8 splits sized to the context"
    _same_decode(prog, new)


def test_a_layout_for_every_context_is_judged_where_the_cache_reaches():
    from tkcc.passes.lower.decode import span_contexts

    assert span_contexts(32768) == [128, 2048, 8192]
    assert span_contexts(4096) == [128, 2048]
    assert span_contexts(100) == [99]
    assert span_contexts(None) == [] and span_contexts(0) == []


def test_the_step_times_the_fastest_layouts_and_every_other_chunks_fastest_tile():
    from tkcc.passes.lower.tune import layout_candidates

    ranked = [(512, "128x8"), (512, "64x4"), (1024, "128x8"), (512, "32x4"), (64, "32x4"), (64, "64x4"),
              (256, "16x4")]
    assert layout_candidates(ranked) == [(512, "128x8"), (512, "64x4"), (1024, "128x8"), (64, "32x4"),
                                         (256, "16x4")]
    assert layout_candidates(ranked[:1]) == ranked[:1] and layout_candidates([]) == []


def test_exact_declared_rewrites_are_bit_exact(captured):
    """Every rewrite declared exact, applied alone to the captured graph (after the bit-exact canonical form),
    changes no bit of the logits or the cache; the regions it replaced are gone."""
    from tkcc.passes.graph_pass import clone_graph_module
    from tkcc.passes.lower import pattern
    from tkcc.passes.lower.decode import stages

    exact = [rw for _stage, rws in stages() for rw in rws if rw.exact]
    assert {rw.name for rw in exact} >= {"causal_mask", "sliding_window_mask", "rotary_cos_sin", "layer_norm"}
    for dt in ("float32", "bfloat16"):
        prog = captured["llama-tiny", dt]
        gm = clone_graph_module(prog.graphs["decode"])
        pattern.canonicalize(gm.graph)
        done = 0
        for rw in exact:
            done += pattern.apply(rw, gm, getattr(torch, dt)).replaced
        assert done >= 2  # the mask and the rotary table at least
        gm.graph.lint()
        gm.recompile()
        _same_decode(prog, prog.with_graphs({"decode": gm}))


def test_a_context_past_the_cache_is_a_clear_error(captured):
    from tkcc.errors import TkccError
    from tkcc.passes.manager import apply_plan

    prog = captured["llama-tiny", "float32"]
    new, _ = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance", check_numerics=False)
    S = prog.meta["max_cache_len"]
    with pytest.raises(TkccError, match=rf"longer than the static cache \({S} positions\)"):
        new.graphs["decode"](torch.tensor([[3]]), torch.tensor([S]))


def test_fused_nodes_sit_in_the_module_that_holds_their_whole_region(captured):
    """A norm folded into the projection after it is in their decoder layer, not in the norm's module: passes
    that find regions by module (decode_fusion's norms) never take a fused node for a norm."""
    from tkcc.passes.manager import apply_plan

    prog = captured["olmoe-tiny", "float32"]
    new, _ = apply_plan(prog, [{"name": "lowered_decode"}, {"name": "decode_fusion"}], mode="tolerance")
    gm = new.graphs["decode"]
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("tkcc."):
            paths = [v[0] for v in (n.meta.get("nn_module_stack") or {}).values()]
            assert not any(p.endswith("norm") for p in paths), (n.name, paths)
    _same_decode(prog, new)


@pytest.mark.slow
def test_lowered_kernel_hooks_compile_for_sm90():
    """The Triton interpreter is lenient about types; the real compiler is not: every hook only the lowered step
    launches compiles for sm_90 (no GPU needed), the weight streams with 16-byte loads."""
    from tkcc.kernels.aot import compile_all, lowered_variants

    rows = compile_all(90, which=lowered_variants())
    assert len(rows) == len(lowered_variants())
    assert all(r["wide_loads"] > 0 for r in rows if r["kernel"] in ("gemv_kernel", "attn_rope_kernel")), rows


def test_the_space_is_the_ops_own_config_lists():
    """The pass's values are spelled in its module (the registry loads without triton) but are the kernels' own."""
    from tkcc.kernels import attention_rope, gemv
    from tkcc.passes.lower import space
    from tkcc.passes.lower.decode import LoweredDecode

    assert LoweredDecode.params["gemv_config"] == ["auto"] + ["x".join(map(str, c)) for c in gemv.CONFIGS]
    assert [space.parse_tile(t) for t in LoweredDecode.params["attn_tile"]] == list(attention_rope.TILES)
    assert LoweredDecode.params["attn_chunk"] == [0] + list(attention_rope.CHUNKS)
    assert [space.parse_gemv(c) for c in space.GEMV_CONFIGS[1:]] == [tuple(c) for c in gemv.CONFIGS]


def test_a_head_shape_the_kernel_cannot_run_at_all_prunes_nothing(monkeypatch):
    """DeepSeek-V3-tiny's 8-wide heads compile at no tile (tl.dot needs 16): that shape says nothing about the
    tiles (its attention is MLA's, not this kernel's), so the space is pruned by the other shapes only."""
    from tkcc.passes.lower import space

    def smem(arch, G, D, qk, tile, pdl=True):
        if D < 16:
            raise RuntimeError("Input shapes should have M >= 1, N >= 1 and K >= 16")
        return 274432 if tile == "256x8" else 12288

    def needs(arch, shapes):
        return {(t, G, D, qk): smem(arch, G, D, qk, t) for t in space.ATTN_TILES for G, D, qk in shapes}
    monkeypatch.setattr(space, "attention_smem", smem)
    monkeypatch.setattr(space, "attention_needs", needs)
    assert space.pruned_tiles((90, 232448), [(1, 8, False)]) == {}
    assert list(space.pruned_tiles((90, 232448), [(1, 8, False), (1, 128, True)])) == ["256x8"]


# ---- under the interpreter (one subprocess, started with the module: these read it, last) ----------------------

@pytest.mark.parametrize("dtype", list(CHECKS))
def test_every_rewrite_matches_its_pattern_under_the_interpreter(interpreter_run, dtype):
    (res,) = [r for r in interpreter_run.lines() if r.get("dtype") == dtype]
    failed = [r for r in res["rows"] if not r["ok"]]
    assert len(res["rows"]) >= 8 and not failed, json.dumps(failed, indent=1)
    assert not [k for k in res["fallbacks"] if k.startswith("tkcc.")], res["fallbacks"]  # the kernels ran


def test_greedy_tokens_identical_to_the_captured_graph_under_the_interpreter(interpreter_run):
    rows = [r for r in interpreter_run.lines() if "model" in r]
    assert [r["model"] for r in rows] == GREEDY
    for r in rows:
        assert r["got"] == r["ref"], r
        if r["model"] == "olmoe-tiny":  # (random tied embeddings make llama-tiny repeat its token: the logits
            assert len(set(r["ref"])) > 4, r  # of every step, compared below, carry that check)
        assert r["logits_rel_err"] < 1e-4, r
        assert "attention_rope" in r["ops"] and "gemv" in r["ops"], r
        assert not [k for k in r["fallbacks"] if k.startswith("tkcc.")], r  # the kernels ran


def test_an_all_true_mask_term_is_dropped_and_nothing_else():
    """The canonical form's ``m & p``: p built from ``ones`` through casts, views and a gather is all True, so m & p
    is m, bit for bit; a term of another value, or one that broadcasts m to a larger shape, is kept."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tkcc.passes.lower import pattern

    def step(m, idx, z):
        ones = torch.ones(1, 8, dtype=torch.long).to(torch.bool)
        pad = ones[idx[:, None], torch.arange(8)[None, :]].view(1, 1, 1, 8)
        kept = m & (z > 0).view(1, 1, 1, 8)  # not all True by construction
        wide = m[:, :, :1, :1] & pad  # broadcasts m to pad's shape: kept
        return (m & pad) | kept, wide

    m = torch.rand(1, 1, 1, 8) > 0.5
    args = (m, torch.zeros(1, dtype=torch.long), torch.randn(8))
    gm = make_fx(step, tracing_mode="fake")(*args)
    want = step(*args)
    ands = lambda: sum(n.target in pattern._ANDS for n in gm.graph.nodes)  # noqa: E731
    assert ands() == 3
    assert pattern._true_masks(gm.graph) == 1  # the and (its ones chain is still read by ``wide``)
    gm.graph.lint()
    gm.recompile()
    assert ands() == 2  # only the all-True term went
    assert all(torch.equal(a, b) for a, b in zip(gm(*args), want))


def test_rmsnorm_fallback_keeps_the_weight_form_and_the_residual():
    """Off the kernel (CPU without the interpreter), ``rmsnorm`` with a residual and Gemma's ``1 + w`` form (or an
    fp32-first cast) normalises ``x + r`` in that form and returns ``(norm, x + r)``, as the kernel does."""
    from tkcc.kernels.lowered import rms_norm_ref
    from tkcc.kernels.rmsnorm import rmsnorm

    g = torch.Generator().manual_seed(3)
    for shape in ((1, 64), (3, 48)):
        x, r = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        w = torch.randn(shape[-1], generator=g)
        for offset, cast_first in ((1.0, True), (0.0, False)):
            y, h = rmsnorm(x, w, 1e-6, residual=r, offset=offset, cast_first=cast_first)
            assert torch.equal(h, x + r)
            assert torch.equal(y, rms_norm_ref(x + r, w, 1e-6, offset, cast_first, None))
            assert not torch.equal(y, rms_norm_ref(x, w, 1e-6, offset, cast_first, None))
