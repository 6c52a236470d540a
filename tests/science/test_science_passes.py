"""exact_cudagraph and exact_regions: registered as exact, keep bits, split where a forward reads values."""
import pytest
import torch
import torch.fx

from tkcc.frontend.program import Program
from tkcc.passes.base import get_pass
from tkcc.passes.exact_regions import split_regions
from tkcc.passes.manager import PassManager
from tkcc.passes.plan import PassPlan


class DataDependent(torch.nn.Module):
    """Two host reads: a nonzero (data-dependent size) and an int(max) — like PyG and e3nn."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x, group):
        h = torch.tanh(self.lin(x)) * 1.5 + 0.25
        keep = (h[:, 0] > 0).nonzero().squeeze(1)  # data-dependent count
        h = torch.relu(self.lin(h[keep])) - 0.5
        n = int(group.max()) + 1  # host read
        pooled = h.new_zeros(n, 8).index_add_(0, group[keep], h)
        return self.out(torch.sigmoid(pooled) * 2.0 + 1.0)


def test_passes_are_registered_exact():
    for name in ("exact_cudagraph", "exact_regions"):
        cls = get_pass(name)
        assert cls.exact is True and cls.description


def test_regions_split_at_host_reads_and_keep_bits():
    torch.manual_seed(0)
    m = DataDependent().eval()
    f = split_regions(m, capture_after=1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n in (20, 20, 31, 20, 57):
            x = torch.randn(n, 8, generator=g)
            group = torch.randint(0, 4, (n,), generator=g)
            assert torch.equal(f(x, group), m(x, group))
    rep = f.report()
    assert len(rep["regions"]) >= 2, rep  # cut into pieces, not one graph
    assert rep["graph_breaks"], "graph breaks must be reported, not skipped"
    assert sum(r["eager_calls"] + r["replays"] for r in rep["regions"]) > 0


def _program(module, example):
    gm = torch.fx.symbolic_trace(module)
    return Program(graphs={"forward": gm}, example_inputs={"forward": example}, layer_map={"forward": {}},
                   num_blocks=1, model=module, fingerprint="test")


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))).softmax(-1)


@pytest.mark.parametrize("plan", [["exact_cudagraph"], ["exact_regions"], ["exact_regions", "exact_cudagraph"]])
def test_passes_through_pass_manager_bitwise(plan):
    torch.manual_seed(1)
    m = Plain().eval()
    x = torch.randn(5, 16)
    prog = _program(m, (x,))
    new, logs = PassManager(mode="exact").run(prog, PassPlan.of(*plan))
    assert [log.name for log in logs] == plan
    assert all(log.phases["forward"].check == "exact" for log in logs)
    with torch.no_grad():
        for rows in (1, 5, 9):
            y = torch.randn(rows, 16)
            assert torch.equal(new.graphs["forward"](y), m(y))
