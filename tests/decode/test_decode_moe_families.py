"""moe_regroup on the MoE families beyond OLMoE: shared experts kept, renormalising routers recognised, other
routers refused with the reason logged; the pass's output is the captured graph's (CPU, reference arithmetic)."""
import pytest
import torch

from tkcc.passes.manager import apply_plan
from tkcc.passes.plan import PassPlan

pytest.importorskip("transformers")


def _program(name):
    from tkcc.frontend.models import build_model
    from tkcc.frontend import capture

    return capture(build_model(name, initializer_range=0.3), max_cache_len=16, phases=["decode"])


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _same_as_captured(prog, new, seeds=(0, 1, 2)):
    """Both decode graphs on the same fresh cache contents and inputs give identical logits and state."""
    from tkcc.traffic.workload import Bucket

    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        inp = prog.make_inputs["decode"](Bucket("decode", batch=1, context=3 + seed), g)
        snap = [b.clone() for b in prog.state.buffers()]
        ref = prog.graphs["decode"](*inp)
        after = [b.clone() for b in prog.state.buffers()]
        for b, s in zip(prog.state.buffers(), snap):
            b.copy_(s)
        got = new.graphs["decode"](*inp)
        assert torch.equal(got, ref), float((got - ref).abs().max())
        assert all(torch.equal(a, b) for a, b in zip(after, prog.state.buffers()))


def test_shared_expert_stays_and_the_block_computes_what_was_captured():
    from tkcc.kernels import ops

    prog = _program("qwen2moe-tiny")
    new, logs = apply_plan(prog, PassPlan.of(("moe_regroup", {"fused": False})), mode="tolerance")
    t = _targets(new.graphs["decode"])
    assert t.count(ops.moe_block) == prog.num_blocks == logs[0].replaced
    assert torch.ops.aten.bmm.default not in t  # the routed experts' gather + bmm are gone
    assert t.count(torch.ops.aten.sigmoid.default) == prog.num_blocks  # the shared expert's gate is still there
    shared = [n for n in new.graphs["decode"].graph.nodes if n.op == "get_attr" and ".shared_expert." in str(n.target)]
    assert len(shared) == 3 * prog.num_blocks  # gate/up/down of every shared expert, read as captured
    with torch.no_grad():
        _same_as_captured(prog, new)


def test_a_router_that_renormalises_without_saying_so_is_recognised():
    """Mixtral's router always renormalises its top-k weights and has no norm_topk_prob: the graph divides them by
    their sum, so the renormalising pattern is the one that matches."""
    from tkcc.kernels import ops

    prog = _program("mixtral-tiny")
    new, logs = apply_plan(prog, PassPlan.of(("moe_regroup", {"fused": False})), mode="tolerance")
    calls = [n for n in new.graphs["decode"].graph.nodes if n.target is ops.moe_block]
    assert len(calls) == prog.num_blocks and all(n.args[5] is True for n in calls)
    with torch.no_grad():
        _same_as_captured(prog, new)


def test_a_router_the_op_does_not_compute_is_refused_with_its_reason():
    """DeepSeek-V3's router (sigmoid scores, a score bias, grouped top-k, a scale): every block left as captured."""
    from tkcc.kernels import ops

    prog = _program("deepseekv3-tiny")
    new, logs = apply_plan(prog, PassPlan.of("moe_regroup"), mode="tolerance")
    assert ops.moe_block not in _targets(new.graphs["decode"]) and logs[0].replaced == 0
    refused = [n for n in logs[0].notes if "left as is" in n and "softmax top-2 router" in n]
    assert len(refused) == prog.num_blocks - prog.model.config.first_k_dense_replace
    with torch.no_grad():
        _same_as_captured(prog, new, seeds=(0,))


def test_a_router_whose_weights_stay_fp32_is_refused_in_bf16():
    """Mixtral's routing weights stay fp32 (softmax of the upcast logits, never rounded); moe_block rounds them to
    the dtype, so in bf16 the op is not the captured arithmetic: every block is left as captured, with why."""
    from tkcc.frontend import capture
    from tkcc.frontend.models import build_model
    from tkcc.kernels import ops

    prog = capture(build_model("mixtral-tiny", dtype=torch.bfloat16, initializer_range=0.3), max_cache_len=16,
                   phases=["decode"])
    new, logs = apply_plan(prog, PassPlan.of(("moe_regroup", {"fused": False})), mode="tolerance")
    assert ops.moe_block not in _targets(new.graphs["decode"]) and logs[0].replaced == 0
    refused = [n for n in logs[0].notes if "left as is" in n and "routing weights stay fp32" in n]
    assert len(refused) == prog.num_blocks
