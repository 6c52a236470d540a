"""lowered_decode inside the plans the search composes: it runs on the graph capture wrote, before the cleanups
and the fusion, and lowers there exactly what it lowers alone.

Why: a composed plan ran its passes in name order. A server's watcher starts from the default plan (cleanups,
then ``fuse_elementwise_exact``) and its search adds ``lowered_decode`` as a neighbour, so ``cse`` (which merged
each layer's ``cos.unsqueeze(1)`` into one node every layer read) and the fusion (which merged the ops the
patterns match) ran first, and no attention lowered. CPU, in-process: the ops take their references, so the
lowered step must be bit-exact with the captured one.
"""
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lowered_families import same_decode  # noqa: E402

CLEANUPS = ["host-sync-removal", "noop-elim", "cse", "dce"]


def _kernels(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"
                   and str(n.target).startswith("tkcc."))


def test_the_search_composes_lowering_then_cleanups_then_fusion():
    """The search's order, and the plan its neighbour move makes from the default plan: lowered_decode first."""
    from tkcc.agents.search import SearchSpace
    from tkcc.passes.default_plan import default_plan

    space = SearchSpace.from_registry(exact_only=False)
    names = [p.name for p in space.passes]
    lower, fuse = names.index("lowered_decode"), names.index("fuse_elementwise_exact")
    assert lower < min(names.index(c) for c in CLEANUPS) and max(names.index(c) for c in CLEANUPS) < fuse
    assert [n for n in names if n in CLEANUPS] == CLEANUPS  # host syncs, no-op casts, duplicates, dead code
    (plan,) = [p for p in space.neighbours(default_plan("exact")) if "lowered_decode" in {s.name for s in p.steps}]
    assert [s.name for s in plan.steps] == ["lowered_decode", *CLEANUPS, "fuse_elementwise_exact"]


@pytest.mark.parametrize("name", ["llama-tiny", "deepseekv3-tiny", "minimax-tiny"])
def test_the_composed_plan_lowers_what_lowered_decode_lowers_alone(name):
    """The default plan with lowered_decode added by the search: the same kernel ops as lowered_decode alone
    (attention, MLA, linear attention, MoE, GEMVs), bit-exact with the captured step. In name order llama-tiny
    kept every attention in aten (185 nodes instead of 21)."""
    from tkcc.agents.search import SearchSpace
    from tkcc.frontend.capture import capture_model
    from tkcc.passes.default_plan import default_plan
    from tkcc.passes.manager import apply_plan

    prog = capture_model(name, "float32", "cpu", max_cache_len=32, phases=["decode"])
    alone, _ = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    space = SearchSpace.from_registry(exact_only=False)
    (plan,) = [p for p in space.neighbours(default_plan("exact")) if "lowered_decode" in {s.name for s in p.steps}]
    new, _ = apply_plan(prog, plan, mode="tolerance")
    want = _kernels(alone.graphs["decode"])
    assert sum(v for k, v in want.items() if "attention" in k) >= 1, want
    assert _kernels(new.graphs["decode"]) == want
    assert same_decode(prog, new.graphs["decode"]) is None


def test_a_to_that_noop_elim_dropped_does_not_stop_a_match():
    """gpt-oss's eager attention holds ``to(float32)`` of an fp32 slice whose traced strides differ from its
    input's: eager returns the input itself, and ``noop-elim`` drops it. The patterns' canonical form drops it
    too, so a plan with noop-elim first still fuses every attention with its sinks."""
    from tkcc.frontend.capture import capture_model
    from tkcc.passes.manager import apply_plan

    prog = capture_model("gptoss-tiny", "float32", "cpu", max_cache_len=32, phases=["decode"])
    alone, _ = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    after, _ = apply_plan(prog, [{"name": "noop-elim"}, {"name": "lowered_decode"}], mode="tolerance")
    want = _kernels(alone.graphs["decode"])
    assert want["tkcc.attention_rope.default"] == prog.num_blocks
    assert _kernels(after.graphs["decode"]) == want
    assert same_decode(prog, after.graphs["decode"]) is None


def test_fusion_after_lowering_takes_what_no_rewrite_took():
    """Qwen2-MoE's shared-expert gate (sigmoid, mul, add, the reshape to [1, 1, H], the residual add) stays in aten
    after lowered_decode; fuse_elementwise, which the search composes after it, makes it one kernel a layer. On
    CPU the fused kernel runs its reference (the same ops), so the step stays bit-exact."""
    from tkcc.frontend.capture import capture_model
    from tkcc.passes.manager import apply_plan
    from tkcc.passes.lower.decode import VIEWS

    prog = capture_model("qwen2moe-tiny", "float32", "cpu", max_cache_len=32, phases=["decode"])
    new, logs = apply_plan(prog, [{"name": "lowered_decode"}, {"name": "fuse_elementwise"}], mode="tolerance")
    gm = new.graphs["decode"]
    fused = [n for n in gm.graph.nodes if getattr(n.target, "__tkcc_kernel__", False)]
    assert len(fused) == prog.num_blocks and all(len(n.target.origin) == 5 for n in fused), logs[1].notes
    left = {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and not str(n.target).startswith("tkcc.")
            and not getattr(n.target, "__tkcc_kernel__", False)} - VIEWS
    assert not left, left
    assert same_decode(prog, gm) is None


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3moe-tiny", "deepseekv3-tiny"])
def test_cse_before_lowering_in_a_users_plan_lowers_the_same(name):
    """A plan a user writes runs in its own order. ``cse`` first merges every layer's ``cos.unsqueeze(1)`` (and
    other views of the table and mask) into one node that all layers read; a view of a pattern's inputs alone may
    be read outside the region, so each attention still lowers (before, every one stayed in aten), bit-exact."""
    from tkcc.frontend.capture import capture_model
    from tkcc.passes.manager import apply_plan

    prog = capture_model(name, "float32", "cpu", max_cache_len=32, phases=["decode"])
    alone, _ = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    after, _ = apply_plan(prog, [{"name": "cse"}, {"name": "lowered_decode"}], mode="tolerance")
    want = _kernels(alone.graphs["decode"])
    assert sum(v for k, v in want.items() if "attention" in k or "mla" in k) >= prog.num_blocks, want
    assert _kernels(after.graphs["decode"]) == want
    assert same_decode(prog, after.graphs["decode"]) is None
