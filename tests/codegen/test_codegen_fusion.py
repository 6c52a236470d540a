"""Fusion pass: groups found, graph rewritten with provenance, reference path exact, bad cases left unfused."""
from __future__ import annotations

import logging

import pytest
import torch

from codegen_helpers import Block, RMSNorm, capture
from tkcc.errors import PlanError
from tkcc.passes.base import get_pass
from tkcc.passes.manager import apply_plan
from tkcc.passes.plan import PassPlan


def _kernels(program, phase="forward"):
    return [n for n in program.graphs[phase].graph.nodes if getattr(n.target, "__tkcc_kernel__", False)]


def _ops(program, phase="forward"):
    return [str(n.target) for n in program.graphs[phase].graph.nodes if n.op == "call_function"]


def test_rmsnorm_silu_mul_softmax_fused_and_outputs_match():
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(2, 5, 32)
    prog = capture(m, (x,))
    fused, logs = apply_plan(prog, PassPlan.of("fuse_elementwise"))
    ks = _kernels(fused)
    families = sorted(k.target.name.split("_")[1] for k in ks)
    assert families == ["norm", "pointwise", "softmax"]
    norm = next(k for k in ks if "norm" in k.target.name)
    origin_ops = {str(n.target) for n in prog.graphs["forward"].graph.nodes if n.name in norm.target.origin}
    assert {"aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.rsqrt.default"} <= origin_ops
    silu = next(k for k in ks if "pointwise" in k.target.name)
    assert [str(n.target) for n in prog.graphs["forward"].graph.nodes if n.name in silu.target.origin] == [
        "aten.silu.default", "aten.mul.Tensor"]
    # no elementwise op left except the matmuls and getitems
    left = [o for o in _ops(fused) if o.startswith("aten.") and "linear" not in o]
    assert left == []
    # provenance: every new node names the nodes it came from
    log = logs[0]
    assert log.matched == 3 and log.replaced == sum(len(k.target.origin) for k in ks)
    prov = log.phases["forward"].provenance
    assert all(prov[k.name] for k in ks)
    # in-process on CPU without the interpreter the reference ops run: bit for bit the original
    x2 = torch.randn(3, 7, 32)
    for a, b in zip(prog.graphs["forward"](x2), fused.graphs["forward"](x2)):
        assert torch.equal(a, b)
    for k in ks:
        assert k.target.launcher.stats["reference"] >= 1


def test_exact_variant_fuses_only_correctly_rounded_ops():
    m = Block().eval()
    prog = capture(m, (torch.randn(2, 5, 32),))
    fused, logs = apply_plan(prog, PassPlan.of("fuse_elementwise_exact"))
    assert get_pass("fuse_elementwise_exact").exact and not get_pass("fuse_elementwise").exact
    left = _ops(fused)
    for op in ("aten.rsqrt.default", "aten.mean.dim", "aten.silu.default", "aten.softmax.int"):
        assert op in left, op
    from tkcc.kernels.triton_ops import RULES, op_name

    for k in _kernels(fused):
        for n in prog.graphs["forward"].graph.nodes:
            if n.name in k.target.origin:
                assert RULES[op_name(n.target)].exact, n
        assert k.target.spec["exact"]
    assert any("not correctly rounded" in note for note in logs[0].notes)


def test_include_norms_false_and_max_ops():
    m = Block().eval()
    prog = capture(m, (torch.randn(2, 5, 32),))
    fused, _ = apply_plan(prog, PassPlan.of(("fuse_elementwise", {"include_norms": False})))
    assert "aten.mean.dim" in _ops(fused) and "aten.softmax.int" in _ops(fused)
    assert all(not k.target.spec["reduction"] for k in _kernels(fused))
    small, _ = apply_plan(prog, PassPlan.of(("fuse_elementwise", {"max_ops": 8})))
    assert all(len(k.target.origin) <= 8 for k in _kernels(small))
    with pytest.raises(PlanError, match="max_ops"):
        apply_plan(prog, PassPlan.of(("fuse_elementwise", {"max_ops": 7})))


