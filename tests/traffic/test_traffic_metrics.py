"""Serving metrics: the fast path vs a plain per-token reference, and buckets vs request-by-request (2%)."""

import numpy as np
import pytest

from tkcc.errors import TkccError
from tkcc.traffic import (BucketTimingModel, FunctionTimingModel, Trace, Workload, bundled_trace, higher_is_better,
                          load_trace, objective, serving_metrics, workload_from_trace)
from tkcc.traffic.stats import nearest_rank


def _models(seed):
    """Measured-like step-time curves: fixed cost + KV-linear + bumps (tile boundaries), per batch."""
    rng = np.random.default_rng(seed)
    a, b, c, d = rng.uniform(1e-3, 5e-3), rng.uniform(1e-8, 1e-6), rng.uniform(1e-5, 5e-5), rng.uniform(0, 3e-4)
    period = rng.uniform(200, 3000)

    def pre(batch, ctx):
        return a + c * ctx * batch ** 0.8 + 2e-10 * ctx ** 2

    def dec(batch, ctx):
        return a * (1 + 0.03 * batch) + b * ctx * batch + d * np.sin(ctx / period) ** 2

    return pre, dec


def _plain_reference(L, O, pre, dec, batch=1):
    """Request by request, token by token: the definition the fast path must match."""
    ttft, tpot, e2e, norm, itl = [], [], [], [], []
    for l, o in zip(L, O):
        t0 = float(pre(batch, np.array([float(l)]))[0])
        steps = [float(dec(batch, np.array([float(l + j)]))[0]) for j in range(1, o)]
        ttft.append(t0)
        e = t0 + sum(steps)
        e2e.append(e)
        if o >= 2:
            tpot.append(sum(steps) / (o - 1))
        if o >= 1:
            norm.append(e / o)
        itl += steps
    return ttft, tpot, e2e, norm, itl


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_metrics_equal_plain_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 120))
    L = rng.integers(0, 3000, n)
    O = rng.integers(0, 200, n)
    tr = Trace(np.sort(rng.uniform(0, 100, n)), L, O)
    pre, dec = _models(seed)
    m = serving_metrics(tr, FunctionTimingModel(pre, dec))
    ttft, tpot, e2e, norm, itl = _plain_reference(np.maximum(L, 1), O, pre, dec)
    for key, ref in (("ttft_s", ttft), ("tpot_s", tpot), ("e2e_s", e2e), ("itl_s", itl),
                     ("e2e_per_output_token_s", norm)):
        for q in (0.5, 0.9, 0.99):
            assert m[key][f"p{int(q * 100)}"] == pytest.approx(nearest_rank(ref, q), rel=1e-9)
        assert m[key]["mean"] == pytest.approx(np.mean(ref), rel=1e-9)
    assert m["p90_decode_tokens_per_s"] == pytest.approx(1 / nearest_rank(tpot, 0.9), rel=1e-9)
    assert m["interactivity_p90"] == pytest.approx(1 / nearest_rank(norm, 0.9), rel=1e-9)


@pytest.mark.parametrize("name", ["azure-conv", "azure-code", "sharegpt", "servegen-m-large-80", "servegen-m-mid-81"])
def test_bucket_objective_agrees_with_request_by_request(name):
    tr = load_trace(bundled_trace(name))
    max_ctx = 32768
    for seed in (0, 1):
        pre, dec = _models(seed + 10)
        w = workload_from_trace(tr, max_context=max_ctx, batch_sizes=(1, 8))
        timings = {b.key(): float((pre if b.phase == "prefill" else dec)(b.batch, np.array([float(b.context)]))[0])
                   for b in w.buckets}
        same_steps = BucketTimingModel(w, timings)
        ref = serving_metrics(tr, same_steps, max_context=max_ctx, batch_sizes=(1, 8))
        for obj in ("p90_decode_tokens_per_s", "interactivity_p90", "p90_ttft_s", "p90_e2e_s", "p90_tpot_s"):
            w.objective = obj
            got = objective(w, timings)
            key = {"p90_ttft_s": ("ttft_s", "p90"), "p90_e2e_s": ("e2e_s", "p90"), "p90_tpot_s": ("tpot_s", "p90")}
            want = ref[key[obj][0]][key[obj][1]] if obj in key else ref[obj]
            assert abs(got / want - 1) < 0.02, (name, seed, obj, got, want)


def test_timing_model_errors_and_directions(conv):
    w = workload_from_trace(conv, max_context=8192)
    timings = {b.key(): 0.01 for b in w.buckets}
    missing = dict(list(timings.items())[1:])
    with pytest.raises(TkccError, match="no timing for 1 bucket"):
        objective(w, missing)
    with pytest.raises(TkccError, match="finite"):
        objective(w, {**timings, w.buckets[0].key(): float("nan")})
    with pytest.raises(TkccError, match="timing_model"):
        serving_metrics(conv, object())
    assert higher_is_better("p90_decode_tokens_per_s") and not higher_is_better("p90_ttft_s")
    with pytest.raises(TkccError, match="unknown objective"):
        higher_is_better("speed")
    # constant step time: every request decodes at 100 tok/s
    m = serving_metrics(w, timings)
    assert m["p90_decode_tokens_per_s"] == pytest.approx(100.0)
    assert m["measured_on"]["workload"] == w.fingerprint()


def test_bucket_timing_model_interpolates_and_extrapolates(conv):
    w = workload_from_trace(conv, max_context=8192, num_buckets=6)
    tm = BucketTimingModel(w, {b.key(): 1e-3 + 1e-7 * b.context for b in w.buckets})
    x = np.array([1.0, 500.0, 3000.0, 20000.0])
    assert np.allclose(tm.decode_step(1, x), 1e-3 + 1e-7 * x)
    with pytest.raises(TkccError, match="batch 2"):
        tm.prefill(2, x)


def test_forward_workload_objective():
    w = Workload.from_shapes([({"x": (8, 3, 32, 32)}, 3), ({"x": (1, 3, 32, 32)}, 1)])
    t = {w.buckets[0].key(): 0.004, w.buckets[1].key(): 0.001}
    assert objective(w, t) == pytest.approx(0.75 * 0.004 + 0.25 * 0.001)
    assert serving_metrics(w, lambda b: 0.002)["mean_latency_s"] == pytest.approx(0.002)
    w.objective = "p90_decode_tokens_per_s"
    with pytest.raises(TkccError, match="does not apply"):
        objective(w, t)
