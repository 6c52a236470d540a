"""Bad layouts are rejected with the dimension named; the pass is a registered, plan-able pass."""
from __future__ import annotations

import pytest
import torch

from tkcc.errors import PlanError
from tkcc.parallel.launch import check_world, launch
from tkcc.parallel.layout import LayoutError, check_layout, dims_for_model, legal_layouts


@pytest.mark.parametrize("model,degree,strategy,field", [
    ("llama-tiny", 4, "tp", "num_key_value_heads=2"),      # 4 heads, 2 KV heads
    ("olmoe-tiny", 8, "tp", "num_attention_heads=4"),
    ("olmoe-tiny", 8, "tp_ep", "num_attention_heads=4"),
    ("llama-1b-16l", 16, "tp", "degree=16 is not one of"),
])
def test_bad_degree_names_the_dimension(model, degree, strategy, field):
    with pytest.raises(LayoutError, match=field):
        check_layout(dims_for_model(model), degree, strategy)


def test_expert_parallel_degree_must_divide_experts():
    dims = dims_for_model("olmoe-tiny", num_attention_heads=8, num_key_value_heads=8, num_experts=12)
    check_layout(dims, 4, "tp_ep")
    with pytest.raises(LayoutError, match="num_experts=12"):
        check_layout(dims, 8, "tp_ep")


def test_ep_on_a_dense_model_and_too_few_devices():
    with pytest.raises(LayoutError, match="has no experts"):
        check_layout(dims_for_model("llama-tiny"), 2, "tp_ep")
    with pytest.raises(LayoutError, match="needs 4 devices, only 2 present"):
        check_layout(dims_for_model("olmoe-16l"), 4, "tp", devices=2)
    if not torch.cuda.is_available():
        with pytest.raises(LayoutError, match="2 ranks need 2 GPUs, only 0 present"):
            check_world(2, "nccl")


def test_legal_layouts_of_the_reference_models():
    assert legal_layouts(dims_for_model("llama-1b-16l")) == [(1, "tp"), (2, "tp"), (4, "tp"), (8, "tp")]
    olmoe = legal_layouts(dims_for_model("olmoe-16l"))
    assert (2, "tp_ep") in olmoe and (8, "tp_ep") in olmoe and (1, "tp_ep") not in olmoe
    assert legal_layouts(dims_for_model("llama-tiny")) == [(1, "tp"), (2, "tp")]


def test_pass_is_registered_with_its_space():
    from tkcc.passes.base import get_pass

    cls = get_pass("sharding")
    assert cls.params == {"degree": [1, 2, 4, 8], "strategy": ["tp", "tp_ep"]}
    with pytest.raises(PlanError, match="degree.*3.*out of range"):
        cls.check_params({"degree": 3})


@pytest.fixture(scope="module")
def llama2():
    from tkcc.frontend.hf import capture_hf
    from tkcc.frontend.models import build_model

    return capture_hf(build_model("llama-tiny", num_hidden_layers=2), max_cache_len=16)


def test_degree_one_is_the_same_program(llama2):
    from tkcc.passes.sharding import shard_program

    out, info = shard_program(llama2, 1, "tp")
    assert out is llama2 and "exact" in info.notes[0]


def test_degree_two_without_a_process_group_is_refused(llama2):
    from tkcc.passes.sharding import shard_program

    with pytest.raises(LayoutError, match="torch.distributed is not initialised"):
        shard_program(llama2, 2, "tp")


def _plan_on_rank(rank, world, program):
    from tkcc.passes.manager import apply_plan

    out, logs = apply_plan(program, [{"name": "sharding", "params": {"degree": world, "strategy": "tp"}}],
                           mode="tolerance")
    ph = logs[0].phases["decode"]
    return out.meta["layout"], ph.check, ph.max_abs_err, logs[0].notes


def test_plan_runs_through_the_pass_manager_on_each_rank(llama2):
    res = launch(_plan_on_rank, 2, (llama2,), timeout_s=180)
    for rank, (layout, check, err, notes) in enumerate(res):
        assert layout["rank"] == rank and layout["degree"] == 2
        assert check == "tolerance" and err < 1e-4
        assert any("collectives per call" in n for n in notes)
