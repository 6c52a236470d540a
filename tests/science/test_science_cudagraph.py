"""CUDA-graph runner: capture keys, eager fallback on CPU, and (GPU) bit-exact replay."""
import pytest
import torch

from tkcc.kernels.graph_replay import CapturedCall, GraphCache, probe_sync, signature

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_signature_separates_what_picks_kernels():
    x = torch.randn(4, 8)
    assert signature((x,)) != signature((torch.randn(4, 9),))
    assert signature((x,)) != signature((x.double(),))
    assert signature((1,)) != signature((2,))  # Python scalars are keyed by value
    assert signature((1,)) == signature((1,))
    assert signature(({"a": x},)) != signature(((x,),))  # structure is part of the key


@gpu
@pytest.mark.gpu
def test_signature_device_tensors_by_layout_not_value():
    x = torch.randn(4, 8, device="cuda")
    assert signature((x,)) == signature((torch.randn(4, 8, device="cuda"),))
    assert signature((x,)) != signature((x.t(),))
    assert signature((x,)) != signature((x.view(-1)[1:].view(1, 31),))  # another shape and a misaligned pointer
    y = torch.randn(33, device="cuda")[1:].view(4, 8)  # same shape and strides, pointer off by 4 bytes
    assert signature((x,)) != signature((y,))
    w = torch.randn(3, device="cuda")
    assert signature((w,), static_ptrs=frozenset([w.data_ptr()])) != signature((w.clone(),),
                                                                               static_ptrs=frozenset([w.data_ptr()]))


def test_signature_host_tensor_values_and_weights():
    t = torch.tensor([0.0, 0.5, 1.0])
    assert signature((t,)) != signature((t + 1,))
    assert signature((t,)) == signature((t.clone(),))
    with pytest.raises(TypeError, match="captured-graph input"):
        signature((object(),))


def test_graph_cache_on_cpu_runs_eagerly_and_says_why():
    calls = []

    def f(x, y):
        calls.append(1)
        return x @ y + 1

    cache = GraphCache(f, name="mm", capture_after=1)
    a, b = torch.randn(5, 6), torch.randn(6, 7)
    out = cache(a, b)
    assert torch.equal(out, a @ b + 1)
    rep = cache.report()
    assert rep["graphs"] == 0 and rep["eager_calls"] == 1 and len(calls) == 1
    assert any("no CUDA tensor" in r for r in rep["refused"])


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 256)
        self.b = torch.nn.Linear(256, 64)

    def forward(self, x, scale):
        return self.b(torch.nn.functional.gelu(self.a(x))) * scale


@gpu
@pytest.mark.gpu
def test_replay_is_bitwise_eager_on_fresh_inputs():
    torch.manual_seed(0)
    m = _MLP().cuda().eval()
    ptrs = frozenset(p.data_ptr() for p in m.parameters())
    cache = GraphCache(m, static_ptrs=ptrs)
    with torch.no_grad():
        for rows in (1, 7, 300):
            for _ in range(3):
                x = torch.randn(rows, 64, device="cuda")
                assert torch.equal(cache(x, 0.5), m(x, 0.5))
        # a different host scalar is a different graph, not a stale one
        x = torch.randn(7, 64, device="cuda")
        assert torch.equal(cache(x, 2.0), m(x, 2.0))
    rep = cache.report()
    assert rep["graphs"] == 4 and rep["replays"] == 10 and rep["eager_calls"] == 0


@gpu
@pytest.mark.gpu
def test_inplace_input_write_is_copied_back():
    def f(x):
        x.add_(1.0)
        return x * 2

    c = CapturedCall(f, (torch.zeros(8, device="cuda"),))
    x = torch.randn(8, device="cuda")
    want = x.clone()
    want_out = f(want)
    got = c(x)
    assert torch.equal(got, want_out) and torch.equal(x, want)


@gpu
@pytest.mark.gpu
def test_sync_probe_refuses_host_reads():
    def f(x):
        n = int((x > 0).sum())  # host read
        return x[:n] * 2

    x = torch.randn(16, device="cuda")
    assert probe_sync(f, (x,)) is not None
    assert probe_sync(lambda y: y * 2, (x,)) is None
    cache = GraphCache(f)
    assert torch.equal(cache(x), f(x))
    assert cache.report()["graphs"] == 0 and cache.report()["refused"]


@gpu
@pytest.mark.gpu
def test_capture_after_two_leaves_one_off_shapes_eager():
    cache = GraphCache(lambda x: x.sin() + x.cos(), capture_after=2)
    x = torch.randn(10, device="cuda")
    cache(x)
    assert cache.report()["graphs"] == 0
    y = torch.randn(10, device="cuda")
    assert torch.equal(cache(y), y.sin() + y.cos())
    assert cache.report()["graphs"] == 1


class _Grid(torch.nn.Module):
    """Reads its own buffer on the host (like torchdiffeq's time grid) and, optionally, its input."""

    def __init__(self, read_input=False):
        super().__init__()
        self.register_buffer("ts", torch.linspace(0, 1, 5))
        self.read_input = read_input

    def forward(self, x):
        y = x
        for j in range(1, len(self.ts)):
            if self.ts[j] > self.ts[j - 1]:  # host read of model state only
                y = y * 0.5 + self.ts[j]
        if self.read_input and (y.sum() > 0):  # host read of an input-dependent value
            y = -y
        return y


def test_host_reads_record_and_replay_state_reads():
    from tkcc.kernels.host_reads import HostReads

    m = _Grid()
    x = torch.randn(3)
    with HostReads([x], "record") as rec:
        want = m(x)
    assert rec.values == [True] * 4
    with HostReads([x], "replay", rec.values) as rep:
        got = m(x)
    assert torch.equal(got, want) and rep.i == 4 and len(rep.guards) == 4
    assert [bool(g) for g in rep.guards] == rec.values  # the guards hold the values the graph computes


def test_host_reads_refuse_input_dependent_reads():
    from tkcc.kernels.graph_replay import SpeculationError
    from tkcc.kernels.host_reads import HostReads

    m = _Grid(read_input=True)
    x = torch.randn(3)
    with pytest.raises(SpeculationError, match="depends on the inputs"):
        with HostReads([x], "record"):
            m(x)
    # taint follows views and in-place writes into other tensors
    buf = torch.zeros(3)
    with pytest.raises(SpeculationError):
        with HostReads([x], "record"):
            buf[1:].copy_(x[:2])
            bool(buf.sum() > 0)


@gpu
@pytest.mark.gpu
def test_speculative_capture_is_bitwise_and_guarded():
    m = _Grid().cuda()
    cache = GraphCache(m, speculate=True)
    for _ in range(3):
        x = torch.randn(64, device="cuda")
        assert torch.equal(cache(x), m(x))
    rep = cache.report()
    assert rep["graphs"] == 1 and rep["speculated_host_reads"] == [4]
    m.ts.copy_(torch.tensor([0.0, 0.5, 0.4, 0.8, 1.0]))  # state edited in place: guards must catch it
    x = torch.randn(64, device="cuda")
    assert torch.equal(cache(x), m(x))
    assert cache.report()["guard_failures"] == 1
    bad = GraphCache(_Grid(read_input=True).cuda(), speculate=True)
    x = torch.randn(64, device="cuda")
    assert torch.equal(bad(x), bad.fn(x)) and bad.report()["graphs"] == 0
