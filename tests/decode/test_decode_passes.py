"""The decode passes on captured tiny models (CPU): structure of the rewrite, and bit-exact outputs off the
kernel path (the ops' reference paths are the eager arithmetic, so a wrong rewiring shows up as a mismatch)."""

import pytest
import torch

from tkcc.passes.base import get_pass
from tkcc.passes.manager import apply_plan
from tkcc.passes.plan import PassPlan


@pytest.fixture(scope="module")
def olmoe():
    from tkcc.frontend.capture import capture_model

    return capture_model("olmoe-tiny", "float32", "cpu", max_cache_len=32, phases=["decode"])


@pytest.fixture(scope="module")
def llama():
    from tkcc.frontend.capture import capture_model

    return capture_model("llama-tiny", "float32", "cpu", max_cache_len=32, phases=["decode"])


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _fill_cache(program, seed):
    g = torch.Generator().manual_seed(seed)
    for name, buf in program.state.named_buffers():
        buf.copy_(torch.randn(buf.shape, generator=g))


def _same_outputs(program, new_program, seed):
    """Both decode graphs on the same cache contents and fresh inputs give identical logits."""
    for i in range(3):
        inp = program.inputs("decode", generator=torch.Generator().manual_seed(seed + i))
        _fill_cache(program, seed + i)
        ref = program.graphs["decode"](*inp)
        _fill_cache(program, seed + i)
        got = new_program.graphs["decode"](*inp)
        ref = ref[0] if isinstance(ref, (tuple, list)) else ref
        got = got[0] if isinstance(got, (tuple, list)) else got
        assert torch.equal(ref, got), float((ref - got).abs().max())


def test_moe_regroup_replaces_every_block_and_keeps_eager_arithmetic(olmoe):
    from tkcc.kernels import ops

    new, logs = apply_plan(olmoe, PassPlan.of("moe_regroup"), mode="tolerance")
    t = _targets(new.graphs["decode"])
    assert t.count(ops.moe_block) == olmoe.num_blocks
    assert torch.ops.aten.bmm.default not in t  # the per-token weight gather + bmm are gone
    assert logs[0].replaced == olmoe.num_blocks
    added = logs[0].phases["decode"].added
    assert added and all(logs[0].phases["decode"].provenance[n] for n in added)
    _same_outputs(olmoe, new, seed=1)


def test_decode_fusion_and_kv_split_attention(llama):
    from tkcc.kernels import ops

    new, logs = apply_plan(llama, PassPlan.of("decode_fusion", "kv_split_attention"), mode="tolerance")
    t = _targets(new.graphs["decode"])
    assert t.count(ops.split_kv_attention) == llama.num_blocks
    assert torch.ops.aten.scaled_dot_product_attention.default not in t
    before = _targets(llama.graphs["decode"])
    ex = torch.ops.aten.expand.default
    assert before.count(ex) - t.count(ex) == 2 * llama.num_blocks  # repeat_kv's copies of the cache are gone
    assert torch.ops.aten.rsqrt.default not in t  # every RMSNorm region became one op
    assert t.count(ops.add_rms_norm) >= llama.num_blocks  # residual adds fused into the norm after them
    _same_outputs(llama, new, seed=5)


@pytest.mark.slow
def test_decode_passes_with_live_kernels_under_the_interpreter():
    """decode_fusion + kv_split_attention + moe_regroup, and lowered_decode, with every kernel path live (fp32,
    interpreter), against the captured decode graph: same logits, same cache writes."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, str(Path(__file__).parent / "interp_pass_check.py"), "llama-tiny",
                        "olmoe-tiny"], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert len(rows) == 4  # 2 plans (interp_pass_check.PLANS) x 2 models
    for r in rows:
        assert r["fallbacks"] == {}, r
        for logits_err, cache_err in r["errs"]:
            assert logits_err < 1e-5 and cache_err < 1e-4, r


def test_pass_params_are_checked():
    from tkcc.errors import PlanError

    with pytest.raises(PlanError, match="chunk"):
        get_pass("kv_split_attention").check_params({"chunk": 3})
    assert get_pass("moe_regroup").check_params({})["fused"] is True


def test_hot_first_order_is_a_permutation_most_used_first():
    import numpy as np

    from tkcc.passes.moe import hot_first_order

    p = np.random.default_rng(0).dirichlet(np.ones(16))
    order = hot_first_order(p).numpy()
    assert sorted(order.tolist()) == list(range(16))
    assert np.all(np.diff(p[order]) <= 0)


def test_hot_first_without_a_routing_is_a_plan_error(olmoe):
    """The routing arrives from the caller (the pass does not import tkcc.traffic): none given is named."""
    from tkcc.errors import PlanError

    with pytest.raises(PlanError, match="hot_first.*none was given"):
        apply_plan(olmoe, PassPlan.of(("moe_regroup", {"expert_order": "hot_first"})), mode="tolerance")


def test_hot_first_runs_on_permuted_copies_and_leaves_the_model_alone():
    """Same function on the experts stored most-used first; the model's weights (values, order, storage) stay."""
    from tkcc.frontend.capture import capture_model
    from tkcc.kernels import ops
    from tkcc.runtime.validation import changed_weight, weights_checksum

    prog = capture_model("olmoe-tiny", "float32", "cpu", max_cache_len=32)
    before = weights_checksum(prog.model)
    from tkcc.pipeline import pass_context

    new, logs = apply_plan(prog, PassPlan.of(("moe_regroup", {"expert_order": "hot_first", "fused": False})),
                           mode="tolerance", context=pass_context())
    assert changed_weight(before, weights_checksum(prog.model)) is None
    calls = [n for n in new.graphs["decode"].graph.nodes if n.target is ops.moe_block]
    orders = [n.kwargs["expert_order"] for n in calls]
    assert len(calls) == prog.num_blocks and all(sorted(o) == list(range(prog.model.config.num_experts))
                                                 for o in orders)
    assert any(list(o) != sorted(o) for o in orders)  # the bundled routing makes some expert hotter
    for phase in ("prefill", "decode"):
        for seed in (0, 1):
            inp = prog.inputs(phase, generator=torch.Generator().manual_seed(seed))
            _fill_cache(prog, seed)
            ref = prog.graphs[phase](*inp)
            _fill_cache(prog, seed)
            got = new.graphs[phase](*inp)
            ref, got = (r[0] if isinstance(r, (tuple, list)) else r for r in (ref, got))
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert changed_weight(before, weights_checksum(prog.model)) is None


def test_permuted_experts_are_the_same_function_and_cached():
    from tkcc.frontend.models import build_model
    from tkcc.kernels.expert_order import permuted_experts
    from tkcc.kernels.moe import moe_ref

    m = build_model("olmoe-tiny", torch.float32, "cpu")
    mlp = m.model.layers[0].mlp
    E, k = m.config.num_experts, mlp.gate.top_k
    w = (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj)
    order = torch.randperm(E, generator=torch.Generator().manual_seed(3)).tolist()
    p = permuted_experts(*w, order)
    assert permuted_experts(*w, order)[1] is p[1]  # made once per weights and order
    assert all(torch.equal(a[order[2]], b[2]) for a, b in zip(w, p))
    x = torch.randn(5, m.config.hidden_size)
    ref = moe_ref(x, torch.nn.functional.linear(x, w[0]), w[1], w[2], k, mlp.gate.norm_topk_prob)
    got = moe_ref(x, torch.nn.functional.linear(x, p[0]), p[1], p[2], k, mlp.gate.norm_topk_prob)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="not a permutation"):
        permuted_experts(*w, [0] * E)
