"""ServeGen client traces: per-window rates and length PDFs -> sampled requests.

ServeGen (Xiang et al., arXiv:2505.09999) publishes, per anonymised client,
``chunk-N-trace.csv`` (one row per 600 s window: start, rate req/s, CV of
inter-arrival times, pattern Gamma|Weibull|empty, shape, scale) and
``chunk-N-dataset.json`` (per 6 h window, length PDFs as Python dict
literals, parsed with ``ast.literal_eval``; never ``eval``).

Sampling, per 600 s window with rate r > 0: inter-arrival gaps are drawn
from the window's distribution (numpy ``gamma(shape, scale)`` or
``scale * weibull(shape)``; exponential when the pattern is empty) and
rescaled so their mean is 1/r, as ServeGen does; arrivals start at a
uniform point of a size-biased gap (the stationary renewal process, exact for both laws) and stop at the window end, so the count
per window has mean ≈ r·600 and the published burstiness. Each request's
input and output lengths are drawn independently from the 6 h window's
PDFs (the published data has no joint distribution). ``arrival_s`` is
seconds since ServeGen's t=0 (00:00 of day 0), so day windows line up.

Large clients (the biggest publish ~10^9 requests over 14 days) are thinned:
if the expected total exceeds ``max_requests`` every rate is multiplied by
``max_requests / expected`` (recorded as ``meta['rate_scale']``). Thinning
keeps the relative rate over time, the burstiness and the length
distributions; only absolute volume changes.
"""
from __future__ import annotations

import ast
import csv
import json
import math
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from tkcc.errors import TraceFormatError
from tkcc.traffic.textio import open_text
from tkcc.traffic.trace import Trace

MAX_DATASET_BYTES = 256 << 20  # a ServeGen dataset.json (length distributions per window) is a few MB

WINDOW_S = 600
PDF_WINDOW_S = 21600


def client_files(path) -> tuple[Path, Path]:
    """(trace.csv, dataset.json) for a path naming either file, or their common prefix."""
    p = str(path)
    for suffix in ("-trace.csv", "-dataset.json"):
        if p.endswith(suffix):
            p = p[: -len(suffix)]
            break
    tr, ds = Path(p + "-trace.csv"), Path(p + "-dataset.json")
    for f in (tr, ds):
        if not f.exists():
            raise TraceFormatError(f"ServeGen client needs both {tr.name} and {ds.name}; {f.name} is missing",
                                   path=str(f))
    return tr, ds


def read_rate_table(path) -> np.ndarray:
    """trace.csv -> structured rows (start, rate, cv, pattern code, shape, scale); pattern 0 none, 1 Gamma, 2 Weibull."""
    rows = []
    codes = {"": 0, "gamma": 1, "weibull": 2}
    with open_text(path) as f:
        for ln, row in enumerate(csv.reader(f), start=1):
            if not row or not "".join(row).strip():
                continue
            if len(row) < 6:
                raise TraceFormatError(f"expected 6 fields (start, rate, cv, pattern, shape, scale), got {len(row)}",
                                       path=str(path), line=ln)
            vals = []
            for name, x in zip(("window_start_s", "rate", "cv"), row[:3]):
                vals.append(_num(x, path, ln, name))
            pat = row[3].strip().lower()
            if pat not in codes:
                raise TraceFormatError(f"unknown arrival pattern {row[3]!r} (Gamma, Weibull or empty)",
                                       path=str(path), line=ln, field="pattern")
            shape, scale = _num(row[4], path, ln, "shape"), _num(row[5], path, ln, "scale")
            if vals[1] < 0:
                raise TraceFormatError(f"negative rate {vals[1]}", path=str(path), line=ln, field="rate")
            if vals[1] > 0 and pat and (shape <= 0 or scale <= 0):
                raise TraceFormatError(f"pattern {row[3]} needs shape > 0 and scale > 0, got {shape}, {scale}",
                                       path=str(path), line=ln, field="shape")
            if rows and vals[0] <= rows[-1][0]:
                raise TraceFormatError(f"window start {vals[0]} does not increase (previous {rows[-1][0]})",
                                       path=str(path), line=ln, field="window_start_s")
            rows.append((vals[0], vals[1], vals[2], codes[pat], shape, scale))
    if not rows:
        raise TraceFormatError("file has no rows", path=str(path), line=1)
    return np.array(rows, dtype=np.float64)


