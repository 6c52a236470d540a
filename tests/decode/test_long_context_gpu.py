"""Decode at long context on the GPU (bf16): which of the captured graph and the lowered step is
off, on olmoe-16l's and llama-1b-16l's layer shapes (four layers each).

On the H200 both front-door steps of olmoe-16l were refused at context 8192 (first-step logits 0.665 and 0.27
off the bf16 captured graph; 0.03 at 128; llama-1b-16l 0.03 at every context). A correct bf16 step is within
~0.02 of the fp32 run on these shapes (near-tied expert choices included: measured on CPU, see
test_long_context_cpu.py), so each is judged against the captured graph run in fp32 on the same weights and
cache (``benchmarks/decode.py``'s ``judge_first_step``), and the bf16 captured graph is held to the same bound.
From the kernels up: the attention kernels at every layout the tuners try; torch's SDPA (what the captured
graph runs) on each of its backends; each kernel op of the tuned lowered step against its fp32 reference,
layer by layer; then the whole step through the benchmark's own front-door path. ``TKCC_LONG_CONTEXT``
sets the long context (default 8192; at 32768 on the H200 on 2026-12-03, olmoe-16l's ops and whole step passed).

    PYTHONPATH=. python -m pytest -q -s -m gpu tests/decode/test_long_context_gpu.py
"""
import inspect
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

CONTEXT = int(os.environ.get("TKCC_LONG_CONTEXT", "8192"))
LAYERS = 4
MODELS = ["olmoe-16l", "llama-1b-16l"]
OP_TOL = 3e-2  # one bf16 kernel against its fp32 reference (tkcc.kernels.checks' bf16 tolerance)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("inf")


def _model(name):
    from tkcc.frontend.models import build_model
    from tkcc.frontend.weight_packing import pack_projections

    model = build_model(name, torch.bfloat16, "cuda", num_hidden_layers=LAYERS, max_position_embeddings=CONTEXT + 128)
    pack_projections(model)  # as capture does (and the benchmark before it)
    return model


@pytest.mark.parametrize("pdl", [False, True])
def test_attention_kernels_at_long_context_gpu_bf16(pdl):
    """tkcc.kernels.checks' attention_long family: OLMoE's and Llama-1B's heads over an 8232-position cache,
    the new token on a split boundary and inside a split, every chunk the tuners try and the
    span layouts, both attention paths, one scratch over several layers."""
    from tkcc.kernels.checks import run_checks

    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    rows = run_checks("cuda", torch.bfloat16, ["attention_long"], pdl=pdl)
    bad = [r for r in rows if not r["ok"]]
    assert rows and not bad, json.dumps(bad, indent=1)


