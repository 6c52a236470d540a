"""Target choice: the decode passes take the kernel target (Triton or CUDA C++) and the CUDA variant as search
parameters, pass them into the ops they insert, refuse a target the Program's device cannot run; artifacts
record their targets and refuse to load where a target cannot run; on the GPU, CUDA vs Triton vs the captured
graph agree (logits and greedy tokens), with and without a CUDA graph."""
import logging

import pytest
import torch

from tkcc.codegen import Artifact, build_artifact
from tkcc.kernels.targets import OP_TARGETS
from tkcc.kernels.targets.cuda import VARIANTS
from tkcc.errors import ArtifactError, PlanError, TkccError
from tkcc.passes.base import get_pass
from tkcc.passes.manager import apply_plan
from tkcc.passes.plan import PassPlan

DECODE_PASSES = ("kv_split_attention", "moe_regroup", "decode_fusion")
CPU_PLAN = PassPlan.of("decode_fusion", "kv_split_attention", "moe_regroup")


@pytest.fixture(scope="module")
def olmoe():
    from tkcc.frontend.capture import capture_model

    return capture_model("olmoe-tiny", "float32", "cpu", max_cache_len=32)


def _op_nodes(gm):
    from tkcc.kernels import ops

    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops.OPS]


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _fill_cache(program, seed):
    g = torch.Generator().manual_seed(seed)
    for _n, buf in program.state.named_buffers():
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf))


# ---- CPU ------------------------------------------------------------------------------------------

def test_passes_offer_target_and_cuda_variants_as_search_parameters():
    from tkcc.agents.search import SearchSpace

    spaces = {n: get_pass(n).params for n in DECODE_PASSES}
    for name, space in spaces.items():
        assert space["target"] == list(OP_TARGETS) == ["triton", "cuda"], name
        assert get_pass(name).defaults()["target"] == "triton"
        assert get_pass(name).version != "1"  # the params changed: caches keyed on the old version are stale
    assert {k: spaces["kv_split_attention"][f"cuda_{k}"] for k in VARIANTS["decode_attention"]} \
        == VARIANTS["decode_attention"]
    assert spaces["decode_fusion"]["cuda_threads"] == VARIANTS["rmsnorm"]["threads"]
    assert spaces["moe_regroup"]["cuda_router_threads"] == VARIANTS["router_topk"]["threads"]
    assert {k: spaces["moe_regroup"][f"cuda_{k}"] for k in VARIANTS["moe_gemv"]} == VARIANTS["moe_gemv"]
    with pytest.raises(PlanError, match="target"):
        get_pass("decode_fusion").check_params({"target": "hip"})
    space = SearchSpace.from_registry(list(DECODE_PASSES), exact_only=False)
    feats = set(space.features())
    for name in DECODE_PASSES:
        assert (name, "target", "cuda") in feats and (name, "target", "triton") in feats


@pytest.mark.parametrize("name", DECODE_PASSES)
def test_cuda_target_on_a_cpu_program_is_a_plan_error(olmoe, name):
    with pytest.raises(PlanError, match=rf"pass '{name}'.*target 'cuda' cannot run on device 'cpu'"):
        apply_plan(olmoe, PassPlan.of((name, {"target": "cuda"})), mode="tolerance")


def test_ops_carry_the_target_and_the_cpu_rewrite_stays_exact(olmoe):
    new, _logs = apply_plan(olmoe, CPU_PLAN, mode="tolerance")
    for phase, gm in new.graphs.items():
        nodes = _op_nodes(gm)
        kinds = {n.target.__name__ for n in nodes}
        assert kinds <= {"moe_block", "rms_norm", "add_rms_norm", "split_kv_attention"} and "rms_norm" in kinds
        if phase == "decode":
            assert kinds == {"moe_block", "rms_norm", "add_rms_norm", "split_kv_attention"}
        for n in nodes:
            assert n.kwargs["target"] == "triton" and not any(k.startswith("cuda_") for k in n.kwargs), n
    for i in range(2):
        inp = olmoe.inputs("decode", generator=torch.Generator().manual_seed(i))
        _fill_cache(olmoe, i)
        ref = _first(olmoe.graphs["decode"](*inp))
        _fill_cache(olmoe, i)
        got = _first(new.graphs["decode"](*inp))
        assert torch.equal(ref, got)


