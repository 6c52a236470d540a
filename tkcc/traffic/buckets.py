"""Trace -> Workload: the shapes an engine measures and how much traffic each stands for.

Decode dominates serving time, and a decode step's cost depends on the KV
length, so decode buckets sit on a grid of KV lengths placed at quantiles of
the *token-weighted* context distribution (where the steps actually happen),
with the smallest and largest context as end points so measured timings only
ever get interpolated. Prefill buckets do the same over prompt lengths.
Bucket weights are linear-interpolation (hat) weights: step i at context x
between grid points c_k < x < c_k+1 gives (c_k+1 - x)/(c_k+1 - c_k) to c_k
and the rest to c_k+1; so Σ_k w_k t(c_k) is exactly the mean step time under
the interpolated timing model.

Request-level metrics (percentiles) are not linear in bucket times; for them
the Workload keeps ``mix``, the trace compressed to request classes on a
grid of (input, output) lengths with cells at most 3% wide, each with its
share of requests and mean lengths.
"""
from __future__ import annotations

import numpy as np

from tkcc.traffic.requests import clip_requests
from tkcc.traffic.trace import Trace
from tkcc.traffic.workload import Bucket, Workload

_GRID_SAMPLE = 200_000  # requests used to place the grid (seeded subsample of larger traces)


