"""moe_regroup finds its regions on the graph's ops, not on the model's classes: an MoE block tkcc has never seen
is rewritten when its graph has the routed-experts ops, and a block with other arithmetic is left alone with its
reason (CPU, the op's eager path: bit-exact)."""
import pytest
import torch
import torch.nn.functional as F

from tkcc.passes.manager import apply_plan
from tkcc.passes.plan import PassPlan


class HandWrittenMoE(torch.nn.Module):
    """A sparse-MoE block written by hand: no ``gate``/``experts`` children, no ``top_k``/``norm_topk_prob``
    attributes. ``score="softmax"``, ``act="silu"`` is OLMoE's arithmetic (softmax top-k router, transformers'
    batched_mm SiLU-gated experts); the other settings are routers and activations moe_block does not compute."""

    def __init__(self, hidden, experts, inter, k, renorm=False, score="softmax", act="silu", dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(hidden * experts + k)
        self.route = torch.nn.Parameter((torch.randn(experts, hidden, generator=g) * 0.3).to(dtype))
        self.w_in = torch.nn.Parameter((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype))
        self.w_out = torch.nn.Parameter((torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype))
        self.k, self.renorm, self.score, self.act = k, renorm, score, act

    def forward(self, x):
        b, s, h = x.shape
        xs = x.view(-1, h)
        logits = F.linear(xs.reshape(-1, h), self.route)
        if self.score == "softmax":
            p = F.softmax(logits, dtype=torch.float, dim=-1)
        elif self.score == "softmax_fp32":
            p = F.softmax(logits.float(), dim=-1)
        else:
            p = logits.float().sigmoid()
        w, ids = torch.topk(p, self.k, dim=-1)
        if self.renorm:
            w /= w.sum(dim=-1, keepdim=True)  # in place, as transformers writes it: the same ops
        if self.score != "softmax_fp32":
            w = w.to(logits.dtype)
        picked = xs.repeat_interleave(self.k, dim=0)
        w, ids = w.reshape(-1), ids.reshape(-1).clamp(0, self.w_in.shape[0] - 1)
        y = torch.bmm(self.w_in[ids], picked.unsqueeze(-1)).squeeze(-1)
        gate, up = y.chunk(2, dim=-1)
        y = (F.silu(gate) if self.act == "silu" else F.gelu(gate)) * up
        y = torch.bmm(self.w_out[ids], y.unsqueeze(-1)).squeeze(-1)
        y = (y * w.unsqueeze(-1)).view(xs.shape[0], self.k, h).sum(dim=1)
        return y.to(xs.dtype).reshape(b, s, h)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _captured(block, x):
    from tkcc.frontend import capture

    return capture(block, example_inputs=(x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renorm", [False, True])
def test_a_block_of_an_unknown_class_is_rewritten_from_its_ops(renorm, dtype):
    from tkcc.kernels import ops

    block = HandWrittenMoE(32, 6, 16, 2, renorm=renorm, dtype=dtype)
    x = torch.randn(2, 3, 32).to(dtype)
    prog = _captured(block, x)
    new, logs = apply_plan(prog, PassPlan.of("moe_regroup"), mode="tolerance")
    calls = [n for n in new.graphs["forward"].graph.nodes if n.target is ops.moe_block]
    assert len(calls) == 1 and logs[0].replaced == 1
    # the weights are the graph's own parameters; renormalisation is read off the graph's ops
    assert [a.target for a in calls[0].args[1:4]] == ["route", "w_in", "w_out"]
    assert calls[0].args[4] == 2 and calls[0].args[5] is renorm
    assert torch.ops.aten.bmm.default not in _targets(new.graphs["forward"])
    for seed in range(3):  # six tokens: moe_block's eager path, the captured arithmetic bit for bit
        xi = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(seed)).to(dtype)
        assert torch.equal(new.graphs["forward"](xi), prog.graphs["forward"](xi))


@pytest.mark.parametrize("score,act,dtype,why", [
    ("sigmoid", "silu", torch.float32, "router: linear, sigmoid, topk"),
    ("softmax", "gelu", torch.float32, "between the expert matmuls: chunk, gelu, mul"),
    ("softmax_fp32", "silu", torch.bfloat16, "routing weights stay fp32"),
])
def test_a_block_with_other_arithmetic_is_left_alone_with_its_reason(score, act, dtype, why):
    from tkcc.kernels import ops

    block = HandWrittenMoE(32, 6, 16, 2, renorm=True, score=score, act=act, dtype=dtype)
    prog = _captured(block, torch.randn(1, 4, 32).to(dtype))
    new, logs = apply_plan(prog, PassPlan.of("moe_regroup"), mode="tolerance")
    assert ops.moe_block not in _targets(new.graphs["forward"]) and logs[0].replaced == 0
    refused = [n for n in logs[0].notes if "left as is" in n]
    assert len(refused) == 1 and why in refused[0], logs[0].notes
    xi = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(new.graphs["forward"](xi), prog.graphs["forward"](xi))


def test_a_causal_lm_with_a_foreign_moe_block_is_rewritten_in_decode():
    """Llama-tiny with every MLP replaced by the hand-written block: the decode graph gets moe_block per layer."""
    from tkcc.frontend import capture
    from tkcc.frontend.models import build_model
    from tkcc.kernels import ops
    from tkcc.traffic.workload import Bucket

    model = build_model("llama-tiny", num_hidden_layers=2)
    H = model.config.hidden_size
    for layer in model.model.layers:
        layer.mlp = HandWrittenMoE(H, 8, 24, 2, renorm=True)
    prog = capture(model, max_cache_len=16, phases=["decode"])
    from tkcc.pipeline import pass_context

    new, logs = apply_plan(prog, PassPlan.of(("moe_regroup", {"expert_order": "hot_first"})), mode="tolerance",
                           context=pass_context())
    calls = [n for n in new.graphs["decode"].graph.nodes if n.target is ops.moe_block]
    assert len(calls) == 2 and all(n.args[5] is True for n in calls)
    assert all(sorted(n.kwargs["expert_order"]) == list(range(8)) for n in calls)
    for seed in range(2):
        inp = prog.make_inputs["decode"](Bucket("decode", batch=1, context=3 + seed),
                                         torch.Generator().manual_seed(seed))
        snap = [b.clone() for b in prog.state.buffers()]
        ref = prog.graphs["decode"](*inp)
        for b, s in zip(prog.state.buffers(), snap):
            b.copy_(s)
        got = new.graphs["decode"](*inp)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)  # hot_first: the same function, experts reordered


@pytest.mark.parametrize("router,norm", [("softmax", False), ("softmax", True), ("softmax_fp32", False),
                                         ("softmax_fp32", True)])
@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (5, 12, 3), (7, 6, 1)])
def test_the_replacement_is_the_pattern_bit_for_bit(router, norm, tokens, experts, k):
    """The pattern (what the graph computes) against moe_block's eager path on fresh random inputs: equal in fp32
    for every router, and in bf16 for the routers moe_block rounds the weights of (the ones the pass replaces)."""
    from tkcc.passes.moe import replacement, routed_pattern

    H, I = 24, 10  # noqa: E741
    dtypes = [torch.float32] + ([torch.bfloat16] if router == "softmax" else [])
    for dt in dtypes:
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            xs, rw = torch.randn(tokens, H, generator=g).to(dt), torch.randn(experts, H, generator=g).to(dt)
            gu, dn = torch.randn(experts, 2 * I, H, generator=g).to(dt), torch.randn(experts, H, I, generator=g).to(dt)
            want = routed_pattern(router, norm)(xs, rw, gu, dn, top_k=k)
            got = replacement(norm)(xs, rw, gu, dn, top_k=k)
            assert got.dtype == want.dtype and torch.equal(got, want), (dt, seed)
