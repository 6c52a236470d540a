"""A model that cannot be captured whole: CaptureError lists every graph break with file, line, reason, fix."""
from __future__ import annotations

import inspect

import pytest
import torch

from tkcc.errors import CaptureError
from tkcc.frontend import capture
from tkcc.frontend.graph_breaks import suggest_fix


class Breaky(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        print("forward called")  # BREAK:print
        if y.sum() > 0:  # BREAK:branch
            y = y * 2
        k = int(y.abs().max().item())  # BREAK:item
        return y[:, : k % 4 + 1]


def _line(tag: str) -> int:
    src, start = inspect.getsourcelines(Breaky.forward)
    return next(start + i for i, text in enumerate(src) if f"BREAK:{tag}" in text)


def test_every_break_is_listed_with_file_line_reason_and_fix(capsys):
    with pytest.raises(CaptureError) as info:
        capture(Breaky().eval(), example_inputs=(torch.randn(2, 4),))
    err = info.value
    msg = str(err)
    here = __file__
    found = {(b.file, b.line) for b in err.breaks}
    for tag in ("print", "branch", "item"):
        assert (here, _line(tag)) in found, f"break at {tag} missing:\n{msg}"
        assert f"{here}:{_line(tag)}" in msg
    by_line = {b.line: b for b in err.breaks}
    assert "print" in by_line[_line("print")].reason
    assert "torch.where" in by_line[_line("branch")].fix or "torch.cond" in by_line[_line("branch")].fix
    assert ".item()" in by_line[_line("item")].fix
    assert msg.startswith("cannot capture module Breaky as one whole graph")
    assert msg.count("change:") == len(err.breaks) and msg.count("reason:") == len(err.breaks)
    assert "torch.export failed with" in msg
    # torch.export's partial-graph dump is not sprayed over stderr; the error carries the story.
    assert "def forward(self, arg0_1" not in capsys.readouterr().err


def test_data_dependent_shape_break_suggests_a_fixed_shape():
    class Nonzero(torch.nn.Module):
        def forward(self, x):
            idx = torch.nonzero(x > 0)
            if idx.shape[0] > 3:
                return x * 2
            return x

    with pytest.raises(CaptureError) as info:
        capture(Nonzero(), example_inputs=(torch.randn(8),))
    assert info.value.breaks and all(b.fix for b in info.value.breaks)
    assert any(b.file == __file__ for b in info.value.breaks)


def test_suggestions_by_reason():
    assert "tensor" in suggest_fix("Unsupported Tensor.item() call with capture_scalar_outputs=False")
    assert "print" in suggest_fix("Failed to trace builtin operator `print`")
    assert "torch.where" in suggest_fix("generic_jump TensorVariable()")
    assert "fixed-shape" in suggest_fix("dynamic shape operator: aten.nonzero.default")
    assert suggest_fix("something new\n  Hint: do the other thing") == "do the other thing"


def test_hf_moe_with_eager_experts_names_tkcc_frame_module_and_setting():
    """transformers' 'eager' experts loop over nonzero(): the error leads with tkcc's frame and the reason, names
    the model's module and line where export stopped, and says what to configure (never what to rewrite)."""
    pytest.importorskip("transformers")
    from tkcc.frontend.models import build_model

    model = build_model("olmoe-tiny")
    model.config._experts_implementation = "eager"
    with pytest.raises(CaptureError) as info:
        capture(model, max_cache_len=16, phases=["decode"])
    msg = str(info.value)
    assert msg.startswith("tkcc.frontend.hf.capture_hf: cannot capture the decode step of OlmoeForCausalLM")
    assert "modeling_olmoe.py" in msg and "model.layers.0.mlp.experts, OlmoeExperts" in msg
    assert "data-dependent" in msg and "batched_mm" in msg
    assert "change:" not in msg and "rewrite" not in msg
    assert len(info.value.breaks) == 1 and info.value.breaks[0].line > 0


def test_a_family_tkcc_cannot_capture_is_refused_by_name_before_export(monkeypatch):
    """Inkling's hybrid layers keep keys and values *and* conv windows in one cache layer (transformers'
    LinearAttentionAndSlidingWindowAttentionLayer): refused at the probe step, naming tkcc's frame, the layer,
    what it keeps and what tkcc captures; cheaply: neither torch.export nor dynamo's explain runs."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.AutoConfig.for_model(
        "inkling_text", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        vocab_size=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    called = []
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: called.append("export"))
    monkeypatch.setattr(torch._dynamo, "explain", lambda *a, **k: called.append("explain"))
    with pytest.raises(CaptureError) as info:
        capture(model, max_cache_len=16)
    assert called == []  # refused at the probe's one eager step
    msg = str(info.value)
    assert msg.startswith("tkcc.frontend.hf_cache.probe_layout: cannot capture InklingForCausalLM")
    assert "layer 0 (hybrid_sliding)" in msg and "LinearAttentionAndSlidingWindowAttentionLayer" in msg
    assert "conv_states[0] (1, 2048, 4)" in msg and "keys (1, 16, 1, 128)" in msg
    assert "LinearAttentionLayer, or" in msg and "MiniMaxCache" in msg
    assert "modeling_inkling.py" not in msg


def test_a_data_dependent_failure_outside_experts_gets_no_moe_advice():
    """XGLM's sinusoidal positions branch on a tensor's value: the refusal names the model's module and line, and
    says tkcc does not capture that code; the MoE experts setting is offered only where the failure is an experts'."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.XGLMConfig(d_model=64, ffn_dim=128, num_layers=2, attention_heads=4, vocab_size=256,
                                  max_position_embeddings=256)
    cfg._attn_implementation = "eager"  # (XGLM has no sdpa form)
    model = transformers.XGLMForCausalLM(cfg).eval()
    with pytest.raises(CaptureError) as info:
        capture(model, max_cache_len=16, phases=["decode"])
    msg = str(info.value)
    assert "data-dependent" in msg and "XGLMSinusoidalPositionalEmbedding" in msg
    assert "experts" not in msg and "tkcc does not capture this model's code yet" in msg


@pytest.mark.parametrize("family", ["opt", "bloom"])
def test_a_model_that_sizes_its_mask_by_the_cache_is_captured_and_generates_as_hf(family, tmp_path):
    """OPT and BLOOM build ``ones(batch, past_seen_tokens + T)`` as their mask when given none, which over tkcc's
    cache is data-dependent: the step gives them an all-ones mask over the whole cache instead (only them: Llama is
    captured without one), and the front door's greedy tokens are the model's own ``generate``'s."""
    transformers = pytest.importorskip("transformers")
    import tkcc
    from tkcc.frontend.models import build_model

    if family == "opt":
        cfg = transformers.OPTConfig(hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=256, max_position_embeddings=256)
    else:
        cfg = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=256)
    cfg._attn_implementation = "sdpa" if family == "opt" else "eager"  # BLOOM's alibi attention has no sdpa form
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    prog = capture(model, max_cache_len=32, phases=["prefill", "decode"])
    assert prog.meta["static_mask"] is True
    assert capture(build_model("llama-tiny"), max_cache_len=16, phases=["decode"]).meta["static_mask"] is False
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    compiled = tkcc.compile(model, plan=[], measure=False, max_cache_len=32, out_dir=tmp_path, progress=False)
    got = compiled.generate(ids, 6)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                          pad_token_id=0)
    assert torch.equal(got.reshape(-1)[-6:], want.reshape(-1)[-6:]), (got, want)