def _num(x: str, path, ln: int, field: str) -> float:
    try:
        v = float(x)
    except ValueError:
        raise TraceFormatError(f"not a number: {x!r}", path=str(path), line=ln, field=field) from None
    if not math.isfinite(v):
        raise TraceFormatError(f"not finite: {x!r}", path=str(path), line=ln, field=field)
    return v


def read_pdfs(path, input_field: str | None = None) -> dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """dataset.json -> {window_start: {'input': (values, probs), 'output': (values, probs)}}; empty windows omitted.

    ``input_field`` defaults to ``input_tokens`` (language, reasoning) or ``text_tokens`` (multimodal).
    """
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    if size > MAX_DATASET_BYTES:
        raise TraceFormatError(f"{size} bytes is more than a ServeGen dataset holds (limit {MAX_DATASET_BYTES})",
                               path=str(path))
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_DATASET_BYTES + 1).decode("utf-8"))
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"invalid JSON: {e.msg}", path=str(path), line=e.lineno) from None
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"not UTF-8 text: byte at offset {e.start} ({e.reason})", path=str(path)) from None
    if not isinstance(data, dict):
        raise TraceFormatError("expected an object keyed by window start", path=str(path), line=1)
    out = {}
    for key, fields in data.items():
        try:
            start = int(float(key))
        except ValueError:
            raise TraceFormatError(f"window key {key!r} is not a number", path=str(path), field=key) from None
        if not isinstance(fields, dict):
            raise TraceFormatError("window entry is not an object", path=str(path), field=key)
        inf = input_field or ("input_tokens" if "input_tokens" in fields else "text_tokens")
        pdfs = {}
        for role, name in (("input", inf), ("output", "output_tokens")):
            if name not in fields:
                raise TraceFormatError(f"window {key} has no {name!r} (has {sorted(fields)})", path=str(path),
                                       field=f"{key}.{name}")
            pdfs[role] = _parse_pdf(fields[name], path, f"{key}.{name}")
        if pdfs["input"] is None and pdfs["output"] is None:
            continue
        if pdfs["input"] is None or pdfs["output"] is None:
            raise TraceFormatError("one length PDF is empty and the other is not", path=str(path), field=key)
        out[start] = pdfs
    return out


def _fast_pdf(text: str):
    """'{81: 0.002, 96: 0.004}' -> (values, probs) by splitting; None when the text is anything else."""
    t = text.strip()
    if not (t.startswith("{") and t.endswith("}")):
        return None
    inner = t[1:-1].strip()
    if not inner:
        return np.empty(0), np.empty(0)
    if inner.count(":") != inner.count(",") + 1:
        return None
    try:
        flat = np.array(inner.replace(":", ",").split(","), dtype=np.float64)
    except ValueError:
        return None
    return flat[0::2], flat[1::2]


def _parse_pdf(text, path, field: str):
    fast = _fast_pdf(text) if isinstance(text, str) else None
    if fast is not None:
        vals, probs = fast
        if vals.size == 0:
            return None
        return _check_pdf(vals, probs, path, field)
    try:
        d = ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError) as e:
        raise TraceFormatError(f"not a Python dict literal: {e}", path=str(path), field=field) from None
    if not isinstance(d, dict):
        raise TraceFormatError("expected a {length: probability} dict", path=str(path), field=field)
    if not d:
        return None
    try:
        vals = np.array([float(k) for k in d.keys()])
        probs = np.array([float(p) for p in d.values()])
    except (TypeError, ValueError):
        raise TraceFormatError("lengths and probabilities must be numbers", path=str(path), field=field) from None
    return _check_pdf(vals, probs, path, field)