def decode_contexts(L: np.ndarray, O: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(request index, KV length) of every decode step: request i has steps at L_i + 1 .. L_i + O_i - 1.

    The first output token comes from prefill; each later token is one decode
    step that attends to the prompt plus the tokens generated so far.
    """
    steps = np.maximum(O - 1, 0)
    total = int(steps.sum())
    rid = np.repeat(np.arange(L.size), steps)
    start = np.cumsum(steps) - steps
    j = np.arange(total) - np.repeat(start, steps) + 1
    return rid, L[rid] + j


def _quantile_grid(values: np.ndarray, weights: np.ndarray | None, n: int) -> np.ndarray:
    """n grid points (fewer when values repeat): min, max and weighted quantiles between them."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return np.array([], dtype=np.int64)
    lo, hi = v.min(), v.max()
    if n <= 2 or lo == hi:
        return np.unique(np.array([lo, hi], dtype=np.int64))[: max(n, 1)]
    order = np.argsort(v, kind="stable")
    w = np.ones(v.size) if weights is None else np.asarray(weights, dtype=np.float64)
    cw = np.cumsum(w[order])
    cw /= cw[-1]
    qs = (np.arange(1, n - 1)) / (n - 1)
    inner = v[order][np.minimum(np.searchsorted(cw, qs), v.size - 1)]
    return np.unique(np.round(np.concatenate([[lo], inner, [hi]])).astype(np.int64))


def hat_weights(grid: np.ndarray, x: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Share of the points x (weighted) given to each grid point by linear interpolation."""
    g = np.asarray(grid, dtype=np.float64)
    x = np.clip(np.asarray(x, dtype=np.float64), g[0], g[-1])
    w = np.ones(x.size) if w is None else np.asarray(w, dtype=np.float64)
    out = np.zeros(g.size)
    if g.size == 1:
        out[0] = w.sum()
        return out / max(out.sum(), 1e-300)
    k = np.clip(np.searchsorted(g, x, side="right") - 1, 0, g.size - 2)
    t = (x - g[k]) / (g[k + 1] - g[k])
    out += np.bincount(k, weights=w * (1 - t), minlength=g.size)
    out += np.bincount(k + 1, weights=w * t, minlength=g.size)
    return out / out.sum()


def _nearest_median(grid: np.ndarray, key: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Median of ``values`` over the items whose ``key`` is nearest each grid point (1 if none)."""
    idx = np.abs(key[:, None].astype(np.float64) - grid[None, :]).argmin(axis=1) if key.size else np.array([], int)
    out = np.ones(grid.size, dtype=np.int64)
    for k in range(grid.size):
        sel = values[idx == k]
        if sel.size:
            out[k] = max(int(np.median(sel)), 1)
    return out


def _log_bin(v: np.ndarray, eps: float, exact: int) -> np.ndarray:
    """Bin id: the value itself up to ``exact``, then bins (1+eps) times wider each."""
    v = np.maximum(v, 1)
    return np.where(v <= exact, v, exact + 1 + np.floor(np.log(v / exact) / np.log1p(eps)).astype(np.int64))


def request_mix(L: np.ndarray, O: np.ndarray, eps: float = 0.03, exact: int = 64) -> list[tuple[int, int, float]]:
    """Compress requests into classes: cells of (input, output) at most ``eps`` relative width
    (exact values up to ``exact``), each as (mean input, mean output, share of requests).

    Relative-width cells bound the error of any per-request latency that is
    smooth in the lengths (a few thousand classes reproduce P90 TPOT and
    E2E/token within ~0.5% on the bundled traces); equal-count cells do not
    (heavy tails put 10x ranges into one cell).
    """
    n = L.size
    cell = _log_bin(L, eps, exact) * (1 << 32) + _log_bin(O, eps, exact)
    _, inv, counts = np.unique(cell, return_inverse=True, return_counts=True)
    sl = np.bincount(inv, weights=L.astype(np.float64))
    so = np.bincount(inv, weights=O.astype(np.float64))
    li = np.rint(sl / counts).astype(np.int64)
    oi = np.rint(so / counts).astype(np.int64)
    sh = counts / n
    return list(zip(li.tolist(), oi.tolist(), sh.tolist()))


def representative_requests(L: np.ndarray, O: np.ndarray, n: int) -> list[tuple[int, int]]:
    """n real requests spread over the decode-context distribution (at its (i+0.5)/n quantiles)."""
    if L.size == 0 or n <= 0:
        return []
    m = L + O / 2.0
    order = np.argsort(m, kind="stable")
    ranks = np.minimum(((np.arange(n) + 0.5) / n * L.size).astype(int), L.size - 1)
    return [(int(L[order[r]]), int(O[order[r]])) for r in ranks]


def decode_steps_per_context(L: np.ndarray, O: np.ndarray) -> np.ndarray:
    """How many decode steps run at each KV length 0..max(L+O) (a difference array; no per-token loop)."""
    has = O >= 2
    top = int((L + O).max()) + 1 if L.size else 1
    diff = np.zeros(top + 1)
    np.add.at(diff, (L + 1)[has], 1.0)
    np.add.at(diff, (L + O)[has], -1.0)
    return np.cumsum(diff)[:top]


def _decode_grid(L: np.ndarray, O: np.ndarray, n: int) -> np.ndarray:
    """Grid over KV lengths at exact token-weighted quantiles (plus the smallest and largest context)."""
    hist = decode_steps_per_context(L, O)
    nz = np.nonzero(hist > 0.5)[0]
    if nz.size == 0:
        return np.array([], dtype=np.int64)
    return _quantile_grid(nz, hist[nz], n)


def decode_hat_weights(grid: np.ndarray, L: np.ndarray, O: np.ndarray) -> np.ndarray:
    """Hat weights of all decode steps (contexts L+1..L+O-1 per request), in closed form per grid segment.

    Each segment [g_k, g_k+1) receives the integer contexts of a request that
    fall in it; their count n and sum S give weight n - (S - n g_k)/Δ to g_k and
    the rest to g_k+1. Contexts beyond the grid go to its end points. Equal to
    ``hat_weights(grid, decode_contexts(L, O)[1])`` but O(requests x grid).
    """
    g = np.asarray(grid, dtype=np.float64)
    a = (L + 1).astype(np.float64)
    b = (L + O - 1).astype(np.float64)          # inclusive; empty when b < a
    out = np.zeros(g.size)

    def count_sum(lo, hi):  # integers in [lo, hi] (inclusive, lo/hi integral), elementwise
        n = np.maximum(hi - lo + 1, 0)
        return n, np.where(n > 0, (lo + hi) * n / 2.0, 0.0)

    n, _ = count_sum(a, np.minimum(b, g[0] - 1))
    out[0] += n.sum()
    n, _ = count_sum(np.maximum(a, g[-1] + (0 if g.size == 1 else 1)), b)
    out[-1] += n.sum()
    if g.size == 1:
        n, _ = count_sum(np.maximum(a, g[0]), np.minimum(b, g[0]))
        out[0] += n.sum()
        return out / max(out.sum(), 1e-300)
    for k in range(g.size - 1):
        hi_edge = g[k + 1] - 1 if k < g.size - 2 else g[k + 1]
        n, s = count_sum(np.maximum(a, g[k]), np.minimum(b, hi_edge))
        d = g[k + 1] - g[k]
        to_right = (s.sum() - n.sum() * g[k]) / d
        out[k + 1] += to_right
        out[k] += n.sum() - to_right
    return out / max(out.sum(), 1e-300)


def workload_from_trace(trace: Trace, *, max_context: int, batch_sizes=(1,), num_buckets: int = 12,
                        routing=None, objective: str = "p90_decode_tokens_per_s", on_overflow: str = "clip",
                        mix_eps: float = 0.03, num_representative: int = 8, seed: int = 0) -> Workload:
    """Weighted (phase, batch, context, new_tokens) buckets from a trace, for a model with ``max_context``.

    ``num_buckets`` grid points per phase and batch size (fewer when lengths
    repeat). Requests longer than ``max_context`` are clipped (see
    ``tkcc.traffic.requests``) and counted in ``meta['clipped']``, or refused
    with ``on_overflow="error"``. ``batch_sizes``: the operating batch sizes
    to measure; traffic is assumed to be served at each equally often
    (weights split evenly). ``routing`` defaults to the trace's own recorded
    routing, if any.
    """
    if len(trace) == 0:
        raise ValueError(f"{trace.source or 'trace'}: no requests to build a workload from")
    batch_sizes = tuple(sorted({int(b) for b in batch_sizes}))
    if not batch_sizes or batch_sizes[0] < 1:
        raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes}")
    req = clip_requests(trace.input_tokens, trace.output_tokens, max_context, on_overflow, trace.source)
    L, O = req.input_tokens, req.output_tokens
    rng = np.random.default_rng(seed)
    sub = rng.choice(L.size, _GRID_SAMPLE, replace=False) if L.size > _GRID_SAMPLE else np.arange(L.size)
    Ls, Os = L[sub], O[sub]
    # grids
    pgrid = _quantile_grid(L, None, num_buckets)
    dgrid = _decode_grid(L, O, num_buckets)
    pw = hat_weights(pgrid, L)
    dw = decode_hat_weights(dgrid, L, O) if dgrid.size else np.zeros(0)
    p_new = _nearest_median(pgrid, Ls, Os)
    d_new = _nearest_median(dgrid, Ls + Os / 2.0, Os) if dgrid.size else np.array([], dtype=np.int64)
    share = 1.0 / len(batch_sizes)
    buckets = []
    for b in batch_sizes:
        buckets += [Bucket("prefill", b, int(c), int(n), float(w * share)) for c, n, w in zip(pgrid, p_new, pw)]
        buckets += [Bucket("decode", b, int(c), int(n), float(w * share)) for c, n, w in zip(dgrid, d_new, dw)]
    routing = routing if routing is not None else trace.routing
    meta = {
        "requests": len(trace), "skipped": trace.skipped, "max_context": max_context, "clipped": req.clipped,
        "clipped_input": req.clipped_input, "clipped_fraction": req.clipped / len(trace),
        "batch_sizes": list(batch_sizes), "decode_steps": int(np.maximum(O - 1, 0).sum()),
        "trace_format": trace.format, "num_buckets": num_buckets, "seed": seed,
    }
    return Workload(buckets=buckets, objective=objective, routing=routing,
                    representative=representative_requests(L, O, num_representative), source=trace.source,
                    meta=meta, mix=request_mix(L, O, mix_eps))
