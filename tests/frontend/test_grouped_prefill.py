"""The prefill of a batched_mm MoE model captured with grouped_mm experts (``tkcc.frontend.hf._experts_for``).

On a GPU in bf16 the switch is automatic (``benchmarks/prefill.py`` times it on an H200). Here it is forced on
a CPU in fp32 (exported there, transformers groups the experts with its own fallback op): the captured prefill graph (grouped) is held to the
model's own eager step (batched_mm) on fresh random prompts of several lengths, the decode graph keeps
``batched_mm``, and the model's setting is the same afterwards.
"""
import pytest
import torch

from tkcc.frontend import capture, hf
from tkcc.frontend.models import build_model

pytestmark = pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm") and not hasattr(torch, "_grouped_mm"),
                                reason="this torch has no grouped GEMM")


def _ops(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("name", ["olmoe-tiny", "qwen3moe-tiny"])
def test_forced_grouped_prefill_matches_the_eager_step(monkeypatch, name):
    monkeypatch.setattr(hf, "_grouped_prefill", lambda model, phase: phase == "prefill")
    model = build_model(name)
    prog = capture(model, max_cache_len=64)
    pre, dec = _ops(prog.graphs["prefill"]), _ops(prog.graphs["decode"])
    # on the GPU in bf16 the op is aten._grouped_mm (benchmarks/prefill.py lists it); exporting fp32, transformers
    # takes its own per-expert fallback op: the same experts arithmetic, grouped by expert
    assert any("grouped_mm" in op for op in pre) and "aten.bmm.default" not in pre
    assert "aten.bmm.default" in dec and not any("grouped_mm" in op for op in dec)
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
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, b in zip(prog.state.buffers(), want_state):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_switch_is_cuda_bf16_batched_mm_prefill_only():
    model = build_model("olmoe-tiny")  # CPU, fp32
    assert not hf._grouped_prefill(model, "prefill") and not hf._grouped_prefill(model, "decode")
    llama = build_model("llama-tiny")
    assert not hf._grouped_prefill(llama, "prefill")


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