def _check_pdf(vals, probs, path, field):
    if not (np.isfinite(vals).all() and np.isfinite(probs).all()) or (vals < 0).any() or (probs < 0).any() \
            or probs.sum() <= 0:
        raise TraceFormatError("lengths and probabilities must be non-negative with positive total",
                               path=str(path), field=field)
    order = np.argsort(vals)
    vals, probs = vals[order], probs[order]
    return np.round(vals).astype(np.int64), probs / probs.sum()


def expected_requests(rates: np.ndarray) -> float:
    return float((rates[:, 1] * WINDOW_S).sum())


def _gaps(rng: np.random.Generator, code: int, shape: float, scale: float, m: int, mean_gap: float) -> np.ndarray:
    if code == 1:
        g, dist_mean = rng.gamma(shape, scale, m), shape * scale
    elif code == 2:
        g, dist_mean = scale * rng.weibull(shape, m), scale * math.gamma(1.0 + 1.0 / shape)
    else:
        g, dist_mean = rng.exponential(1.0, m), 1.0
    return g * (mean_gap / dist_mean)


def _size_biased_gap(rng, code: int, shape: float, scale: float, mean_gap: float) -> float:
    if code == 1:
        return float(rng.gamma(shape + 1.0, scale)) * mean_gap / (shape * scale)
    if code == 2:
        g = scale * float(rng.gamma(1.0 + 1.0 / shape)) ** (1.0 / shape)
        return g * mean_gap / (scale * math.gamma(1.0 + 1.0 / shape))
    return float(rng.gamma(2.0)) * mean_gap


def sample_window_arrivals(rng, start: float, rate: float, code: int, shape: float, scale: float,
                           length: float = WINDOW_S) -> np.ndarray:
    """Arrival times in [start, start+length) of a renewal process with the window's gap law and mean rate."""
    if rate <= 0:
        return np.empty(0)
    mean_gap = 1.0 / rate
    expect = rate * length
    m = int(expect * 1.5 + 10 * math.sqrt(expect) + 20)
    gaps = _gaps(rng, code, shape, scale, m, mean_gap)
    # stationary start: the window opens inside a gap drawn from the size-biased law (exact:
    # Gamma(k) -> Gamma(k+1); Weibull(c) -> scale * Gamma(1+1/c)^(1/c)), at a uniform point of it.
    # Starting on an arrival would add about (cv^2+1)/2 arrivals per window: +17% on thinned bursty clients.
    gaps[0] = rng.random() * _size_biased_gap(rng, code, shape, scale, mean_gap)
    t = np.cumsum(gaps)
    while t[-1] < length:  # heavy-tailed gaps can need more draws
        more = np.cumsum(_gaps(rng, code, shape, scale, m, mean_gap)) + t[-1]
        t = np.concatenate([t, more])
    return start + t[t < length]


def sample_lengths(rng, pdf: tuple[np.ndarray, np.ndarray], n: int) -> np.ndarray:
    vals, probs = pdf
    cdf = np.cumsum(probs)
    idx = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
    return vals[np.minimum(idx, vals.size - 1)]