def test_kernel_falls_back_with_a_logged_reason(caplog):
    from tkcc.kernels import rt

    rt._WARNED.clear()  # kernels are shape-generic: an earlier test may have logged this very kernel
    m = RMSNorm(16).eval()
    prog = capture(m, (torch.randn(4, 16),))
    with caplog.at_level(logging.DEBUG, logger="tkcc.codegen"):
        fused, _ = apply_plan(prog, PassPlan.of("fuse_elementwise"))  # its numerics check runs the kernel
        (k,) = _kernels(fused)
        launcher = k.target.launcher
        x = torch.randn(4, 16)
        assert "TRITON_INTERPRET" in launcher.why_not((x, m.weight))
        assert torch.equal(k.target(x, m.weight)[0], m(x))
        x3 = torch.randn(2, 3, 16)  # another rank than the kernel was generated for: reference, right answer
        assert torch.equal(k.target(x3, m.weight)[0], m(x3))
    assert any(k.target.name in r.getMessage() for r in caplog.records), [r.getMessage()[:80] for r in caplog.records if "tkcc" in r.name]


def test_reductions_not_over_last_dim_and_broadcast_rows_stay_correct():
    class M(torch.nn.Module):
        def forward(self, x, b):
            s = torch.softmax(x * 2.0, dim=1)  # not the last dim: must not fuse the softmax
            return s + 1.0, (x - x.mean(-1, keepdim=True)) * b

    prog = capture(M(), (torch.randn(3, 4, 8), torch.randn(4, 1)))
    fused, logs = apply_plan(prog, PassPlan.of("fuse_elementwise"))
    assert "aten.softmax.int" in _ops(fused)
    assert any("only the last dim" in n for n in logs[0].notes)
    x, b = torch.randn(3, 4, 8), torch.randn(4, 1)
    for a, c in zip(prog.graphs["forward"](x, b), fused.graphs["forward"](x, b)):
        assert torch.equal(a, c)


def test_group_never_reorders_around_an_outside_use():
    class M(torch.nn.Module):
        def forward(self, x, w):
            a = x * 2.0
            m = a @ w  # an outside op reads `a` before the chain continues
            return (a + m).exp() * 3.0

    prog = capture(M(), (torch.randn(4, 4), torch.randn(4, 4)))
    fused, _ = apply_plan(prog, PassPlan.of("fuse_elementwise"))
    fused.graphs["forward"].graph.lint()
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    assert torch.equal(prog.graphs["forward"](x, w), fused.graphs["forward"](x, w))


def test_group_never_spans_an_in_place_write():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(4))

        def forward(self, x):
            a = self.buf * 2.0  # reads buf before the write
            self.buf.add_(x)
            return a + self.buf * 3.0  # reads buf after it

    m = M()
    prog = capture(m, (torch.ones(4),))
    fused, logs = apply_plan(prog, PassPlan.of("fuse_elementwise"))
    assert any("in-place" in n for n in logs[0].notes)
    m.buf.zero_()
    out = fused.graphs["forward"](torch.ones(4))
    assert torch.equal(out, torch.full((4,), 3.0))


def test_only_views_of_leading_ones_join_a_group():
    """A view fuses only when it keeps every element in place (adding or dropping leading size-1 dims, in the same
    dtype) and is one link of a chain (its value read by it alone, it read by one node). A trailing unsqueeze, a
    view to other dims, a bit reinterpretation (view.dtype) and a view of a value two nodes read stay out, each
    with its reason."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tkcc.kernels.triton_ops import check_node

    def f(a, b, h, c, t):
        shared = t.unsqueeze(0)  # read twice, as each layer's rotary reads the table
        return ((a + b).reshape(1, 1, -1), (a * b).unsqueeze(-1), (a - b).view(8, 4), h.view(torch.float16),
                c.unsqueeze(0).squeeze(0), shared * 2, shared * 3)

    gm = make_fx(f)(torch.randn(1, 32), torch.randn(1, 32), torch.randn(1, 32, dtype=torch.bfloat16),
                    torch.randn(1, 32), torch.randn(32))
    got = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(k in str(n.target) for k in ("view", "squeeze", "reshape")):
            key = (str(n.target), tuple(n.args[0].meta["val"].shape), tuple(n.meta["val"].shape))
            got[key] = check_node(n, exact=True, include_norms=False)[1]
    assert got == {
        ("aten.view.default", (1, 32), (1, 1, 32)): "",
        ("aten.unsqueeze.default", (1, 32), (1, 32, 1)): "unsqueeze changes more than leading size-1 dims",
        ("aten.view.default", (1, 32), (8, 4)): "view changes more than leading size-1 dims",
        ("aten.view.dtype", (1, 32), (1, 32)): "view.dtype",
        ("aten.unsqueeze.default", (1, 32), (1, 1, 32)): "",
        ("aten.squeeze.dim", (1, 1, 32), (1, 32)): "",
        ("aten.unsqueeze.default", (32,), (1, 32)): "unsqueeze of a value read elsewhere, or read by more than one node",
    }, got
