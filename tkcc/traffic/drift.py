"""Has traffic moved enough that the shipped candidate was optimised for the wrong requests?

Traffic is cut into fixed windows (``--window 10m|6h|1d``) counted from the
trace's origin. Each window with at least ``min_requests`` requests is
compared with a *reference* window: the first such window, replaced by every
window that triggers a re-optimisation (that is what a continual compiler
would then be tuned for).

The statistic, per length field (input, output):
  1. two-sample Kolmogorov–Smirnov test of the window against the reference:
     is the distribution different at all? Significant when p < ``alpha``
     (default 1e-3; asymptotic Kolmogorov distribution with Stephens'
     small-sample correction).
  2. effect size: the ratio of P50 and of P90 (window / reference); it counts
     when it is >= ``ratio`` (default 1.5) or <= 1/``ratio`` and the
     percentile moved by at least ``min_tokens`` (default 32) tokens, so
     2 -> 3 output tokens is not drift.
A window *drifted* when, for input or output, both hold. KS alone fires on
every large window of real traffic (the stable Azure code trace has KS
p = 0.002 between its first two windows); a percentile ratio alone fires on
small windows by chance. Direction and magnitude are those of the largest
qualifying ratio. Re-optimisation is *warranted* when a window drifted and
holds at least ``min_reopt_requests`` requests (default 500), enough to build
a workload from; the reference then moves to that window.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from dataclasses import field as _field

import numpy as np

from tkcc.errors import TkccError
from tkcc.traffic.stats import nearest_rank
from tkcc.traffic.trace import Trace

_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(text, what: str = "window") -> float:
    """'10m', '6h', '1d', '90s' or plain seconds -> seconds (> 0); errors name ``what`` (e.g. "--budget")."""
    if isinstance(text, (int, float)):
        sec = float(text)
    else:
        m = re.fullmatch(r"\s*([-+]?)([0-9]*\.?[0-9]+)\s*(s|m|min|h|d)?\s*", str(text))
        if not m:
            raise TkccError(f"bad {what} {text!r}: use a number with s, m, h or d (e.g. 90s, 10m, 6h, 1d)")
        sec = float(m.group(2)) * _UNITS[m.group(3) or "s"] * (-1 if m.group(1) == "-" else 1)
    if not sec > 0:
        raise TkccError(f"{what} must be a positive duration, got {text!r}")
    return sec


def parse_window(text) -> float:
    """'10m', '6h', '1d', '90s' or plain seconds -> seconds."""
    return parse_duration(text, "window")


def ks_2samp(a, b) -> tuple[float, float]:
    """Two-sample KS statistic D and asymptotic p-value (no scipy needed)."""
    a, b = np.sort(np.asarray(a, dtype=np.float64)), np.sort(np.asarray(b, dtype=np.float64))
    n, m = a.size, b.size
    if n == 0 or m == 0:
        return float("nan"), float("nan")
    allv = np.concatenate([a, b])
    d = float(np.abs(np.searchsorted(a, allv, side="right") / n - np.searchsorted(b, allv, side="right") / m).max())
    ne = n * m / (n + m)
    lam = (math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d
    return d, _kolmogorov_q(lam)


def _kolmogorov_q(lam: float) -> float:
    """P(K > lam) for the Kolmogorov distribution."""
    if lam < 0.2:
        return 1.0
    s = 0.0
    for k in range(1, 101):
        term = 2.0 * (-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam)
        s += term
        if abs(term) < 1e-16:
            break
    return float(min(max(s, 0.0), 1.0))


@dataclass
class WindowStats:
    index: int
    start_s: float
    end_s: float
    requests: int
    input: dict
    output: dict
    label: str = ""


@dataclass
class DriftWindow(WindowStats):
    reference: int | None = None
    ks: dict = _field(default_factory=dict)       # field -> {"D": ..., "p": ...}
    ratios: dict = _field(default_factory=dict)   # "input_p50" -> window/reference
    drift: bool = False
    field: str | None = None
    direction: str | None = None                 # "up" | "down"
    magnitude: float | None = None               # >= 1: how many times larger/smaller
    shifts: dict = _field(default_factory=dict)   # every qualifying shift: "input_p90" -> ratio
    reoptimize: bool = False
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DriftReport:
    source: str
    window_s: float
    params: dict
    windows: list[DriftWindow]

    @property
    def drifted(self) -> list[DriftWindow]:
        return [w for w in self.windows if w.drift]

    def to_dict(self) -> dict:
        return {"source": self.source, "window_s": self.window_s, "params": self.params,
                "windows": [w.to_dict() for w in self.windows],
                "drift_windows": [w.index for w in self.drifted],
                "reoptimize_windows": [w.index for w in self.windows if w.reoptimize]}


def window_label(start_s: float, end_s: float, window_s: float) -> str:
    """'day 3' for day windows, 'd2 06:00' for hour windows, '20-30 min' below an hour."""
    if window_s >= 86400 and window_s % 86400 == 0:
        d = start_s / 86400
        return f"day {d:g}" if window_s == 86400 else f"days {d:g}-{end_s / 86400:g}"
    if window_s >= 3600:
        d, rem = divmod(start_s, 86400)
        return f"d{int(d)} {int(rem // 3600):02d}:{int(rem % 3600 // 60):02d}"
    return f"{start_s / 60:g}-{end_s / 60:.0f} min"


def _lengths(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {"p50": nearest_rank(x, 0.5), "p90": nearest_rank(x, 0.9), "p99": nearest_rank(x, 0.99),
            "mean": float(x.mean())}


def windowed(trace: Trace, window_s: float) -> list[tuple[WindowStats, slice]]:
    """Fixed windows from arrival 0 (the trace origin) to the last request; empty windows included."""
    if not trace.has_timestamps:
        raise TkccError(f"{trace.source or 'trace'} ({trace.format}) has no timestamps: it cannot be cut into windows")
    if len(trace) == 0:
        return []
    t = trace.arrival_s
    origin = min(0.0, float(t[0]))
    nwin = int(math.floor((float(t[-1]) - origin) / window_s)) + 1
    edges = origin + window_s * np.arange(nwin + 1)
    idx = np.searchsorted(t, edges, side="left")
    idx[-1] = len(trace)
    out = []
    for k in range(nwin):
        sl = slice(int(idx[k]), int(idx[k + 1]))
        end = float(edges[k + 1]) if k < nwin - 1 else max(float(t[-1]), float(edges[k]))
        ws = WindowStats(k, float(edges[k]), end, sl.stop - sl.start, _lengths(trace.input_tokens[sl]),
                         _lengths(trace.output_tokens[sl]), window_label(float(edges[k]), end, window_s))
        out.append((ws, sl))
    return out


def detect_drift(trace: Trace, window="10m", *, alpha: float = 1e-3, ratio: float = 1.5, min_tokens: int = 32,
                 min_requests: int = 100, min_reopt_requests: int = 500) -> DriftReport:
    """Cut ``trace`` into windows and flag those whose length distribution moved (see module doc)."""
    window_s = parse_window(window)
    if ratio <= 1:
        raise TkccError(f"ratio must be > 1, got {ratio}")
    params = {"alpha": alpha, "ratio": ratio, "min_tokens": min_tokens, "min_requests": min_requests,
              "min_reopt_requests": min_reopt_requests,
              "statistic": "KS p < alpha AND P50 or P90 ratio beyond ratio (and >= min_tokens apart), "
                           "input or output; reference = first window, moved on each re-optimisation"}
    ref = None  # (index, input array, output array, stats)
    out = []
    for ws, sl in windowed(trace, window_s):
        dw = DriftWindow(**asdict(ws))
        if ws.requests < min_requests:
            dw.note = "empty" if ws.requests == 0 else f"too few requests (< {min_requests})"
            out.append(dw)
            continue
        xin, xout = trace.input_tokens[sl], trace.output_tokens[sl]
        if ref is None:
            ref = (ws.index, xin, xout, ws)
            dw.note = "reference"
            out.append(dw)
            continue
        _compare(dw, ref, xin, xout, alpha, ratio, min_tokens)
        if dw.drift and ws.requests >= min_reopt_requests:
            dw.reoptimize = True
            ref = (ws.index, xin, xout, ws)
        elif dw.drift:
            dw.note = f"drift, but too few requests to re-optimise on (< {min_reopt_requests})"
        out.append(dw)
    return DriftReport(trace.source, window_s, params, out)


def compare_windows(reference: Trace, current: Trace, *, alpha: float = 1e-3, ratio: float = 1.5,
                    min_tokens: int = 32, min_reopt_requests: int = 500) -> DriftWindow:
    """The detector's verdict on one current window against one reference (for a live follower)."""
    t = current.arrival_s
    dw = DriftWindow(0, float(t[0]) if len(t) else 0.0, float(t[-1]) if len(t) else 0.0, len(current),
                     _lengths(current.input_tokens), _lengths(current.output_tokens), "current")
    if len(reference) == 0 or len(current) == 0:
        dw.note = "empty"
        return dw
    rs = WindowStats(-1, 0, 0, len(reference), _lengths(reference.input_tokens), _lengths(reference.output_tokens),
                     "reference")
    _compare(dw, (-1, reference.input_tokens, reference.output_tokens, rs), current.input_tokens,
             current.output_tokens, alpha, ratio, min_tokens)
    dw.reoptimize = dw.drift and len(current) >= min_reopt_requests
    return dw


def _compare(dw: DriftWindow, ref, xin, xout, alpha, ratio, min_tokens) -> None:
    ridx, rin, rout, rstats = ref
    dw.reference = ridx
    best = None  # (|log r|, field, r)
    for name, x, rx, cur, old in (("input", xin, rin, dw.input, rstats.input),
                                  ("output", xout, rout, dw.output, rstats.output)):
        d, p = ks_2samp(rx, x)
        dw.ks[name] = {"D": d, "p": p}
        for q in ("p50", "p90"):
            a, b = old[q], cur[q]
            r = (b / a) if a else (math.inf if b else 1.0)
            dw.ratios[f"{name}_{q}"] = r
            big = (r >= ratio or r <= 1 / ratio) and abs(b - a) >= min_tokens
            if p < alpha and big:
                dw.shifts[f"{name}_{q}"] = r
                score = abs(math.log(r)) if 0 < r < math.inf else math.inf
                if best is None or score > best[0]:
                    best = (score, f"{name}_{q}", r)
    if best is not None:
        dw.drift = True
        dw.field = best[1]
        dw.direction = "up" if best[2] > 1 else "down"
        dw.magnitude = best[2] if best[2] >= 1 else (1 / best[2] if best[2] > 0 else math.inf)
