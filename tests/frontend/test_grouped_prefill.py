"""The experts implementation each phase of an MoE model is captured with (``tkcc.frontend.hf.experts_for_phase``).

On a GPU in bf16 a model set to ``batched_mm`` (the registry's MoE models) has its prefill captured with
``grouped_mm``, and one set to ``grouped_mm`` (transformers' default on a GPU) has its decode captured with
``batched_mm`` (``benchmarks/prefill.py`` times the prefill on an H200). Here both are forced on a CPU in fp32
(exported there, transformers groups the experts with its own fallback op): each captured graph is held to the
model's own eager step, with its own setting, on fresh random inputs of several shapes, and the model's setting
is the same afterwards.
"""
import pytest
import torch

from tkcc.frontend import capture, hf
from tkcc.frontend.models import build_model
from tkcc.traffic.workload import Bucket

pytestmark = pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm") and not hasattr(torch, "_grouped_mm"),
                                reason="this torch has no grouped GEMM")


def _ops(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def _grouped(ops) -> bool:
    return any("grouped_mm" in op for op in ops)


def _set_experts(model, impl):
    for c in hf.experts_configs(model):
        c._experts_implementation = impl


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["olmoe-tiny", "qwen3moe-tiny"])
def test_forced_grouped_prefill_matches_the_eager_step(monkeypatch, name):
    monkeypatch.setattr(hf, "capture_experts", lambda model, phase: "grouped_mm" if phase == "prefill" else None)
    model = build_model(name)
    prog = capture(model, max_cache_len=64)
    pre, dec = _ops(prog.graphs["prefill"]), _ops(prog.graphs["decode"])
    assert _grouped(pre) and "aten.bmm.default" not in pre
    assert "aten.bmm.default" in dec and not _grouped(dec)
    assert model.config.get_text_config()._experts_implementation == "batched_mm"  # put back
    gen = torch.Generator().manual_seed(1234)
    vocab = prog.meta["vocab_size"]
    for t in (1, 5, 17, 40):
        ids = torch.randint(0, vocab, (1, t), generator=gen)
        pos = torch.arange(t)
        with torch.no_grad():
            prog.reset_state()
            want = prog.eager(ids, pos)
            want_state = [b.clone() for b in prog.state.buffers()]
            prog.reset_state()
            got = prog.graphs["prefill"](ids, pos)
        _close(got, want)
        for a, b in zip(prog.state.buffers(), want_state):
            _close(a, b)


def test_forced_batched_decode_of_a_grouped_model_matches_the_eager_step(monkeypatch):
    monkeypatch.setattr(hf, "capture_experts", lambda model, phase: "batched_mm" if phase == "decode" else None)
    model = build_model("olmoe-tiny")
    _set_experts(model, "grouped_mm")  # what transformers picks on a GPU by default
    prog = capture(model, max_cache_len=64)
    pre, dec = _ops(prog.graphs["prefill"]), _ops(prog.graphs["decode"])
    assert "aten.bmm.default" in dec and not _grouped(dec)
    assert _grouped(pre)
    assert model.config.get_text_config()._experts_implementation == "grouped_mm"
    gen = torch.Generator().manual_seed(4321)
    for ctx in (3, 20, 60):
        ids, pos = prog.make_inputs["decode"](Bucket("decode", batch=1, context=ctx), gen)
        snap = [b.clone() for b in prog.state.buffers()]
        with torch.no_grad():
            want = prog.eager(ids, pos)
            want_state = [b.clone() for b in prog.state.buffers()]
            for b, s in zip(prog.state.buffers(), snap):
                b.copy_(s)
            got = prog.graphs["decode"](ids, pos)
        _close(got, want)
        for a, b in zip(prog.state.buffers(), want_state):
            _close(a, b)


def test_which_phase_switches(monkeypatch):
    monkeypatch.setattr(hf, "_grouped_mm_available", lambda device: True)
    bf16, cuda = torch.bfloat16, "cuda"
    f = hf.experts_for_phase
    assert f("batched_mm", "prefill", cuda, bf16) == "grouped_mm"
    assert f("batched_mm", "decode", cuda, bf16) is None
    assert f("grouped_mm", "decode", cuda, bf16) == "batched_mm"
    assert f("grouped_mm", "prefill", cuda, bf16) is None
    for impl, dev, dt in (("batched_mm", "cpu", bf16), ("batched_mm", cuda, torch.float32),
                          ("grouped_mm", cuda, torch.float16), ("eager", cuda, bf16), (None, cuda, bf16)):
        assert f(impl, "prefill", dev, dt) is None and f(impl, "decode", dev, dt) is None
    monkeypatch.setattr(hf, "_grouped_mm_available", lambda device: False)
    assert f("batched_mm", "prefill", cuda, bf16) is None  # no grouped GEMM: batched_mm stays
    assert hf.capture_experts(build_model("olmoe-tiny"), "prefill") is None  # a CPU model keeps its own
    assert hf.capture_experts(build_model("llama-tiny"), "prefill") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_bf16_prefill_is_grouped_and_agrees_with_the_eager_step():
    model = build_model("olmoe-tiny", dtype=torch.bfloat16, device="cuda")
    prog = capture(model, max_cache_len=64)
    assert "aten._grouped_mm.default" in _ops(prog.graphs["prefill"])
    assert "aten.bmm.default" in _ops(prog.graphs["decode"])
    gen = torch.Generator().manual_seed(99)
    for t in (3, 33):
        ids = torch.randint(0, prog.meta["vocab_size"], (1, t), generator=gen).cuda()
        pos = torch.arange(t, device="cuda")
        with torch.no_grad():
            prog.reset_state()
            want = prog.eager(ids, pos).float()
            prog.reset_state()
            got = prog.graphs["prefill"](ids, pos).float()
        assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())
