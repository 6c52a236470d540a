"""The one CUDA-graph utility (tkcc.kernels.graph_replay): replay == eager on fresh inputs, input copy-in,
pools, what the key holds, PDL for the kernels inside; and its eager fallback off CUDA."""
from __future__ import annotations

import pytest
import torch

from tkcc.kernels.graph_replay import (CapturedCall, GraphCache, GraphCaptureError, kernel_switches, launch_pdl,
                                       new_pool, pdl_scope, pdl_supported, replay_us, signature)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Block(torch.nn.Module):
    """A few library kernels (GEMMs, a norm, an activation) and a host scalar."""

    def __init__(self, d=48):
        super().__init__()
        self.a = torch.nn.Linear(d, 4 * d)
        self.b = torch.nn.Linear(4 * d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x, scale):
        return self.norm(x + self.b(torch.nn.functional.silu(self.a(x)))) * scale


# ---- CPU ------------------------------------------------------------------------------------------

def test_off_cuda_the_cache_is_the_eager_call_and_says_so():
    torch.manual_seed(0)
    m = _Block().eval()
    cache = GraphCache(m, name="block", pdl=True)
    with torch.no_grad():
        for rows in (1, 5, 17):
            x = torch.randn(rows, 48)
            assert torch.equal(cache(x, 0.5), m(x, 0.5))
    rep = cache.report()
    assert rep["graphs"] == 0 and rep["eager_calls"] == 3 and rep["replays"] == 0
    assert rep["refused"] == ["no CUDA tensor among the inputs (nothing to capture; runs eagerly)"]


def test_the_key_holds_the_switches_that_pick_kernels():
    x = torch.randn(3, 4)
    base = signature((x,))
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(not prev)
    try:
        assert signature((x,)) != base
    finally:
        torch.use_deterministic_algorithms(prev)
    assert signature((x,)) == base
    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium" if prec != "medium" else "highest")
    try:
        assert signature((x,)) != base
    finally:
        torch.set_float32_matmul_precision(prec)
    assert kernel_switches() == base[2]


def test_pdl_scope_is_what_ops_called_without_pdl_launch_with():
    assert launch_pdl() is False and launch_pdl(True) is True
    with pdl_scope(True) as on:
        assert on == pdl_supported() and launch_pdl() == on  # off on a device without PDL (and on a CPU)
        assert launch_pdl(False) is False  # an op's own argument wins
        with pdl_scope(False):
            assert launch_pdl() is False
    assert launch_pdl() is False
    if not torch.cuda.is_available():
        assert not pdl_supported() and new_pool() is None


# ---- GPU ------------------------------------------------------------------------------------------

@gpu
@pytest.mark.gpu
def test_replay_is_eager_on_fresh_inputs_for_several_shapes():
    torch.manual_seed(0)
    m = _Block().cuda().eval()
    for rows in (1, 7, 130):
        g = CapturedCall(m, (torch.randn(rows, 48, device="cuda"), 0.5))
        for _ in range(3):
            x = torch.randn(rows, 48, device="cuda")
            with torch.no_grad():
                want = m(x, 0.5)
            assert torch.equal(g(x, 0.5), want)
            out = g.run(x, 0.5)  # the graph's own outputs, no copies
            assert len(out) == 1 and torch.equal(out[0], want)


@gpu
@pytest.mark.gpu
def test_inputs_are_copied_in_and_checked():
    """``load`` writes into the graph's static buffers, never into the caller's tensor, and refuses inputs the
    graph was not captured for (another shape, another baked-in host value)."""
    m = _Block().cuda().eval()
    x0 = torch.randn(4, 48, device="cuda")
    g = CapturedCall(m, (x0, 2.0))
    assert g.static_args[0] is not x0 and g.static_args[0].data_ptr() != x0.data_ptr()
    x = torch.randn(4, 48, device="cuda")
    keep = x.clone()
    g.load(x, 2.0)
    assert torch.equal(g.static_args[0], x) and torch.equal(x, keep)
    g.replay()
    with torch.no_grad():
        assert torch.equal(g.static_outputs[0], m(x, 2.0))
    first = g.static_outputs[0].clone()
    kept = g(x, 2.0)  # cloned out: the next replay does not touch it
    g.run(torch.randn(4, 48, device="cuda"), 2.0)
    assert torch.equal(kept, first) and not torch.equal(g.static_outputs[0], first)
    with pytest.raises(GraphCaptureError, match="captured for"):
        g.load(torch.randn(5, 48, device="cuda"), 2.0)
    with pytest.raises(GraphCaptureError, match="baked in"):
        g.load(x, 3.0)


