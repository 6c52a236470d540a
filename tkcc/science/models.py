"""Scientific models built from their own libraries, unchanged, with seeded random weights (fp32).

Each builder returns a ``ScienceModel``: the module (eval mode, on the device),
its Workload (the input sizes it sees in use, with weights) and
``make_inputs(bucket, generator)`` that builds a fresh input of exactly that
bucket's shapes (a new graph, new positions, new images each call).

- ``latent_ode``: the latent-ODE model of torchdiffeq's own example
  (``examples/latent_ode.py``: recognition RNN, ODE function, decoder) with
  ``torchdiffeq.odeint(method="rk4")`` over a fixed grid of 40 time points.
- ``gcn``, ``gin``: ``torch_geometric.nn.models.GCN`` / ``GIN`` on molecule
  batches and citation-sized graphs.
- ``e3nn``: ``e3nn.nn.models.v2106.gate_points_networks.SimpleNetwork`` on
  batches of molecule-like point clouds (it builds its own radius graph).
- ``convnext_tiny``: ``timm.create_model("convnext_tiny")`` at batch 1, 8, 32.

``deterministic``: the model's eager forward on CUDA uses atomics
(``scatter_add_`` in the message passing), so two eager runs differ in the last
bits; bit-exactness is then defined against eager under
``torch.use_deterministic_algorithms(True)``, and tkcc runs in that mode too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from tkcc.errors import TkccError
from tkcc.science.compat import import_timm, missing_library
from tkcc.science import graphs
from tkcc.science.workloads import science_workload
from tkcc.traffic.workload import Bucket, Workload


@dataclass
class ScienceModel:
    name: str
    module: nn.Module
    workload: Workload
    make_inputs: Callable  # (bucket, generator) -> tuple of positional args
    deterministic: bool = False
    library: str = ""
    notes: list[str] = field(default_factory=list)

    def inputs(self, bucket: Bucket, seed: int = 0) -> tuple:
        return self.make_inputs(bucket, torch.Generator().manual_seed(seed))


def _shape(bucket: Bucket, name: str) -> tuple:
    for n, s in bucket.shapes:
        if n == name:
            return tuple(s)
    raise TkccError(f"workload bucket {bucket.key()} has no shape for input {name!r}")


def _require(lib: str) -> None:
    msg = missing_library(lib)
    if msg:
        raise TkccError(msg)


# ---------------------------------------------------------------- latent ODE (torchdiffeq)
class LatentODEfunc(nn.Module):
    """dz/dt = f(z): torchdiffeq's latent_ode example (ELU MLP)."""

    def __init__(self, latent_dim: int, nhidden: int):
        super().__init__()
        self.elu = nn.ELU(inplace=True)
        self.fc1 = nn.Linear(latent_dim, nhidden)
        self.fc2 = nn.Linear(nhidden, nhidden)
        self.fc3 = nn.Linear(nhidden, latent_dim)

    def forward(self, t, x):
        out = self.elu(self.fc1(x))
        out = self.elu(self.fc2(out))
        return self.fc3(out)


class RecognitionRNN(nn.Module):
    def __init__(self, latent_dim: int, obs_dim: int, nhidden: int):
        super().__init__()
        self.nhidden = nhidden
        self.i2h = nn.Linear(obs_dim + nhidden, nhidden)
        self.h2o = nn.Linear(nhidden, latent_dim * 2)

    def forward(self, x, h):
        h = torch.tanh(self.i2h(torch.cat((x, h), dim=1)))
        return self.h2o(h), h


class Decoder(nn.Module):
    def __init__(self, latent_dim: int, obs_dim: int, nhidden: int):
        super().__init__()
        self.fc1 = nn.Linear(latent_dim, nhidden)
        self.fc2 = nn.Linear(nhidden, obs_dim)

    def forward(self, z):
        return self.fc2(torch.relu(self.fc1(z)))


