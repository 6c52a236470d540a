"""tkcc.compile picks the path by what it is given: a shape Workload gets the bit-exact compile."""
import torch

import tkcc
from tkcc.traffic.workload import Workload


def test_shape_workload_gets_exact_compile_on_every_shape():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
    w = Workload.from_shapes([({"x": (8, 16)}, 0.7), ({"x": (1, 16)}, 0.3)])
    fast = tkcc.compile(m, w)
    for rows in (8, 1):
        x = torch.randn(rows, 16)
        assert torch.equal(fast(x), m(x))
    assert fast.report()  # says what it captured and how it checked