@gpu
@pytest.mark.gpu
def test_graphs_share_a_pool_or_own_one():
    torch.manual_seed(1)
    m = _Block().cuda().eval()
    pool = new_pool()
    shapes = (64, 8, 1)  # largest first: the smaller graphs reuse its memory
    shared = [CapturedCall(m, (torch.randn(r, 48, device="cuda"), 1.0), pool=pool) for r in shapes]
    private = [CapturedCall(m, (torch.randn(r, 48, device="cuda"), 1.0)) for r in shapes]
    for _ in range(2):
        xs = [torch.randn(r, 48, device="cuda") for r in shapes]
        outs = [g(x, 1.0) for g, x in zip(shared, xs)]  # each cloned out before the next graph replays
        with torch.no_grad():
            want = [m(x, 1.0) for x in xs]
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
        assert all(torch.equal(g(x, 1.0), w) for g, x, w in zip(private, xs, want))


@gpu
@pytest.mark.gpu
def test_a_key_change_forces_a_new_capture():
    m = _Block().cuda().eval()
    cache = GraphCache(m, name="block")
    x = torch.randn(6, 48, device="cuda")
    calls = [((x, 1.0), 1), ((torch.randn(6, 48, device="cuda"), 1.0), 1),  # new values: the same graph
             ((torch.randn(9, 48, device="cuda"), 1.0), 2),                  # a shape
             ((x, 2.0), 3),                                                  # a host scalar
             ((torch.randn(6, 49, device="cuda")[:, 1:], 1.0), 4)]           # strides and alignment
    with torch.no_grad():
        for args, graphs in calls:
            assert torch.equal(cache(*args), m(*args))
            assert len(cache.graphs) == graphs
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            assert torch.equal(cache(x, 1.0), m(x, 1.0))  # a switch that picks kernels
        finally:
            torch.use_deterministic_algorithms(prev)
        assert len(cache.graphs) == 5
    assert cache.report()["replays"] == 6 and cache.report()["captures"] == 5
    f = GraphCache(lambda t: t.sin() * 2, name="sin")
    for t in (x, x.half(), x.double(), x.half()):  # a dtype
        assert torch.equal(f(t), t.sin() * 2)
    assert len(f.graphs) == 3 and f.report()["replays"] == 4


@gpu
@pytest.mark.gpu
def test_warmup_runs_on_a_side_stream_and_replays_write_the_callers_input():
    """The warm-up calls run on a side stream and do not leave their writes in the caller's input; each replay
    then advances it once (``__call__`` copies the written input back)."""
    pos = torch.zeros(1, device="cuda")
    streams = []

    def step(p):
        streams.append(torch.cuda.current_stream())
        p.add_(1)

    g = CapturedCall(step, (pos,), warmup=3)
    assert len(streams) == 4 and all(s != torch.cuda.default_stream() for s in streams)
    assert float(pos) == 0.0
    for n in (1, 2, 3):
        g(pos)
        assert float(pos) == n


@gpu
@pytest.mark.gpu
def test_pdl_setting_reaches_the_kernels_inside():
    """Kernel ops called with ``pdl=None`` inside a capture launch as the capture's ``pdl`` says (on Hopper);
    the PDL-chained GEMVs replayed from the graph equal their reference."""
    from tkcc.kernels.gemv import gemv, gemv_ref

    seen = []
    w1 = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(128, device="cuda", dtype=torch.bfloat16)

    def two(x):
        seen.append(launch_pdl())
        return gemv(gemv(x, w1), w2)

    for pdl in (False, True):
        seen.clear()
        g = CapturedCall(two, (x,), pdl=pdl)
        assert seen and all(s == (pdl and pdl_supported()) for s in seen)
        for _ in range(2):
            xi = torch.randn(128, device="cuda", dtype=torch.bfloat16)
            want = gemv_ref(gemv_ref(xi.reshape(1, -1), w1).reshape(1, -1), w2).reshape(-1)
            torch.testing.assert_close(g(xi).float(), want.float(), atol=2e-2, rtol=2e-2)
    assert launch_pdl() is False  # the scope ends with the capture
    assert replay_us(lambda: two(x), reps=5, pdl=True) > 0


@gpu
@pytest.mark.gpu
def test_a_capture_beside_a_thread_that_keeps_launching():
    """A server captures the forward it swaps in while another thread serves the old one: that thread's
    launches must not fail the capture, nor the capture fail them (seen on the H200 under a process-wide
    capture mode: "operation not permitted when stream is capturing")."""
    import threading

    x = torch.randn(256, 256, device="cuda")
    errors, stop = [], threading.Event()

    def serve():
        try:
            while not stop.is_set():
                (x @ x).sum().item()
        except Exception as e:  # noqa: BLE001 - the assertion below names it
            errors.append(e)
    t = threading.Thread(target=serve)
    t.start()
    try:
        for _ in range(20):
            call = CapturedCall(lambda a: torch.relu(a @ a) + 1, (x,), {}, warmup=1)
            assert torch.allclose(call(x), torch.relu(x @ x) + 1, rtol=1e-4, atol=1e-3)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