class LatentODE(nn.Module):
    """Encode observed trajectories backwards in time, integrate the latent state with rk4, decode.

    Inference uses the posterior mean as z0 (no sampling), so the forward is a
    function of its input. The time grid is configuration, not input.
    """

    def __init__(self, obs_dim=4, latent_dim=16, rnn_hidden=64, ode_hidden=128, dec_hidden=64,
                 n_points=40, t_end=4.0):
        super().__init__()
        import torchdiffeq

        self._odeint = torchdiffeq.odeint
        self.latent_dim = latent_dim
        self.func = LatentODEfunc(latent_dim, ode_hidden)
        self.rec = RecognitionRNN(latent_dim, obs_dim, rnn_hidden)
        self.dec = Decoder(latent_dim, obs_dim, dec_hidden)
        self.register_buffer("ts", torch.linspace(0.0, t_end, n_points), persistent=False)

    def forward(self, obs):
        h = obs.new_zeros(obs.shape[0], self.rec.nhidden)
        for t in reversed(range(obs.shape[1])):
            out, h = self.rec(obs[:, t, :], h)
        z0 = out[:, : self.latent_dim]
        pred_z = self._odeint(self.func, z0, self.ts, method="rk4").permute(1, 0, 2)
        return self.dec(pred_z)


def build_latent_ode(device="cpu", seed=0, small=False) -> ScienceModel:
    _require("torchdiffeq")
    torch.manual_seed(seed)
    m = LatentODE(n_points=8 if small else 40).to(device).eval()
    t_obs = 12 if small else 50
    batches = [(1, 0.3), (4, 0.7)] if small else [(1, 0.3), (32, 0.4), (256, 0.3)]
    wl = science_workload("latent_ode", [((("obs", (b, t_obs, 4)),), w) for b, w in batches])

    def make(bucket, gen):
        return (torch.randn(_shape(bucket, "obs"), generator=gen).to(device),)

    return ScienceModel("latent_ode", m, wl, make, library="torchdiffeq",
                        notes=[f"rk4 over {len(m.ts)} time points ({len(m.ts) - 1} steps), {t_obs} observations"])


# ---------------------------------------------------------------- GCN / GIN (torch-geometric)
def _graph_buckets(small: bool):
    """(name, nodes, directed edges, features, weight): molecule batches and citation graphs."""
    if small:
        return [("mol1", 18, graphs.typical_molecule_edges(18), 16, 0.5),
                ("mol8", 160, graphs.typical_molecule_edges(160), 16, 0.3),
                ("cite-small", 300, 1200, 64, 0.2)]
    n, e, f, _ = graphs.CITATION_SIZES["cora"]
    n2, e2, f2, _ = graphs.CITATION_SIZES["pubmed"]
    return [("mol1", 24, graphs.typical_molecule_edges(24), 16, 0.3),
            ("mol64", 1280, graphs.typical_molecule_edges(1280), 16, 0.4),
            ("cora", n, e, f, 0.2),
            ("pubmed", n2, e2, f2, 0.1)]


def _build_pyg(kind: str, device, seed, small) -> ScienceModel:
    _require("torch_geometric")
    from torch_geometric.nn.models import GCN, GIN

    specs = _graph_buckets(small)
    feats = sorted({f for *_, f, _ in specs})
    # one model per feature width would change the model per bucket; a workload of one model has one
    # input width, so molecule and citation graphs are separate models: we key by feature width
    torch.manual_seed(seed)
    cls = {"gcn": GCN, "gin": GIN}[kind]
    models = {f: cls(in_channels=f, hidden_channels=64, num_layers=3, out_channels=16).to(device).eval()
              for f in feats}
    module = _ByWidth(models)
    wl = science_workload(kind, [((("x", (n, f)), ("edge_index", (2, e))), w) for _, n, e, f, w in specs])

    def make(bucket, gen):
        n, f = _shape(bucket, "x")
        e = _shape(bucket, "edge_index")[1]
        if f == 16:  # molecule batch: atom features
            ei, _ = graphs.molecule_batch(n, e, generator=gen)
        else:
            ei = graphs.citation_graph(n, e, generator=gen)
        x = torch.randn((n, f), generator=gen)
        return (x.to(device), ei.to(device))

    return ScienceModel(kind, module, wl, make, deterministic=True, library="torch_geometric",
                        notes=[f"{name}: {n} nodes, {e} edges, {f} features" for name, n, e, f, _ in specs])


