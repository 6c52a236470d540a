"""Percentiles the way the traces README computes them, so our numbers can be checked against it.

Nearest rank: P_q is the sorted value at 1-based rank ceil(q*n). For weighted
samples (ServeGen length PDFs, bucket mixes) P_q is the smallest value whose
cumulative weight reaches q. Interpolating percentiles would disagree with the
published tables by a token or two and hide real mistakes.
"""
from __future__ import annotations

import math

import numpy as np

QUANTILES = (0.5, 0.9, 0.99)


def nearest_rank(values, q: float) -> float:
    """P_q by nearest rank; ``values`` need not be sorted. NaN for an empty input."""
    v = np.asarray(values)
    n = v.shape[0]
    if n == 0:
        return float("nan")
    k = max(1, math.ceil(q * n - 1e-9))
    return float(np.partition(v, k - 1)[k - 1])


def weighted_nearest_rank(values, weights, q: float) -> float:
    """Smallest value whose cumulative (normalised) weight reaches q."""
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if v.size == 0 or w.sum() <= 0:
        return float("nan")
    order = np.argsort(v, kind="stable")
    cw = np.cumsum(w[order])
    cw /= cw[-1]
    i = int(np.searchsorted(cw, q - 1e-12, side="left"))
    return float(v[order][min(i, v.size - 1)])


def summary(values, weights=None, quantiles=QUANTILES) -> dict:
    """count, mean, min, max and p50/p90/p99 of one length column."""
    v = np.asarray(values)
    if v.size == 0:
        return {"count": 0, "mean": None, "min": None, "max": None, **{f"p{_qname(q)}": None for q in quantiles}}
    if weights is None:
        out = {"count": int(v.size), "mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}
        out.update({f"p{_qname(q)}": nearest_rank(v, q) for q in quantiles})
    else:
        w = np.asarray(weights, dtype=np.float64)
        out = {"count": float(w.sum()), "mean": float((v * w).sum() / w.sum()), "min": float(v[w > 0].min()),
               "max": float(v[w > 0].max())}
        out.update({f"p{_qname(q)}": weighted_nearest_rank(v, w, q) for q in quantiles})
    return out


def _qname(q: float) -> str:
    s = f"{q * 100:g}"
    return s.replace(".", "_")


def trace_stats(trace) -> dict:
    """Counts, span, rate and length percentiles of a Trace (what `tkcc trace stats` prints)."""
    n = len(trace)
    span = trace.duration_s() if trace.has_timestamps else None
    return {
        "source": trace.source,
        "format": trace.format,
        "requests": n,
        "skipped": trace.skipped,
        "start_time": trace.start_time,
        "span_s": span,
        "req_per_s": (n / span) if span else None,
        "input": summary(trace.input_tokens),
        "output": summary(trace.output_tokens),
        "meta": {k: v for k, v in trace.meta.items() if k != "skipped_lines"},
        "skipped_lines": trace.meta.get("skipped_lines", []),
    }


def weighted_quantiles(values, weights, qs) -> list[float]:
    """Several weighted nearest-rank quantiles with one sort (large ITL arrays)."""
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if v.size == 0 or w.sum() <= 0:
        return [float("nan")] * len(qs)
    order = np.argsort(v, kind="stable")
    cw = np.cumsum(w[order])
    cw /= cw[-1]
    idx = np.minimum(np.searchsorted(cw, np.asarray(qs) - 1e-12, side="left"), v.size - 1)
    return [float(x) for x in v[order][idx]]
