"""Each scientific model: built from its library, captured, compiled and bit-checked against eager.

CPU (small sizes): TorchDynamo cuts the forward at its graph breaks and every
piece runs as an FX graph; outputs must be ``torch.equal`` to eager on fresh
inputs of every bucket, and every break must be reported. GPU (benchmark
sizes): ``compile_exact`` in its automatic mode captures CUDA graphs and must
stay bit-exact on fresh inputs of every workload shape.
"""
import pytest
import torch

from tkcc.science import build, compile_exact
from tkcc.science.compat import missing_library
from tkcc.science.models import LIBRARY
from tkcc.traffic.workload import Workload

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# models whose forward reads tensor values on the host (so TorchDynamo must cut it)
BREAKS = {"latent_ode", "gcn", "e3nn"}
# how compile_exact's automatic mode captures each on a GPU (docs/science.md): torchdiffeq's host reads are of
# its own time grid, so latent_ode is speculated whole; PyG's GCN and e3nn read input-dependent values
CUDA_MODE = {"latent_ode": "speculative", "gcn": "regions", "gin": "whole", "e3nn": "regions",
             "convnext_tiny": "whole"}


def _need(name):
    msg = missing_library(LIBRARY.get(name, name))
    if msg:
        pytest.skip(msg)


def _first(workload, k):
    return Workload(buckets=list(workload.buckets[:k]), objective=workload.objective, source=workload.source)


def _check_fresh(fast, sm, buckets, seeds=(7, 8)):
    for b in buckets:
        for s in seeds:
            args = sm.inputs(b, s)
            got = fast(*args)
            want = fast.reference(*args)
            assert torch.equal(got, want), f"{sm.name} {b.key()} seed {s}: not bit-exact"


@pytest.mark.parametrize("name", ["latent_ode", "gcn", "gin", "e3nn", "convnext_tiny"])
def test_cpu_capture_compile_bitwise(name):
    _need(name)
    sm = build(name, small=True)
    wl = _first(sm.workload, 1 if name in ("e3nn", "convnext_tiny") else 2)
    fast = compile_exact(sm.module, wl, inputs=sm.make_inputs, deterministic=sm.deterministic, mode="regions",
                         validate=1)
    assert fast.mode == "regions", fast.report()["tried"]
    _check_fresh(fast, sm, wl.buckets)
    rep = fast.report()["capture"]
    assert rep["regions"], "no FX piece was captured"
    assert sum(r["ops"] for r in rep["regions"]) >= 10
    if name in BREAKS:
        assert rep["graph_breaks"], f"{name} reads values on the host; its graph breaks must be reported"


def test_workloads_are_realistic_and_named():
    _need("torch_geometric")
    sm = build("gcn")
    sizes = {dict(b.shapes)["x"][0] for b in sm.workload.buckets}
    assert min(sizes) <= 40 and 2708 in sizes  # a single molecule and a Cora-sized citation graph
    assert abs(sum(b.weight for b in sm.workload.buckets) - 1.0) < 1e-9
    args = sm.inputs(sm.workload.buckets[-1], 0)
    assert tuple(args[1].shape) == dict(sm.workload.buckets[-1].shapes)["edge_index"]


def test_seeded_weights_are_reproducible():
    _need("torchdiffeq")
    a, b = build("latent_ode", small=True, seed=3), build("latent_ode", small=True, seed=3)
    for (n, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), n


def test_compile_exact_rejects_bad_arguments():
    from tkcc.errors import TkccError

    m = torch.nn.Linear(3, 3)
    with pytest.raises(TkccError, match="mode"):
        compile_exact(m, Workload.from_shapes([({"x": (2, 3)}, 1.0)]), mode="fast")
    with pytest.raises(TkccError, match="Workload"):
        compile_exact(m, [(2, 3)])


def test_compile_exact_default_inputs_plain_module():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 2))
    wl = Workload.from_shapes([({"x": (4, 6)}, 0.5), ({"x": (9, 6)}, 0.5)])
    fast = compile_exact(m, wl)
    for rows in (4, 9):
        x = torch.randn(rows, 6)
        assert torch.equal(fast(x), fast.reference(x))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_MODE))
def test_gpu_benchmark_sizes_bitwise_and_captured(name):
    _need(name)
    sm = build(name, device="cuda")
    fast = compile_exact(sm.module, sm.workload, inputs=sm.make_inputs, deterministic=sm.deterministic)
    assert fast.mode == CUDA_MODE[name], fast.report()["tried"]
    _check_fresh(fast, sm, sm.workload.buckets, seeds=(11, 12, 11))  # the repeat replays a captured graph
    cap = fast.report()["capture"]
    graphs = cap.get("graphs", 0) if "regions" not in cap else sum(r["graphs"] for r in cap["regions"])
    assert graphs > 0, f"{name}: nothing was captured as a CUDA graph: {cap}"
    if fast.mode == "speculative":  # every graph read the grid on the host, and no guard ever fired
        assert all(n > 0 for n in cap["speculated_host_reads"]) and cap["guard_failures"] == 0, cap


def _record_reads(sm):
    import torch.utils._pytree as pytree

    from tkcc.kernels.host_reads import HostReads

    args = sm.inputs(sm.workload.buckets[0], 1)
    leaves = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    with torch.no_grad():
        want = sm.module(*args)
        with HostReads(leaves, "record") as rec:
            sm.module(*args)
        with HostReads(leaves, "replay", rec.values) as rep:
            got = sm.module(*args)
    return rec, rep, torch.equal(want, got)


def test_latent_ode_host_reads_depend_only_on_its_time_grid():
    """torchdiffeq reads its time grid on the host every step: speculable (one graph), and replay keeps bits."""
    _need("latent_ode")
    sm = build("latent_ode", small=True)
    rec, rep, same = _record_reads(sm)
    n_steps = len(sm.module.ts) - 1
    assert len(rec.values) >= 2 * n_steps and all(isinstance(v, bool) for v in rec.values)
    assert same and rep.i == len(rec.values) and len(rep.guards) == len(rec.values)


def test_e3nn_host_reads_depend_on_inputs():
    """e3nn pools with int(batch.max()): not speculable, so it must be split into regions instead."""
    _need("e3nn")
    from tkcc.kernels.graph_replay import SpeculationError

    with pytest.raises(SpeculationError, match="depends on the inputs"):
        _record_reads(build("e3nn", small=True))