class _ByWidth(nn.Module):
    """Dispatch on input feature width to the library model built for it (molecules vs citations).

    The dispatch reads a shape, never a value, so it is fixed per workload bucket.
    """

    def __init__(self, models: dict):
        super().__init__()
        self.widths = sorted(models)
        self.models = nn.ModuleList([models[f] for f in self.widths])

    def forward(self, x, edge_index):
        return self.models[self.widths.index(x.shape[1])](x, edge_index)


def build_gcn(device="cpu", seed=0, small=False) -> ScienceModel:
    return _build_pyg("gcn", device, seed, small)


def build_gin(device="cpu", seed=0, small=False) -> ScienceModel:
    return _build_pyg("gin", device, seed, small)


# ---------------------------------------------------------------- e3nn
def build_e3nn(device="cpu", seed=0, small=False) -> ScienceModel:
    _require("e3nn")
    import e3nn
    from e3nn.nn.models.v2106.gate_points_networks import SimpleNetwork

    # e3nn's documented setting for torch.compile: its code-generated tensor products stay plain FX modules
    # instead of TorchScript (TorchScript's fuser would pick other kernels than eager PyTorch).
    prev = e3nn.get_optimization_defaults()
    e3nn.set_optimization_defaults(jit_script_fx=False)
    try:
        torch.manual_seed(seed)
        m = SimpleNetwork(irreps_in="8x0e", irreps_out="1x0e", max_radius=2.5, num_neighbors=10.0,
                          num_nodes=20.0, mul=8 if small else 32, layers=2 if small else 3, lmax=2,
                          pool_nodes=True).to(device).eval()
    finally:
        e3nn.set_optimization_defaults(**prev)
    sizes = [(20, 0.5), (60, 0.5)] if small else [(20, 0.3), (320, 0.4), (1280, 0.3)]
    wl = science_workload("e3nn", [((("pos", (n, 3)), ("x", (n, 8)), ("batch", (n,))), w) for n, w in sizes])

    def make(bucket, gen):
        n = _shape(bucket, "pos")[0]
        sizes = graphs.molecule_sizes(n, graphs._rng(gen))
        batch = torch.from_numpy(np.repeat(np.arange(len(sizes)), sizes))
        pos = graphs.molecule_positions(batch, gen)
        types = torch.randint(0, 8, (n,), generator=gen)
        x = torch.nn.functional.one_hot(types, 8).float()
        return ({"pos": pos.to(device), "x": x.to(device), "batch": batch.to(device)},)

    return ScienceModel("e3nn", m, wl, make, deterministic=True, library="e3nn",
                        notes=["SimpleNetwork (gate points, v2106): radius graph, spherical harmonics, "
                               "tensor-product message passing, pooled per molecule"])


# ---------------------------------------------------------------- ConvNeXt (timm)
def build_convnext_tiny(device="cpu", seed=0, small=False) -> ScienceModel:
    timm = import_timm()
    torch.manual_seed(seed)
    m = timm.create_model("convnext_tiny", pretrained=False).to(device).eval()
    res = 64 if small else 224
    batches = [(1, 0.5), (2, 0.5)] if small else [(1, 0.4), (8, 0.4), (32, 0.2)]
    wl = science_workload("convnext_tiny", [((("x", (b, 3, res, res)),), w) for b, w in batches])

    def make(bucket, gen):
        return (torch.randn(_shape(bucket, "x"), generator=gen).to(device),)

    return ScienceModel("convnext_tiny", m, wl, make, library="timm",
                        notes=[f"timm convnext_tiny, random init, {res}x{res}"])


BUILDERS = {
    "latent_ode": build_latent_ode,
    "gcn": build_gcn,
    "gin": build_gin,
    "e3nn": build_e3nn,
    "convnext_tiny": build_convnext_tiny,
}
LIBRARY = {"latent_ode": "torchdiffeq", "gcn": "torch_geometric", "gin": "torch_geometric", "e3nn": "e3nn",
           "convnext_tiny": "timm"}


def build(name: str, device="cpu", seed: int = 0, small: bool = False) -> ScienceModel:
    """Build a scientific model by name (see ``BUILDERS``); ``small`` gives CPU-test sizes."""
    try:
        fn = BUILDERS[name]
    except KeyError:
        raise TkccError(f"unknown science model {name!r}; known: {', '.join(BUILDERS)}") from None
    return fn(device=device, seed=seed, small=small)
