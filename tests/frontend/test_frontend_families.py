"""The families beyond Llama and OLMoE through the front door: tkcc.compile (references only) and the shell."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tkcc
from tkcc.frontend import capture
from tkcc.frontend.models import build_model

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def _prompt(seed=3):
    return torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(seed))


# The families whose state is not one K/V shape (the others differ from OLMoE in their blocks only, which a
# references-only compile runs as captured; their capture and greedy tests are in test_frontend_hf.py).
@pytest.mark.parametrize("name", ["deepseekv3-tiny"])
def test_compile_references_only_then_generate_is_hf_generate(name, tmp_path):
    model = build_model(name, initializer_range=0.3)
    prog = capture(model, max_cache_len=64)
    compiled = tkcc.compile(model, "azure-conv", program=prog, budget=0, progress=False, out_dir=tmp_path / "o",
                            measure_max_context=32)
    assert compiled.serves in ("eager", "artifact")
    ids = _prompt()
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)[:, 5:]
    assert torch.equal(compiled.generate(ids, 8), ref)


def test_a_causal_lm_not_named_for_causal_lm_compiles_as_one(tmp_path):
    """GPT-2's head class is ``GPT2LMHeadModel``, which transformers' auto mapping names a causal LM: it is captured
    as prefill and decode steps (before, it was taken for a plain module and refused for want of example inputs),
    and its greedy tokens are HF's own. A multimodal ``*ForConditionalGeneration`` is not taken for one."""
    import transformers

    from tkcc.frontend.hf import is_hf_causal_lm

    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=256,
                                  initializer_range=0.3, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    assert is_hf_causal_lm(model)
    assert not is_hf_causal_lm(transformers.GPT2Model(cfg))  # no head: a plain module
    compiled = tkcc.compile(model, "azure-conv", budget=0, progress=False, out_dir=tmp_path / "o", max_cache_len=64,
                            measure_max_context=32)
    assert set(compiled.program.phases) == {"prefill", "decode"}
    ids = _prompt()
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)[:, 5:]
    assert len(set(ref[0].tolist())) > 1, "degenerate test: the model repeats one token"
    assert torch.equal(compiled.generate(ids, 8), ref)


@pytest.mark.parametrize("name", ["minimax-tiny", "qwen3next-tiny"])
def test_shell_compile_of_a_hybrid_linear_attention_model_then_load(name, tmp_path):
    """`tkcc compile --model <hybrid> --budget 0`, then tkcc.load of what it wrote: HF's own greedy tokens. MiniMax
    keeps its own cache class; Qwen3-Next's gated DeltaNet layers keep transformers' linear-attention cache layers."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "tkcc.cli", "compile", "--model", name, "--budget", "0",
                        "--json", "--out", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["model"] == name and res["golden"]["ok"]
    model = build_model(name)
    loaded = tkcc.load(out / "model", model)
    ids = _prompt(4)
    assert torch.equal(loaded.generate(ids, 6), model.generate(ids, max_new_tokens=6, do_sample=False)[:, 5:])
