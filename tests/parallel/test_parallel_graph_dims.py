"""The sharding pass reads the dimensions it splits off the captured graphs (the views that split projections
into heads, the linear computing the logits, the expert gathers), not off the model's config."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tkcc.errors import PassError
from tkcc.parallel.layout import LayoutError, dims_for_model

FIELDS = ("heads", "kv_heads", "head_dim", "vocab", "hidden", "intermediate", "experts", "top_k",
          "expert_intermediate", "tied_embeddings", "layers")


def _program(name, **overrides):
    from tkcc.frontend import capture
    from tkcc.frontend.models import build_model

    return capture(build_model(name, num_hidden_layers=2, **overrides), max_cache_len=16, phases=["decode"])


@pytest.mark.parametrize("name,overrides", [
    ("llama-tiny", {}),                                                  # GQA: 4 query heads over 2 KV heads
    ("llama-tiny", {"num_attention_heads": 16, "num_key_value_heads": 8}),
    ("olmoe-tiny", {}),                                                  # q/k norms over the projected width
    ("mixtral-tiny", {}),
    ("qwen3moe-tiny", {}),                                               # q/k norms per head, after the split
])
def test_the_graph_gives_what_the_config_says(name, overrides):
    from tkcc.passes.sharding import graph_dims

    prog = _program(name, **overrides)
    dims, out_w = graph_dims(prog)
    want = dims_for_model(name, num_hidden_layers=2, **overrides)
    assert {f: getattr(dims, f) for f in FIELDS} == {f: getattr(want, f) for f in FIELDS}
    assert out_w is prog.model.get_output_embeddings().weight


@pytest.fixture(scope="module")
def configless():
    """llama-tiny's Program whose model has no config and no get_output_embeddings: only the graph is left."""
    prog = _program("llama-tiny")
    return dataclasses.replace(prog, model=torch.nn.Module())


def test_a_model_without_a_config_is_laid_out_from_its_graph(configless):
    from tkcc.passes.sharding import shard_program

    with pytest.raises(LayoutError, match="num_key_value_heads=2 of llama-tiny"):
        shard_program(configless, 4, "tp")
    with pytest.raises(LayoutError, match="has no experts"):
        shard_program(configless, 2, "tp_ep")
    out, info = shard_program(configless, 1, "tp")
    assert out is configless and "exact" in info.notes[0]


def test_a_graph_with_nothing_to_split_is_refused():
    from tkcc.frontend import capture
    from tkcc.passes.sharding import shard_program

    class Scale(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    prog = capture(Scale(), example_inputs=(torch.randn(2, 8),))
    with pytest.raises(PassError, match="nothing in the graphs to split"):
        shard_program(prog, 2, "tp")