def test_artifact_records_its_targets_and_runs_the_ops(olmoe, tmp_path):
    new, _logs = apply_plan(olmoe, CPU_PLAN, mode="tolerance")
    art = build_artifact(new, CPU_PLAN, tmp_path / "art")
    man = Artifact.open(tmp_path / "art").manifest
    assert man["targets"] == ["triton"] and man["target"] == "triton"
    assert man["runtime"] == ["tkcc.kernels.ops"]
    for phase in new.phases:
        ops = man["phases"][phase]["ops"]
        assert len(ops) == len(_op_nodes(new.graphs[phase])) and all(o["target"] == "triton" for o in ops)
        assert "from tkcc.kernels import ops as _ops" in art.source(phase) and "target='triton'" in art.source(phase)
    assert "_ops.moe_block(" in art.source("decode") and "_ops.split_kv_attention(" in art.source("decode")
    fwd = art.load(olmoe)
    inp = olmoe.inputs("decode", generator=torch.Generator().manual_seed(7))
    _fill_cache(olmoe, 7)
    ref = _first(new.graphs["decode"](*inp))
    _fill_cache(olmoe, 7)
    got = _first(fwd["decode"](*inp))
    assert torch.equal(ref, got)


def test_an_artifact_with_cuda_kernels_is_mixed_and_refuses_to_load_on_cpu(olmoe, tmp_path):
    """A real artifact whose RMSNorm ops run on the CUDA target (as a GPU-built plan would write them; the pass
    itself refuses cuda on this CPU program, so the op nodes are switched by hand)."""
    new, _logs = apply_plan(olmoe, CPU_PLAN, mode="tolerance")
    for gm in new.graphs.values():
        for n in _op_nodes(gm):
            if n.target.__name__ in ("rms_norm", "add_rms_norm"):
                n.kwargs = {**n.kwargs, "target": "cuda", "cuda_threads": 128}
        gm.recompile()
    art = build_artifact(new, CPU_PLAN, tmp_path / "mixed")
    assert art.manifest["targets"] == ["cuda", "triton"] and art.manifest["target"] == "mixed"
    assert "target='cuda', cuda_threads=128" in art.source("decode")
    with pytest.raises(ArtifactError, match=r"'cuda' kernels, which cannot run on this model's device 'cpu'"):
        art.load(olmoe)
    with pytest.raises(ArtifactError, match="'cuda'.*'cpu'"):
        Artifact.open(tmp_path / "mixed").load(olmoe.model, olmoe.state)


def test_the_engine_builds_and_loads_decode_op_plans_and_refuses_cuda_artifacts_on_cpu(olmoe, tmp_path):
    """The engine's candidate loader (tkcc/runtime/candidates.py): a plan with the decode passes becomes an
    artifact and loads; a prebuilt artifact with CUDA kernels is refused on this CPU engine, naming the target."""
    from tkcc.runtime.candidates import Candidate, build_for_tier

    plan = CPU_PLAN.to_json()
    cand = Candidate("plan-ops", "plan", {"plan": plan})
    build_for_tier(cand, "slow", {"slow": olmoe}, str(tmp_path), 1 << 30)
    man = Artifact.open(cand.info["slow"]["artifact"]).manifest
    assert man["targets"] == ["triton"] and not cand.exact
    inp = olmoe.inputs("decode", generator=torch.Generator().manual_seed(11))
    _fill_cache(olmoe, 11)
    ref = _first(olmoe.graphs["decode"](*inp))
    _fill_cache(olmoe, 11)
    assert torch.equal(_first(cand.forwards["slow"]["decode"](*inp)), ref)

    new, _logs = apply_plan(olmoe, CPU_PLAN, mode="tolerance")
    for gm in new.graphs.values():
        for n in _op_nodes(gm):
            if n.target.__name__ == "split_kv_attention":
                n.kwargs = {**n.kwargs, "target": "cuda"}
        gm.recompile()
    build_artifact(new, CPU_PLAN, tmp_path / "cuda-attn", tier=olmoe.num_blocks)
    cand = Candidate("art-cuda", "artifact", {"artifact": str(tmp_path / "cuda-attn")})
    with pytest.raises(ArtifactError, match="'cuda' kernels.*device 'cpu'"):
        build_for_tier(cand, "slow", {"slow": olmoe}, str(tmp_path), 1 << 30)