@pytest.mark.parametrize("hq,hkv,D", [(16, 16, 128), (32, 8, 64)])
def test_sdpa_backends_at_long_context_gpu_bf16(hq, hkv, D):
    """The captured graph's attention (transformers' sdpa under the static cache's boolean mask, K/V repeated to
    the query heads) at OLMoE's and Llama-1B's heads, one query at position 8192 of an 8232-position cache: every
    SDPA backend that takes it, and the default choice, within bf16 error of the fp32 computation."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    S, pos = CONTEXT + 40, CONTEXT
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, 1, D, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, hkv, S, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    k[:, :, pos + 1:] = 0  # the cache past the context, as fill_random leaves it
    v[:, :, pos + 1:] = 0
    k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    mask = (torch.arange(S, device="cuda") <= pos).view(1, 1, 1, S)
    scale = 1 / math.sqrt(D)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v.double()
    errs = {"default": _rel(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
                            ref)}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        except RuntimeError as e:  # a backend that does not take these inputs
            errs[backend.name] = f"not taken: {str(e)[:80]}"
            continue
        errs[backend.name] = _rel(out, ref)
    print(json.dumps({"heads": [hq, hkv, D], "sdpa_rel_err_vs_fp64": errs}))
    bad = {k: e for k, e in errs.items() if isinstance(e, float) and not e < OP_TOL}
    assert not bad, errs


def _lowered_ops_report(name):
    """Each tkcc attention_rope and gemv node of the tuned lowered step at CONTEXT, run eagerly in graph order on
    the step's own inputs, against its reference in fp32 on the same inputs (upcast); the MoE nodes are left to
    the whole step (an expert choice rounding can flip moves one block's output, not the step's)."""
    import tkcc.kernels.lowered as lk
    from tkcc.frontend.capture import capture
    from tkcc.passes.manager import apply_plan

    model = _model(name)
    prog = capture(model, phases=["decode"], max_cache_len=CONTEXT + 40)
    prog.state.fill_random(CONTEXT, torch.Generator(device="cuda").manual_seed(CONTEXT))
    new, _ = apply_plan(prog, [{"name": "lowered_decode", "params": {"tune": True, "tune_context": CONTEXT}}],
                        mode="tolerance", check_numerics=False)
    gm = new.graphs["decode"]
    refs = {torch.ops.tkcc.attention_rope.default: lk.attention_rope_ref, torch.ops.tkcc.gemv.default: lk.gemv_ref}
    rows = []

    class Check(torch.fx.Interpreter):
        def run_node(self, n):
            fn = refs.get(n.target) if n.op == "call_function" else None
            if fn is None:
                return super().run_node(n)
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            bound = dict(zip([a.name for a in n.target._schema.arguments], args), **kwargs)
            keep = inspect.signature(fn).parameters
            up = {k: (v.detach().clone().float() if isinstance(v, torch.Tensor) and v.is_floating_point()
                      else v.clone() if isinstance(v, torch.Tensor) else v) for k, v in bound.items() if k in keep}
            want = fn(**up)  # before the op: it writes this token's row of the caches
            got = super().run_node(n)
            layout = {k: bound[k] for k in ("chunk", "block_s", "num_warps", "config") if k in bound}
            rows.append(dict(node=n.name, op=str(n.target).split(".")[-2], rel_err=_rel(got, want), **layout))
            return got

    with torch.no_grad():
        out = Check(gm).run(torch.tensor([[11]], device="cuda"), torch.tensor([CONTEXT], device="cuda"))
    return rows, out


@pytest.mark.parametrize("name", MODELS)
def test_lowered_ops_at_long_context_gpu_bf16(name):
    """Layer by layer: which kernel op of the tuned lowered step (if any) is off at context 8192."""
    rows, _ = _lowered_ops_report(name)
    print(json.dumps({"model": name, "ops": rows}))
    assert any(r["op"] == "attention_rope" for r in rows)
    bad = [r for r in rows if not r["rel_err"] < OP_TOL]
    assert not bad, json.dumps(bad, indent=1)


@pytest.mark.parametrize("name", MODELS)
def test_front_door_steps_at_long_context_gpu_bf16(name):
    """The benchmark's front-door path (capture at the context, random cache, tkcc.compile of each plan with its
    tuning, first step): the lowered step, and the bf16 captured graph itself, each within
    VARIANT_TOL of the captured graph run in fp32, at contexts 128 and 8192."""
    import decode as bench

    model = _model(name)
    rows, notes = bench.frontdoor_rows(model, name, [128, CONTEXT], tokens=2, reps=1,
                                       variants=["lowered"], family=name.split("-")[0])
    keys = ("first_step_logits_rel_err_vs_fp32", "first_step_logits_rel_err_vs_captured_graph", "captured_graph_vs_fp32",
            "captured_graph_jump_under_one_rounding_step", "fp32_reference_skipped", "variant_fallbacks")
    report = {k: notes.get(k) for k in keys}
    print(json.dumps({"model": name, **report}))
    assert not notes.get("fp32_reference_skipped"), report
    assert "variant_fallbacks" not in notes, report
    assert len(notes["first_step_logits_rel_err_vs_fp32"]) == 2, report
    assert all(v < bench.VARIANT_TOL for v in notes["captured_graph_vs_fp32"].values()), report
