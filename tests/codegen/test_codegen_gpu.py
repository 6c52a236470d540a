"""Generated kernels on an NVIDIA GPU: compiled Triton against the reference ops (bf16, fp16, fp32), and an
artifact loaded in a fresh process on the GPU."""
from __future__ import annotations

import pytest
import torch

from codegen_helpers import Block, Pointwise, RMSNorm, capture, rand_like_meta, run_python, same, variant_shapes
from tkcc.passes.manager import apply_plan
from tkcc.passes.plan import PassPlan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

CASES = [
    ("block", lambda: Block(), lambda: (torch.randn(2, 5, 32),), "fuse_elementwise", {}),
    ("block-fp32i", lambda: Block(), lambda: (torch.randn(2, 5, 32),), "fuse_elementwise", {"intermediates": "fp32"}),
    ("rmsnorm-wide", lambda: RMSNorm(2048), lambda: (torch.randn(3, 7, 2048),), "fuse_elementwise", {}),
    ("pointwise-exact", lambda: Pointwise(), lambda: (torch.randn(2, 5, 32), torch.randn(5, 32)),
     "fuse_elementwise_exact", {}),
    ("block-exact", lambda: Block(), lambda: (torch.randn(2, 5, 32),), "fuse_elementwise_exact", {}),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name,make,inputs,pass_name,params", CASES, ids=[c[0] for c in CASES])
def test_kernels_match_reference_on_gpu(name, make, inputs, pass_name, params, dtype):
    torch.manual_seed(0)
    m = make().eval().to("cuda", dtype)
    xs = tuple(x.to("cuda", dtype) for x in inputs())
    prog = capture(m, xs)
    fused, _ = apply_plan(prog, PassPlan.of((pass_name, params)))
    exact = pass_name == "fuse_elementwise_exact"
    gen = torch.Generator().manual_seed(99)
    nodes = [n for n in fused.graphs["forward"].graph.nodes if getattr(n.target, "__tkcc_kernel__", False)]
    assert nodes
    for node in nodes:
        launcher = node.target.launcher
        for shapes in variant_shapes(node):
            args = [rand_like_meta(a.meta["val"], s, gen, "cuda") for a, s in zip(node.args, shapes)]
            assert launcher.why_not(args) is None
            got = launcher(*args)
            want = launcher.reference(*args)
            for w, g in zip(want, got):
                assert same(w, g, exact), (node.target.name, shapes, (w.float() - g.float()).abs().max())
    fresh = tuple(rand_like_meta(x, x.shape, gen, "cuda") for x in xs)
    for w, g in zip(prog.graphs["forward"](*fresh), fused.graphs["forward"](*fresh)):
        assert same(w, g, exact)


def test_artifact_runs_in_a_fresh_process_on_gpu(tmp_path):
    from tkcc.codegen import build_artifact

    torch.manual_seed(0)
    m = Block().eval().to("cuda", torch.bfloat16)
    x = torch.randn(2, 5, 32, device="cuda", dtype=torch.bfloat16)
    prog = capture(m, (x,))
    plan = PassPlan.of("fuse_elementwise")
    fused, _ = apply_plan(prog, plan)
    build_artifact(fused, plan, tmp_path / "art", aot_targets=("sm_90",))
    torch.save(m.state_dict(), tmp_path / "w.pt")
    x2 = torch.randn(4, 9, 32, device="cuda", dtype=torch.bfloat16)
    torch.save({"x": x2, "want": fused.graphs["forward"](x2)}, tmp_path / "io.pt")
    code = f"""
import torch
from codegen_helpers import Block
from tkcc.codegen.artifact import Artifact
m = Block().eval().to("cuda", torch.bfloat16)
m.load_state_dict(torch.load({str(tmp_path / 'w.pt')!r}))
io = torch.load({str(tmp_path / 'io.pt')!r})
art = Artifact.open({str(tmp_path / 'art')!r})
got = art.load(m)["forward"](io["x"])
for a, b in zip(got, io["want"]):
    assert torch.equal(a, b), (a.float() - b.float()).abs().max()
assert all(l.stats["kernel"] == 1 for l in art.launchers().values())
print("OK")
"""
    assert "OK" in run_python(code).stdout