def test_cuda_dispatch_off_gpu_falls_back_with_a_logged_reason(caplog):
    """On CPU tensors the ops' CUDA path declines (logged), and the result is the Triton/reference path's."""
    from tkcc.kernels import ops
    from tkcc.kernels.common import fallbacks, rms_ref
    from tkcc.kernels.moe import moe_ref

    g = torch.Generator().manual_seed(3)
    H, E, I, K = 32, 8, 16, 2
    x = torch.randn(1, 1, H, generator=g)
    r = torch.randn(1, 1, H, generator=g)
    w = torch.randn(H, generator=g)
    router_w = torch.randn(E, H, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g)
    down = torch.randn(E, H, I, generator=g)
    with caplog.at_level(logging.INFO, logger="tkcc.kernels"):
        y = ops.rms_norm(x, w, 1e-6, target="cuda", cuda_threads=128)
        y2, h = ops.add_rms_norm(r, x, w, 1e-6, target="cuda")
        m = ops.moe_block(x, router_w, gate_up, down, K, False, target="cuda", cuda_warps=8)
    assert torch.equal(y, rms_ref(x, w, 1e-6))
    assert torch.equal(h, r + x) and torch.equal(y2, rms_ref(r + x, w, 1e-6))
    assert torch.equal(m, moe_ref(x.reshape(1, H), torch.nn.functional.linear(x.reshape(1, H), router_w), gate_up,
                                  down, K).view(x.shape))
    q = torch.randn(1, 4, 1, 16, generator=g)
    kc, vc = torch.randn(1, 2, 8, 16, generator=g), torch.randn(1, 2, 8, 16, generator=g)
    pos = torch.tensor([5])
    mask = torch.arange(8)[None, None, None, :] <= pos
    a = ops.split_kv_attention(q, kc, vc, pos, mask, 0.25, 2, target="cuda", cuda_nsplit=16)
    want = torch.nn.functional.scaled_dot_product_attention(q, ops.repeat_kv(kc, 2), ops.repeat_kv(vc, 2),
                                                            attn_mask=mask, scale=0.25)
    assert torch.equal(a, want)
    seen = fallbacks()
    for op in ("rms_norm[cuda]", "add_rms_norm[cuda]", "moe_block[cuda]", "split_kv_attention[cuda]"):
        assert any(k.startswith(f"{op}: device cpu is not an NVIDIA GPU") for k in seen), (op, seen)
    assert "not an NVIDIA GPU" in caplog.text
    with pytest.raises(TkccError, match="unknown kernel target 'hip'"):
        ops.rms_norm(x, w, 1e-6, target="hip")


def test_cuda_kernel_cache_declines_unsupported_shapes_before_building():
    from tkcc.kernels.ops import cuda_kernel

    dev = torch.device("cpu")
    fn, why = cuda_kernel("moe_gemv", torch.bfloat16, dict(T=1, H=60, I=32, E=8, K=2),
                          {"warps": 4, "rows_per_warp": 2}, dev)
    assert fn is None and "multiples of 8" in why
    fn, why = cuda_kernel("decode_attention", torch.float16, dict(B=1, HQ=4, HKV=4, D=20, S=64), {}, dev)
    assert fn is None and "16-byte" in why


def test_every_cuda_variant_the_search_can_pick_compiles_at_decode_shapes():
    """Each value of each cuda_* pass parameter (the others at their defaults), at the shapes the ops build for
    OLMoE/Llama decode steps, renders and compiles for sm_90 through NVRTC: the search never picks a variant
    that could only fall back."""
    from tkcc.kernels.targets import cuda
    from tkcc.kernels.targets.nvrtc import compile_cuda

    shapes = {"decode_fusion": [("rmsnorm", dict(D=2048, residual=True), {"threads": "cuda_threads"}),
                                ("rmsnorm", dict(D=2048, residual=False), {"threads": "cuda_threads"})],
              "moe_regroup": [("router_topk", dict(T=1, E=64, K=8, normalize=False),
                               {"threads": "cuda_router_threads"}),
                              ("moe_gemv", dict(T=1, H=2048, I=1024, E=64, K=8),
                               {"warps": "cuda_warps", "rows_per_warp": "cuda_rows_per_warp"})],
              "kv_split_attention": [("decode_attention", dict(B=1, HQ=32, HKV=8, D=64, S=4096),
                                      {"nsplit": "cuda_nsplit", "warps": "cuda_warps", "unroll": "cuda_unroll"})]}
    built = set()
    for name, specs in shapes.items():
        space = get_pass(name).params
        for family, shape, keys in specs:
            assert cuda.supported(family, torch.bfloat16, shape) is None
            for key, param in keys.items():
                for value in space[param]:
                    variant = {k: space[p][0] for k, p in keys.items()} | {key: value}
                    src = cuda.source(family, "cuda", torch.bfloat16, shape, variant)
                    if src not in built:
                        built.add(src)
                        assert compile_cuda(src, "sm_90", f"{family}.cu")[:4] == b"\x7fELF"
    assert len(built) >= 15


