"""What one machine can do, measured once and cached: memory bandwidth, op overhead, collectives.

The cost model needs these numbers per machine and degree; they are measured,
never looked up in a datasheet:

- ``mem_bw_gbs``: bytes/s a matrix-vector product reads from device memory
  (decode reads each weight once per token this way), on a 512 MiB weight;
- ``dispatch_us``: host time per op of a captured FX graph run eagerly (the
  tiny Llama's decode step: all overhead, no work; eager graphs are bound by
  this at batch 1);
- ``kernel_us``: device time per kernel of the same graph replayed in a CUDA
  graph (the floor per kernel when the host is out of the way);
- per-op costs of the big kernels a captured decode graph runs, each timed in
  a CUDA graph: ``stream_bw_gbs`` (an elementwise kernel over 1 GiB), ``gemv_us`` (the
  fixed part of a weight-streaming GEMV, fitted over weights of 8-64 MiB),
  ``attn_floor_us`` (a decode attention call over a short cache),
  ``expand_copy_gbs`` (materialising GQA-repeated K/V, what the attention
  backend does with HF's expanded K/V views) and ``topk_us`` (a router top-k);
- per degree, ``all_reduce`` latency (us) and bus bandwidth (GB/s), fitted
  as ``t(n) = lat + n * 2(d-1)/d / busbw`` to timed all-reduces of 4 KiB to
  16 MiB, eager and (on GPUs) inside a CUDA graph.

Results are cached in ``~/.cache/tkcc/machine.json`` (``TKCC_CACHE_DIR``
overrides the folder) under a key of device name and count, with the torch
version and date; ``machine_profile()`` measures only what is missing.
Degrees above the devices present are not measured; the cost model
extrapolates them and says so.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tkcc.errors import TkccError
from tkcc.kernels.graph_replay import CapturedCall, replay_us


@dataclass
class CollectiveFit:
    lat_us: float
    busbw_gbs: float
    mode: str = "eager"
    samples: list = field(default_factory=list)  # [(bytes, us)]

    def time_us(self, nbytes: float, degree: int) -> float:
        return self.lat_us + nbytes * 2 * (degree - 1) / degree / (self.busbw_gbs * 1e3)


@dataclass
class MachineProfile:
    device: str
    count: int
    mem_bw_gbs: float
    dispatch_us: float
    kernel_us: float
    all_reduce: dict = field(default_factory=dict)  # str(degree) -> {mode: CollectiveFit as dict}
    torch_version: str = ""
    measured_at: str = ""
    # per-op costs of a real decode graph's big kernels (None: not measured, the model leaves the term out)
    stream_bw_gbs: float | None = None    # an elementwise kernel over 1 GiB: bytes read + written per second
    gemv_us: float | None = None          # fixed cost of one weight-streaming GEMV: t = gemv_us + bytes / stream bw
    attn_floor_us: float | None = None    # one decode attention call over a short cache
    expand_copy_gbs: float | None = None  # materialising GQA-repeated K/V (broadcast read + write) per second
    topk_us: float | None = None          # one router top-k
    derived_from: str = ""                # where these per-op numbers came from, if not measured here

    @property
    def key(self) -> str:
        return machine_key(self.device, self.count)

    def fit(self, degree: int, mode: str = "eager") -> tuple[CollectiveFit, str]:
        """The all-reduce fit at ``degree`` and how it was obtained ('measured' or 'extrapolated from d=..')."""
        by_deg = {int(k): v for k, v in self.all_reduce.items()}
        if degree in by_deg:
            fits = by_deg[degree]
            f = fits.get(mode) or fits.get("eager")
            return CollectiveFit(**f), "measured"
        if not by_deg:
            raise TkccError(f"machine profile {self.key}: no collective measurements; run "
                            "tkcc.parallel.machine.machine_profile(measure_collectives=True) on a machine with "
                            "at least 2 devices")
        base = max(d for d in by_deg if d <= degree) if any(d <= degree for d in by_deg) else min(by_deg)
        f = by_deg[base].get(mode) or by_deg[base]["eager"]
        # ring all-reduce: 2(d-1) latency steps; bus bandwidth per link unchanged
        scale = (degree - 1) / (base - 1) if base > 1 else 1.0
        return CollectiveFit(lat_us=f["lat_us"] * scale, busbw_gbs=f["busbw_gbs"], mode=mode), \
            f"extrapolated from d={base} (ring: latency x{scale:.2f})"

    def to_json(self) -> dict:
        return asdict(self)


def machine_key(device: str, count: int) -> str:
    return f"{device} x{count}"


def cache_path() -> Path:
    root = os.environ.get("TKCC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tkcc")
    return Path(root) / "machine.json"


def current_device() -> tuple[str, int]:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0), torch.cuda.device_count()
    return "cpu", 1


def load_profiles(path: Path | None = None) -> dict:
    path = path or cache_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TkccError(f"{path}: machine cache is unreadable ({e}); delete it to re-measure") from e


def save_profile(p: MachineProfile, path: Path | None = None) -> Path:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_profiles(path)
    data[p.key] = p.to_json()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev, reps: int, warmup: int = 3) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(dev: torch.device, mib: int = 512, dtype=torch.bfloat16) -> float:
    """GB/s a matrix-vector product reads (weight bytes / time)."""
    if dev.type == "cpu":
        dtype, mib = torch.float32, min(mib, 64)
    cols = 4096
    rows = mib * 2**20 // (cols * torch.tensor([], dtype=dtype).element_size())
    w = torch.randn(rows, cols, device=dev, dtype=dtype)
    x = torch.randn(1, cols, device=dev, dtype=dtype)
    t = _time(lambda: torch.nn.functional.linear(x, w), dev, reps=20)
    return w.numel() * w.element_size() / t / 1e9


def measure_dispatch(dev: torch.device, n: int = 200) -> float:
    """Host microseconds to issue one small aten op."""
    x = torch.ones(8, device=dev)

    def loop():
        y = x
        for _ in range(n):
            y = torch.ops.aten.add.Tensor(y, 1.0)
        return y

    return _time(loop, dev, reps=10) / n * 1e6


def measure_kernel_in_graph(dev: torch.device, n: int = 200) -> float:
    """Device microseconds per tiny kernel replayed in a CUDA graph (the dispatch cost on CPU)."""
    if dev.type != "cuda":
        return measure_dispatch(dev, n)
    x = torch.ones(8, device=dev)

    def chain():
        y = x
        for _ in range(n):
            y = y + 1.0
        return y

    g = CapturedCall(chain, warmup=1, device=dev)
    return _time(g.replay, dev, reps=20) / n * 1e6


def measure_graph_floor(dev: torch.device, model: str = "llama-tiny") -> tuple[float, float]:
    """(host us per graph op, device us per kernel) from a tiny captured decode graph.

    A tiny model's decode step does almost no work, so its eager time is the
    host cost of issuing its ops from the FX graph, and its time replayed in
    a CUDA graph is the per-kernel floor of the same op mix a real model runs.
    """
    from tkcc.frontend.hf import capture_hf
    from tkcc.frontend.models import build_model
    from tkcc.parallel.cost import count_ops

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    prog = capture_hf(build_model(model, dtype=dtype, device=dev), phases=["decode"], max_cache_len=64)
    gm = prog.graphs["decode"]
    ops = count_ops(gm)
    ids = torch.zeros((1, 1), dtype=torch.long, device=dev)
    pos = torch.tensor([8], device=dev)
    with torch.no_grad():
        host = _time(lambda: gm(ids, pos), dev, reps=30) / ops["host_ops"] * 1e6
        if dev.type != "cuda":
            return host, host
        g = CapturedCall(gm, (ids, pos), warmup=3, device=dev)
        kern = _time(g.replay, dev, reps=50) / ops["kernels"] * 1e6
    return host, kern


_SIZES = (4096, 65536, 1 << 20, 16 << 20)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x (slope 0 when every x is the same)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _fit(samples: list[tuple[int, float]], degree: int) -> tuple[float, float]:
    """Least squares t = lat + n * 2(d-1)/d / bw over (bytes, us) samples -> (lat_us, busbw GB/s)."""
    xs = [n * 2 * (degree - 1) / degree for n, _ in samples]
    ys = [t for _, t in samples]
    intercept, slope = _line(xs, ys)
    lat = max(intercept, min(ys) * 0.5)
    bw = (1.0 / slope) / 1e3 if slope > 0 else 1e6  # bytes/us -> GB/s
    return lat, bw


def _collective_rank(rank: int, world: int, sizes=_SIZES, reps: int = 30) -> dict:
    """Runs on every rank: time all-reduces of each size, eager and (CUDA) in a graph."""
    import torch.distributed as dist

    g = dist.group.WORLD.group_name
    dev = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    c = torch.ops._c10d_functional
    out = {"eager": []}
    inner = 20
    if dev.type == "cpu":  # gloo: the numbers only feed CPU tests; keep it quick
        sizes, inner, reps = tuple(n for n in sizes if n <= 1 << 18) or (4096,), 5, 6
    for n in sizes:
        x = torch.ones(n // torch.tensor([], dtype=dtype).element_size(), device=dev, dtype=dtype)

        def loop(x=x):
            y = x
            for _ in range(inner):
                y = c.wait_tensor(c.all_reduce(y, "sum", g))
            return y

        dist.barrier()
        out["eager"].append((n, _time(loop, dev, reps=max(3, reps // 3)) / inner * 1e6))
    if dev.type == "cuda":
        try:
            out["cuda_graph"] = _collective_graph_times(x.new_empty(0), sizes, inner, reps, g, dist)
        except Exception as e:  # noqa: BLE001 - the eager fit still stands; the cost model falls back to it
            out.pop("cuda_graph", None)
            out["cuda_graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def _collective_graph_times(like, sizes, inner, reps, g, dist) -> list:
    c = torch.ops._c10d_functional
    times = []
    for n in sizes:
        x = torch.ones(n // like.element_size(), device=like.device, dtype=like.dtype)

        def loop(x=x):
            y = x
            for _ in range(inner):
                y = c.wait_tensor(c.all_reduce(y, "sum", g))
            return y

        graph = CapturedCall(loop, warmup=1, device=like.device)
        dist.barrier()
        times.append((n, _time(graph.replay, like.device, reps=max(3, reps // 3)) / inner * 1e6))
    return times


def measure_collectives(degree: int, timeout_s: float = 240.0) -> dict:
    """{mode: CollectiveFit as dict} for all-reduce over ``degree`` ranks (starts ``degree`` processes)."""
    from tkcc.parallel.launch import launch

    res = launch(_collective_rank, degree, (), timeout_s=timeout_s)
    out = {}
    for mode in [m for m in res[0] if not m.endswith("_error") and all(m in r for r in res)]:
        samples = [(n, max(r[mode][i][1] for r in res)) for i, (n, _) in enumerate(res[0][mode])]
        lat, bw = _fit(samples, degree)
        out[mode] = asdict(CollectiveFit(lat_us=lat, busbw_gbs=bw, mode=mode, samples=samples))
    return out


def measure_floor(dev: torch.device) -> tuple[float, float]:
    """Host us per op and device us per kernel: from a tiny real graph, else from a loop of adds."""
    try:
        return measure_graph_floor(dev)
    except Exception:  # noqa: BLE001 - no transformers / capture failed: the op-loop numbers still measure it
        return measure_dispatch(dev), measure_kernel_in_graph(dev)


def graph_replay_us(fn, dev, reps: int = 20) -> float:
    """Device microseconds of ``fn`` replayed in a CUDA graph (median; two warm-up calls, three warm replays)."""
    return replay_us(fn, reps, warmup=2, warm_replays=3, device=dev)


def measure_op_costs(dev: torch.device) -> dict:
    """The per-op numbers of :class:`MachineProfile` (CUDA only: on CPU every op is dispatch-bound)."""
    if dev.type != "cuda":
        return {}
    bf = torch.bfloat16
    # an elementwise kernel over 1 GiB (a same-dtype copy_ in a graph becomes a copy-engine memcpy node, which
    # streams slower than the SM kernels a decode step runs: 2.67 vs ~4.2 TB/s on an H200)
    a = torch.ones(1 << 29, dtype=bf, device=dev)
    b = torch.empty_like(a)
    stream = 2 * a.numel() * 2 / graph_replay_us(lambda: torch.mul(a, 1.0, out=b), dev) / 1e3
    del a, b
    # GEMVs over 8 distinct weights per size (more than L2 holds), fitted t = c + bytes / bw
    pts = []
    for mib in (8, 16, 32, 64):
        ws = [torch.randn(mib * 2**20 // (2048 * 2), 2048, device=dev, dtype=bf) for _ in range(8)]
        x = torch.randn(1, 2048, device=dev, dtype=bf)
        us = graph_replay_us(lambda: [torch.nn.functional.linear(x, w) for w in ws], dev) / len(ws)
        pts.append((mib * 2**20, us))
        del ws
    gemv = max(0.0, _line([p[0] for p in pts], [p[1] for p in pts])[0])
    # decode attention over a short cache (16 heads x 128, 2k positions): the per-call floor
    q = torch.randn(1, 16, 1, 128, device=dev, dtype=bf)
    kv = torch.randn(1, 16, 2048, 128, device=dev, dtype=bf)
    attn = graph_replay_us(lambda: [torch.nn.functional.scaled_dot_product_attention(q, kv, kv) for _ in range(8)],
                     dev) / 8
    # GQA K/V repeated 4x as HF's expand views, materialised (what the attention backend does with them)
    k = torch.randn(1, 8, 1, 32768, 64, device=dev, dtype=bf)
    out = torch.empty(1, 32, 32768, 64, device=dev, dtype=bf)
    ex = k.expand(1, 8, 4, 32768, 64)
    copy_bytes = 2 * out.numel() * 2
    expand = copy_bytes / graph_replay_us(lambda: out.view(1, 8, 4, 32768, 64).copy_(ex), dev) / 1e3
    logits = torch.randn(1, 64, device=dev, dtype=bf)
    topk = graph_replay_us(lambda: [torch.topk(logits, 8, dim=-1) for _ in range(8)], dev) / 8
    return dict(stream_bw_gbs=stream, gemv_us=gemv, attn_floor_us=attn, expand_copy_gbs=expand, topk_us=topk)


def measure_profile(degrees=None, measure_collectives_too: bool = True) -> MachineProfile:
    name, count = current_device()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dispatch, kernel = measure_floor(dev)
    prof = MachineProfile(device=name, count=count, mem_bw_gbs=measure_bandwidth(dev),
                          dispatch_us=dispatch, kernel_us=kernel, torch_version=torch.__version__,
                          measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          **measure_op_costs(dev))
    if measure_collectives_too:
        if degrees is None:
            degrees = [d for d in (2, 4, 8) if d <= max(count, 2 if dev.type == "cpu" else count)]
        for d in degrees:
            prof.all_reduce[str(d)] = measure_collectives(d)
    return prof


def machine_profile(refresh: bool = False, path: Path | None = None, measure_collectives_too: bool = True
                    ) -> MachineProfile:
    """This machine's profile: from the cache, or measured now and cached."""
    name, count = current_device()
    key = machine_key(name, count)
    data = {} if refresh else load_profiles(path)
    if key in data:
        return MachineProfile(**data[key])
    prof = measure_profile(measure_collectives_too=measure_collectives_too)
    save_profile(prof, path)
    return prof
