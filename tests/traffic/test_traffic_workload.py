"""Trace -> Workload: buckets, weights, fingerprint, clipping, representative requests, non-LLM shapes."""
import numpy as np
import pytest

from tkcc.errors import TkccError
from tkcc.traffic import Routing, Trace, Workload, bundled_trace, load_trace, workload_from_trace
from tkcc.traffic.buckets import decode_contexts, decode_hat_weights, hat_weights


def test_buckets_weights_and_grid(conv):
    w = workload_from_trace(conv, max_context=16384, batch_sizes=(1, 4), num_buckets=10)
    assert w.phases() == {"prefill", "decode"} and w.batch_sizes() == [1, 4]
    for phase in ("prefill", "decode"):
        assert abs(sum(b.weight for b in w.buckets_for(phase)) - 1) < 1e-9
        for bs in (1, 4):
            ctx = [b.context for b in w.buckets_for(phase, bs)]
            assert ctx == sorted(ctx) and 2 <= len(ctx) <= 10
    pre = w.buckets_for("prefill", 1)
    assert pre[0].context == conv.input_tokens.min() and pre[-1].context == conv.input_tokens.max()
    dec = w.buckets_for("decode", 1)
    assert dec[-1].context == (conv.input_tokens + conv.output_tokens - 1).max()
    # hat weights reproduce the mean decode context exactly
    _, ctx = decode_contexts(conv.input_tokens, conv.output_tokens)
    mean_from_buckets = sum(b.context * b.weight for b in dec) / sum(b.weight for b in dec)
    assert abs(mean_from_buckets - ctx.mean()) / ctx.mean() < 1e-9
    assert len(w.representative) == 8 and all(i > 0 for i, _ in w.representative)
    assert abs(sum(s for _, _, s in w.mix) - 1) < 1e-9
    assert w.meta["requests"] == len(conv) and w.meta["clipped"] == 0


def test_decode_hat_weights_vs_enumerating_reference():
    rng = np.random.default_rng(0)
    for _ in range(12):
        n = int(rng.integers(1, 60))
        L = rng.integers(1, 3000, n)
        O = rng.integers(0, 150, n)
        g = np.unique(rng.integers(1, 4000, rng.integers(1, 12)))
        fast = decode_hat_weights(g, L, O)
        # plain reference: every step, one by one
        ref = np.zeros(g.size)
        for l, o in zip(L, O):
            for c in range(l + 1, l + o):
                x = min(max(c, g[0]), g[-1])
                k = max(min(np.searchsorted(g, x, side="right") - 1, g.size - 2), 0)
                if g.size == 1:
                    ref[0] += 1
                    continue
                t = (x - g[k]) / (g[k + 1] - g[k])
                ref[k] += 1 - t
                ref[k + 1] += t
        if ref.sum() == 0:
            continue
        assert np.allclose(fast, ref / ref.sum(), atol=1e-12)
        assert np.allclose(hat_weights(g, decode_contexts(L, O)[1]), fast, atol=1e-12)


def test_fingerprint_stable_and_sensitive(conv, code):
    a = workload_from_trace(conv, max_context=8192)
    b = workload_from_trace(load_trace(bundled_trace("azure-conv")), max_context=8192)
    assert a.fingerprint() == b.fingerprint()
    assert workload_from_trace(code, max_context=8192).fingerprint() != a.fingerprint()
    assert workload_from_trace(conv, max_context=8192, batch_sizes=(2,)).fingerprint() != a.fingerprint()
    r = Routing.from_olmoe_counts(domain="c4")
    assert workload_from_trace(conv, max_context=8192, routing=r).fingerprint() != a.fingerprint()
    back = Workload.from_dict(a.to_dict())
    assert back.fingerprint() == a.fingerprint() and back.buckets == a.buckets
    wr = workload_from_trace(conv, max_context=8192, routing=r)
    assert Workload.from_dict(wr.to_dict()).fingerprint() == wr.fingerprint()


def test_clipping_recorded_or_refused(conv):
    w = workload_from_trace(conv, max_context=2048)
    over = (np.maximum(conv.input_tokens, 1) + conv.output_tokens) > 2048
    assert w.meta["clipped"] == int(over.sum()) > 0
    assert w.meta["clipped_input"] == int((conv.input_tokens > 2047).sum())
    assert max(b.context for b in w.buckets) <= 2048
    assert all(i + o <= 2048 for i, o, _ in w.mix)
    with pytest.raises(TkccError, match="exceed max_context=2048"):
        workload_from_trace(conv, max_context=2048, on_overflow="error")
    with pytest.raises(ValueError, match="no requests"):
        workload_from_trace(conv.select(slice(0, 0)), max_context=2048)


def test_trace_routing_is_carried(conv):
    tr = conv.select(slice(0, 100))
    tr.routing = Routing.from_olmoe_counts(domain="github")
    w = workload_from_trace(tr, max_context=8192)
    assert w.routing is tr.routing


def test_from_shapes():
    w = Workload.from_shapes([({"x": (8, 3, 224, 224)}, 3), ({"x": (1, 3, 224, 224), "t": (1,)}, 1)])
    assert w.phases() == {"forward"} and [b.batch for b in w.buckets] == [8, 1]
    assert [b.weight for b in w.buckets] == [0.75, 0.25]
    assert w.buckets[1].shape_dict() == {"x": (1, 3, 224, 224), "t": (1,)}
    assert w.objective == "mean_latency_s"
    assert Workload.from_dict(w.to_dict()).fingerprint() == w.fingerprint()
    assert Workload.from_shapes([({"x": (8, 3, 224, 225)}, 1)]).fingerprint() != w.fingerprint()
    with pytest.raises(ValueError, match="weight"):
        Workload.from_shapes([({"x": (1,)}, 0)])
    with pytest.raises(ValueError, match="shapes"):
        Workload.from_shapes([({}, 1)])


def test_select_window_concat(conv):
    w = conv.window(600, 1200)
    assert w.arrival_s.min() >= 600 and w.arrival_s.max() < 1200 and len(w) == 3118
    parts = [conv.select(slice(0, 10)), conv.select(slice(10, 25))]
    assert np.array_equal(Trace.concat(parts).input_tokens, conv.input_tokens[:25])