def iter_servegen(path, skip_bad: bool = False, chunk_rows: int = 200_000, seed: int = 0,
                  max_requests: int | None = 1_000_000, start_s: float | None = None, end_s: float | None = None,
                  input_field: str | None = None) -> Iterator[Trace]:
    """Sample one ServeGen client; yields one Trace per group of windows (streaming).

    The whole file is validated before the first request is yielded (a bad
    row is an error even under ``skip_bad``: rows are windows, and skipping
    one would silently drop 10 minutes of traffic).
    """
    tr_path, ds_path = client_files(path)
    rates = read_rate_table(tr_path)
    pdfs = read_pdfs(ds_path, input_field)
    sel = np.ones(len(rates), dtype=bool)
    if start_s is not None:
        sel &= rates[:, 0] >= start_s
    if end_s is not None:
        sel &= rates[:, 0] < end_s
    rates = rates[sel]
    for row in rates:
        if row[1] > 0 and int(row[0]) // PDF_WINDOW_S * PDF_WINDOW_S not in pdfs:
            raise TraceFormatError(f"window {int(row[0])} has rate {row[1]} but the 6 h window "
                                   f"{int(row[0]) // PDF_WINDOW_S * PDF_WINDOW_S} has no length PDF",
                                   path=str(ds_path), field=str(int(row[0]) // PDF_WINDOW_S * PDF_WINDOW_S))
    expect = expected_requests(rates)
    if expect <= 0:
        raise TraceFormatError("client has no traffic (all rates are 0)", path=str(tr_path))
    scale = 1.0 if not max_requests or expect <= max_requests else max_requests / expect
    rng = np.random.default_rng(seed)
    meta = {"rate_scale": scale, "expected_requests": expect, "seed": seed, "dataset": str(ds_path),
            "origin": "ServeGen t=0 (00:00 day 0)", "input_field": input_field or "input_tokens|text_tokens"}
    ts, ins, outs, n = [], [], [], 0
    for start, rate, _cv, code, shp, scl in rates:
        t = sample_window_arrivals(rng, start, rate * scale, int(code), shp, scl)
        if t.size:
            pdf = pdfs[int(start) // PDF_WINDOW_S * PDF_WINDOW_S]
            ts.append(t)
            ins.append(sample_lengths(rng, pdf["input"], t.size))
            outs.append(sample_lengths(rng, pdf["output"], t.size))
            n += t.size
        if n >= chunk_rows:
            yield _chunk(ts, ins, outs, tr_path, meta)
            ts, ins, outs, n = [], [], [], 0
    if ts:
        yield _chunk(ts, ins, outs, tr_path, meta)


def _chunk(ts, ins, outs, tr_path, meta) -> Trace:
    return Trace(arrival_s=np.concatenate(ts), input_tokens=np.concatenate(ins), output_tokens=np.concatenate(outs),
                 source=str(tr_path), format="servegen", meta=dict(meta))


def window_stats_from_pdfs(path, window_s: float = 86400) -> list[dict]:
    """Exact request-weighted length percentiles per window from the published PDFs (no sampling).

    Each 600 s row contributes rate·600 requests with its 6 h window's PDF;
    this is the README's method, used to check the sampler.
    """
    from tkcc.traffic.stats import weighted_nearest_rank

    tr_path, ds_path = client_files(path)
    rates, pdfs = read_rate_table(tr_path), read_pdfs(ds_path)
    out = []
    wins = (rates[:, 0] // window_s).astype(np.int64)
    for w in np.unique(wins):
        rows = rates[wins == w]
        mass: dict[int, float] = {}
        for r in rows:
            if r[1] > 0:
                k = int(r[0]) // PDF_WINDOW_S * PDF_WINDOW_S
                mass[k] = mass.get(k, 0.0) + r[1] * WINDOW_S
        if not mass:
            continue
        res = {"start_s": float(w * window_s), "est_requests": sum(mass.values())}
        for role in ("input", "output"):
            v = np.concatenate([pdfs[k][role][0] for k in mass])
            p = np.concatenate([pdfs[k][role][1] * m for k, m in mass.items()])
            res[role] = {f"p{int(q * 100)}": weighted_nearest_rank(v, p, q) for q in (0.5, 0.9, 0.99)}
        out.append(res)
    return out


def is_servegen_path(path) -> bool:
    p = str(path)
    if p.endswith("-trace.csv"):
        return os.path.exists(p[: -len("-trace.csv")] + "-dataset.json")
    if p.endswith("-dataset.json"):
        return os.path.exists(p[: -len("-dataset.json")] + "-trace.csv")
    return os.path.exists(p + "-trace.csv") and os.path.exists(p + "-dataset.json")
