"""Ahead-of-time compilation for GPUs this machine does not have: sm_90 cubin and gfx942 hsaco."""
from __future__ import annotations

import pytest
import torch

from codegen_helpers import RMSNorm, capture
from tkcc.codegen.aot import compile_kernel, interpreter_on
from tkcc.errors import ArtifactError
from tkcc.passes.manager import apply_plan
from tkcc.passes.plan import PassPlan

pytestmark = pytest.mark.skipif(interpreter_on(), reason="this process runs the Triton interpreter")


@pytest.fixture(scope="module")
def norm_kernel():
    m = RMSNorm(64).eval()
    prog = capture(m, (torch.randn(4, 64),))
    fused, _ = apply_plan(prog, PassPlan.of("fuse_elementwise"))
    (node,) = [n for n in fused.graphs["forward"].graph.nodes if getattr(n.target, "__tkcc_kernel__", False)]
    return node


@pytest.mark.parametrize("target,magic", [("sm_90", b"\x7fELF"), ("gfx942", b"\x7fELF")])
def test_generated_kernel_compiles_for_target(norm_kernel, target, magic):
    k = norm_kernel.target
    cfg = k.launcher.launch_config([tuple(a.meta["val"].shape) for a in norm_kernel.args],
                                   [str(a.meta["val"].dtype) for a in norm_kernel.args])
    blob = compile_kernel(k.source, cfg["signature"], target, kernel_name=f"{k.name}_kernel",
                          num_warps=cfg["num_warps"])
    assert len(blob) > 1000 and blob[:4] == magic
    # the binary names the kernel: it is this kernel, not an empty stub
    assert f"{k.name}_kernel".encode() in blob


def test_compile_kernel_takes_a_jit_function_and_rejects_bad_input(norm_kernel):
    k = norm_kernel.target
    jit_fn = getattr(k.module, f"{k.name}_kernel")
    cfg = k.launcher.launch_config([tuple(a.meta["val"].shape) for a in norm_kernel.args],
                                   [str(a.meta["val"].dtype) for a in norm_kernel.args])
    assert compile_kernel(jit_fn, cfg["signature"], "sm_90")[:4] == b"\x7fELF"
    with pytest.raises(ArtifactError, match="unknown AOT target"):
        compile_kernel(jit_fn, cfg["signature"], "sm_12345")
    bad = dict(cfg["signature"])
    bad.pop("n_cols")
    with pytest.raises(ArtifactError, match="n_cols"):
        compile_kernel(jit_fn, bad, "sm_90")


@pytest.mark.parametrize("pass_name", ["fuse_elementwise", "fuse_elementwise_exact"])
def test_bf16_kernels_compile_for_sm_90(pass_name):
    """The GPU path in bf16 (the interpreter cannot check bf16): every generated kernel compiles for sm_90."""
    from codegen_helpers import Block, Pointwise

    from tkcc.codegen.aot import compile_many

    requests = []
    for m, xs in ((Block(), (torch.randn(2, 5, 32),)), (Pointwise(), (torch.randn(2, 5, 32), torch.randn(5, 32)))):
        m = m.eval().to(torch.bfloat16)
        prog = capture(m, tuple(x.bfloat16() for x in xs))
        fused, _ = apply_plan(prog, PassPlan.of(pass_name))
        for n in fused.graphs["forward"].graph.nodes:
            if getattr(n.target, "__tkcc_kernel__", False):
                cfg = n.target.launcher.launch_config([tuple(a.meta["val"].shape) for a in n.args],
                                                      [str(a.meta["val"].dtype) for a in n.args])
                assert any(v == "*bf16" for v in cfg["signature"].values())
                requests.append({"source": n.target.source, "kernel_name": f"{n.target.name}_kernel",
                                 "signature": cfg["signature"], "target": "sm_90", "num_warps": cfg["num_warps"],
                                 "exact": cfg["exact"]})
    assert len(requests) >= 3
    for blob in compile_many(requests):
        assert blob[:4] == b"\x7fELF"
