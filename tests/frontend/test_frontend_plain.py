"""Capture of plain PyTorch modules: one "forward" graph, repeated blocks, truncation, shared weights, bad input."""
from __future__ import annotations

import pytest
import torch

from tkcc.errors import CaptureError, TkccError
from tkcc.frontend import capture
from tkcc.frontend.layer_map import find_repeated_blocks
from tkcc.traffic.workload import Bucket


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Tower(torch.nn.Module):
    """Stem, a stack of identical blocks, and a two-output head (like most models)."""

    def __init__(self, d=16, n=4):
        super().__init__()
        self.stem = torch.nn.Linear(8, d)
        self.mlp_pair = torch.nn.ModuleList([torch.nn.Linear(d, d), torch.nn.Linear(d, d)])  # fewer than blocks
        self.blocks = torch.nn.ModuleList([Block(d) for _ in range(n)])
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x, scale):
        h = self.stem(x) * scale
        for lin in self.mlp_pair:
            h = torch.relu(lin(h))
        for blk in self.blocks:
            h = blk(h)
        out = self.head(h)
        return out, out.softmax(-1)


def tower():
    torch.manual_seed(0)
    return Tower().eval()


def inputs(batch=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 8, generator=g), torch.rand(batch, 1, generator=g) + 0.5


def test_forward_graph_equals_eager_on_fresh_inputs():
    model = tower()
    prog = capture(model, example_inputs=inputs())
    assert prog.phases == ["forward"]
    gm = prog.graphs["forward"]
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["x", "scale"]
    assert "call_module" not in {n.op for n in gm.graph.nodes}
    for seed in (1, 2, 3):
        x, s = inputs(seed=seed)
        got, ref = gm(x, s), model(x, s)
        assert isinstance(got, tuple) and len(got) == 2
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    fresh = prog.make_inputs["forward"](None, torch.Generator().manual_seed(7))
    assert [t.shape for t in fresh] == [t.shape for t in inputs()]
    assert all(torch.equal(a, b) for a, b in zip(gm(*fresh), model(*fresh)))


def test_repeated_blocks_and_layer_map():
    model = tower()
    assert find_repeated_blocks(model) == ("blocks", 4)
    prog = capture(model, example_inputs=inputs())
    assert prog.num_blocks == 4 and prog.meta["block_container"] == "blocks"
    lmap = prog.layer_map["forward"]
    assert set(lmap.values()) == {0, 1, 2, 3}
    gm = prog.graphs["forward"]
    for node in gm.graph.nodes:
        stack = [p for p, _ in (node.meta.get("nn_module_stack") or {}).values()]
        if any(p.startswith("blocks.2") for p in stack) or str(node.target).startswith("blocks.2."):
            assert lmap[node.name] == 2
        if any(p.startswith(("stem", "head", "mlp_pair")) for p in stack):
            assert node.name not in lmap


def test_parameters_shared_with_model():
    model = tower()
    prog = capture(model, example_inputs=inputs())
    ptrs = {p.data_ptr() for p in model.parameters()}
    graph_params = list(prog.graphs["forward"].parameters())
    assert len(graph_params) == len(list(model.parameters()))
    assert all(p.data_ptr() in ptrs for p in graph_params)
    with torch.no_grad():  # an in-place weight update shows through the graph: nothing was copied
        model.head.bias.add_(1.0)
    x, s = inputs(seed=4)
    assert torch.equal(prog.graphs["forward"](x, s)[0], model(x, s)[0])


def test_truncate_keeps_first_blocks_sharing_weights():
    model = tower()
    prog = capture(model, example_inputs=inputs())
    small = prog.truncate(2)
    assert small.num_blocks == 2 and set(small.layer_map["forward"].values()) == {0, 1}
    assert len(model.blocks) == 4  # the original is untouched
    assert small.model.blocks[0] is model.blocks[0] and small.model.head is model.head
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in ptrs for p in small.graphs["forward"].parameters())
    ref_model = tower()
    ref_model.blocks = torch.nn.ModuleList(list(ref_model.blocks)[:2])
    x, s = inputs(seed=5)
    got = small.graphs["forward"](x, s)
    assert all(torch.equal(a, b) for a, b in zip(got, ref_model(x, s)))
    assert not torch.equal(got[0], prog.graphs["forward"](x, s)[0])


def test_sequential_root_and_single_block_models():
    torch.manual_seed(0)
    seq = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(3)]).eval()
    prog = capture(seq, example_inputs=(torch.randn(2, 6),))
    assert prog.num_blocks == 3 and prog.meta["block_container"] == ""
    assert set(prog.layer_map["forward"].values()) == {0, 1, 2}
    small = prog.truncate(1)
    x = torch.randn(2, 6)
    assert torch.equal(small.graphs["forward"](x), seq[0](x))

    lone = torch.nn.Linear(4, 4).eval()
    prog = capture(lone, example_inputs=torch.randn(3, 4))
    assert prog.num_blocks == 1 and prog.layer_map["forward"] == {}
    assert prog.truncate(1) is prog
    with pytest.raises(ValueError):
        prog.truncate(2)


def test_make_inputs_with_bucket_shapes():
    model = tower()
    prog = capture(model, example_inputs=inputs())
    ok = Bucket("forward", shapes=(("x", (5, 8)),))
    x, s = prog.make_inputs["forward"](ok, torch.Generator().manual_seed(0))
    assert x.shape == (5, 8) and s.shape == (5, 1)
    with pytest.raises(TkccError, match="differs from the captured"):
        prog.make_inputs["forward"](Bucket("forward", shapes=(("x", (7, 8)),)), None)
    with pytest.raises(TkccError, match="unknown input"):
        prog.make_inputs["forward"](Bucket("forward", shapes=(("y", (5, 8)),)), None)
    batch = torch.export.Dim("batch", min=2, max=64)
    dyn = capture(model, example_inputs=inputs(), dynamic_shapes=({0: batch}, {0: batch}))
    x, s = dyn.make_inputs["forward"](Bucket("forward", shapes=(("x", (9, 8)), ("scale", (9, 1)))), None)
    assert all(torch.equal(a, b) for a, b in zip(dyn.graphs["forward"](x, s), model(x, s)))


def test_bad_inputs_are_named():
    with pytest.raises(CaptureError, match=r"nn\.Module, got builtins\.function"):
        capture(lambda x: x * 2, example_inputs=(torch.ones(2),))
    with pytest.raises(CaptureError, match=r"nn\.Module, got builtins\.str"):
        capture("llama-tiny")
    with pytest.raises(CaptureError, match="example_inputs"):
        capture(tower())
    with pytest.raises(CaptureError, match=r"example_inputs\[1\] is a float"):
        capture(tower(), example_inputs=(torch.randn(5, 8), 0.5))
    with pytest.raises(CaptureError, match="phase"):
        capture(tower(), example_inputs=inputs(), phases=["decode"])
    dropout = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    with pytest.raises(CaptureError, match=r"Dropout.*training mode.*eval\(\)"):
        capture(dropout, example_inputs=(torch.randn(2, 4),))
    assert capture(dropout.eval(), example_inputs=(torch.randn(2, 4),)).num_blocks == 1
