"""Fusion and codegen on a captured tiny Hugging Face model (decode phase, static KV cache in Program.state)."""
from __future__ import annotations

import pytest
import torch

from tkcc.codegen import build_artifact
from tkcc.passes.manager import apply_plan
from tkcc.passes.plan import PassPlan

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tkcc.frontend.hf import capture_hf
    from tkcc.frontend.models import build_model

    model = build_model("llama-tiny")
    prog = capture_hf(model, phases=("decode",), max_cache_len=16)
    plan = PassPlan.of("fuse_elementwise")
    fused, logs = apply_plan(prog, plan)
    return {"model": model, "program": prog, "fused": fused, "logs": logs, "plan": plan,
            "dir": tmp_path_factory.mktemp("hf")}


def _kernels(gm):
    return [n.target for n in gm.graph.nodes if getattr(n.target, "__tkcc_kernel__", False)]


def test_rmsnorm_and_silu_mul_chains_fused(llama):
    prog, fused = llama["program"], llama["fused"]
    layers = prog.model.config.num_hidden_layers
    ks = _kernels(fused.graphs["decode"])
    orig = {n.name: n for n in prog.graphs["decode"].graph.nodes}

    def ops(k):
        return [str(orig[name].target) for name in k.origin]

    norms = [k for k in ks if {"aten.rsqrt.default", "aten.mean.dim", "aten.pow.Tensor_Scalar"} <= set(ops(k))]
    silu_mul = [k for k in ks if "aten.silu.default" in ops(k) and "aten.mul.Tensor" in ops(k)]
    assert len(norms) == 2 * layers + 1  # input and post-attention norm per layer, final norm
    assert len(silu_mul) == layers
    left = {str(n.target) for n in fused.graphs["decode"].graph.nodes}
    assert "aten.rsqrt.default" not in left and "aten.silu.default" not in left


def test_artifact_decode_matches_program_and_binds_kv_state(llama):
    fused, prog = llama["fused"], llama["program"]
    art = build_artifact(fused, llama["plan"], llama["dir"] / "art")
    roots = {b["root"] for b in art.manifest["phases"]["decode"]["bindings"]}
    assert roots == {"model", "state"}  # weights on the model, the KV cache on the state, nothing embedded
    fn = art.load(fused)["decode"]
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        inputs = prog.inputs("decode", generator=g)
        want = prog.graphs["decode"](*inputs)
        got = fn(*inputs)
        assert torch.equal(want, got)