# ---- GPU ------------------------------------------------------------------------------------------



def _plan(target: str) -> PassPlan:
    return PassPlan.of(("decode_fusion", {"target": target}), ("kv_split_attention", {"target": target}),
                       ("moe_regroup", {"target": target}))


def _capture(name: str, mid: bool):
    from tkcc.frontend.capture import capture, capture_model
    from tkcc.frontend.models import build_model

    if not mid:
        return capture_model(name, dtype=torch.bfloat16, device="cuda", max_cache_len=128)
    model = build_model(name, dtype=torch.bfloat16, device="cuda", num_hidden_layers=2)
    return capture(model, max_cache_len=512)


def _agree(prog, fwds: dict, steps: int = 12):
    """Greedy tokens from each forward set vs the captured graphs: identical, except after a step where the
    reference's top-2 logits are closer than the measured logits error (a genuine tie in bf16)."""
    from tkcc.frontend.generate import greedy

    prompt = torch.randint(0, prog.meta["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(0))
    ref_tok, ref_logits = greedy(prog, prompt, steps, return_logits=True)
    for label, fwd in fwds.items():
        tok, logits = greedy(prog, prompt, steps, forwards=fwd, return_logits=True)
        assert torch.isfinite(logits).all(), label
        for i in range(steps):
            err = float((logits[:, i] - ref_logits[:, i]).abs().max())
            rel = float((logits[:, i] - ref_logits[:, i]).norm() / ref_logits[:, i].norm())
            assert rel < 3e-2, (label, i, rel)
            if not torch.equal(tok[:, i], ref_tok[:, i]):
                top2 = ref_logits[0, i].topk(2).values
                assert float(top2[0] - top2[1]) <= 2 * err, (label, i, "greedy token differs without a tie")
                break


@pytest.mark.parametrize("name,mid", [("olmoe-tiny", False), ("llama-tiny", False), ("olmoe-16l", True),
                                      ("llama-1b-16l", True)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_vs_triton_vs_captured_graph(name, mid, tmp_path):
    """Graphs and artifacts of the CUDA-target plan, and of the Triton one, against the captured graphs."""
    from tkcc.kernels import ops
    from tkcc.kernels.common import fallbacks

    prog = _capture(name, mid)
    cuda_prog, _ = apply_plan(prog, _plan("cuda"), mode="tolerance")
    triton_prog, _ = apply_plan(prog, _plan("triton"), mode="tolerance")
    cuda_art = build_artifact(cuda_prog, _plan("cuda"), tmp_path / "cuda")
    triton_art = build_artifact(triton_prog, _plan("triton"), tmp_path / "triton")
    assert cuda_art.manifest["targets"] == ["cuda"] and cuda_art.manifest["target"] == "cuda"
    assert triton_art.manifest["targets"] == ["triton"]
    before = dict(ops.CUDA_CALLS)
    _agree(prog, {"cuda": cuda_prog.graphs, "triton": triton_prog.graphs, "cuda artifact": cuda_art.load(prog),
                  "triton artifact": triton_art.load(prog)})
    ran = {f: n - before.get(f, 0) for f, n in ops.CUDA_CALLS.items() if n > before.get(f, 0)}
    declined = {k for k in fallbacks() if "[cuda]" in k}
    families = {"rmsnorm": "rms_norm", "decode_attention": "split_kv_attention"}
    if prog.meta["family"] != "llama":
        families.update(moe_gemv="moe_block")
    for fam, op in families.items():
        # every family either ran on CUDA or declined with a logged reason (tiny shapes may be too small)
        assert fam in ran or any(k.startswith(op) for k in declined), (fam, ran, declined)
        if mid:
            assert fam in ran, (fam, ran, declined)  # where the kernels apply they must be used


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_ops_inside_a_cuda_graph_follow_the_device_position():
    """The three CUDA-target ops at OLMoE's decode shapes captured in one CUDA graph; each replay at another
    cache position (written to device memory) matches the eager reference."""
    from tkcc.kernels import ops
    from tkcc.kernels.attention import attention_ref
    from tkcc.kernels.common import rms_ref
    from tkcc.kernels.moe import moe_ref

    g = torch.Generator().manual_seed(5)
    dt, H, E, I, K, Hq, D, S = torch.bfloat16, 2048, 64, 1024, 8, 16, 128, 1024

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to("cuda", dt)

    a, b, w = rnd(1, 1, H), rnd(1, 1, H), 1 + rnd(H, scale=0.1)
    router_w, gate_up = rnd(E, H, scale=H ** -0.5), rnd(E, 2 * I, H, scale=H ** -0.5)
    down = rnd(E, H, I, scale=I ** -0.5)
    q, kc, vc = rnd(1, Hq, 1, D), rnd(1, Hq, S, D), rnd(1, Hq, S, D)
    pos = torch.zeros(1, dtype=torch.long, device="cuda")

    def step():
        y, h = ops.add_rms_norm(a, b, w, 1e-6, target="cuda", cuda_threads=128)
        m = ops.moe_block(y, router_w, gate_up, down, K, False, target="cuda", cuda_warps=8)
        o = ops.split_kv_attention(q, kc, vc, pos, None, D ** -0.5, 1, target="cuda", cuda_nsplit=16)
        return y, h, m, o

    before = dict(ops.CUDA_CALLS)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for fam in ("rmsnorm", "router_topk", "moe_gemv", "decode_attention"):
        assert ops.CUDA_CALLS.get(fam, 0) >= before.get(fam, 0) + 2, fam  # warm-up and capture both ran CUDA
    for p in (0, 37, 700, S - 1):
        pos.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        y, h, m, o = (t.float() for t in outs)
        assert torch.equal(h, (a + b).float())
        assert torch.allclose(y, rms_ref(a + b, w, 1e-6).float(), rtol=2e-2, atol=2e-2)
        xs = y.to(dt).reshape(1, H)
        want_m = moe_ref(xs, torch.nn.functional.linear(xs, router_w), gate_up, down, K).float()
        assert float((m.reshape(1, H) - want_m).norm() / want_m.norm()) < 3e-2, p
        want_o = attention_ref(q.reshape(Hq, D), kc[0], vc[0], p + 1, D ** -0.5).float()
        assert torch.allclose(o.reshape(Hq, D), want_o, rtol=2e-2, atol=2e-2), p


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_target_decode_graph_in_the_engines_cuda_graph():
    """The CUDA-target decode graph of a mid-size OLMoE captured whole by the engine's CapturedCall; replays at
    other cache positions match eager calls of the same graph, logits and K/V writes."""
    from tkcc.kernels import ops
    from tkcc.kernels.graph_replay import CapturedCall

    prog = _capture("olmoe-16l", True)
    cuda_prog, _ = apply_plan(prog, _plan("cuda"), mode="tolerance")
    fwd = cuda_prog.graphs["decode"]
    _fill_cache(prog, 0)
    saved = [b.clone() for _n, b in prog.state.named_buffers()]
    ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    before = ops.CUDA_CALLS.get("decode_attention", 0)
    cg = CapturedCall(fwd, (ids, torch.zeros(1, dtype=torch.long, device="cuda")), warmup=3)
    assert ops.CUDA_CALLS["decode_attention"] > before
    g = torch.Generator().manual_seed(1)
    for p in (3, 100, 311):
        inputs = (torch.randint(0, 1000, (1, 1), generator=g).cuda(), torch.tensor([p], device="cuda"))
        for (_n, b), v in zip(prog.state.named_buffers(), saved):
            b.copy_(v)
        got = _first(cg.run(*inputs)).float().clone()
        after_replay = [b.clone() for _n, b in prog.state.named_buffers()]
        for (_n, b), v in zip(prog.state.named_buffers(), saved):
            b.copy_(v)
        with torch.no_grad():
            want = _first(fwd(*inputs)).float()
        assert torch.isfinite(got).all()
        assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max()), p
        for a, (_n, b) in zip(after_replay, prog.state.named_buffers()):
            assert torch.equal(a, b)  # the replay wrote the same K/V into the cache
