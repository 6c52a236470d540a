"""Ratios with their intervals, so that a speed-up within noise says so (DESIGN.md invariant 4).

Two sources of an interval, both from samples tkcc has:

* **timing samples** (``ratio_interval``, ``geomean_interval``): a percentile
  bootstrap of the ratio of medians, resampling each side's samples (and, for
  a weighted geomean, every bucket's at once). Deterministic (fixed seed), so
  the same samples always print the same interval.
* **A/A pairs** (``gain_interval``): the spread of the relative difference
  between two measurements of one candidate is what separates two
  measurements taken minutes apart in one engine; a gain's interval is the
  gain +- z x that spread.

A ratio is *within noise* when its interval spans 1 (no change).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

CONFIDENCE = 0.95
_BOOT = 2000
_Z95 = 1.959964


@dataclass(frozen=True)
class Ratio:
    """A ratio (new over old: a speed-up when > 1) and its interval at ``confidence``."""

    value: float
    low: float
    high: float
    confidence: float = CONFIDENCE
    source: str = ""  # what the interval is from, e.g. "bootstrap of 30+30 samples"

    @property
    def known(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    @property
    def within_noise(self) -> bool:
        """True when the interval spans 1, or when there is no interval at all (nothing can be said)."""
        return not self.known or self.low <= 1.0 <= self.high

    def label(self) -> str:
        if not self.known:
            return "noise not measured"
        return "within noise" if self.within_noise else ("faster" if self.value > 1 else "slower")

    def text(self, style: str = "x") -> str:
        """``x1.08 [0.97, 1.21] within noise`` (style "x") or ``+8.0% [-3.0%, +21.0%] within noise`` ("%")."""
        if style == "%":
            head = f"{(self.value - 1) * 100:+.1f}%"
            rng = f"[{(self.low - 1) * 100:+.1f}%, {(self.high - 1) * 100:+.1f}%]" if self.known else "[interval unknown]"
        else:
            head = f"x{self.value:.2f}"
            rng = f"[{self.low:.2f}, {self.high:.2f}]" if self.known else "[interval unknown]"
        return f"{head} {rng}" + (" within noise" if self.within_noise else "")

    def to_json(self) -> dict:
        d = asdict(self)
        d["within_noise"] = self.within_noise
        d["label"] = self.label()
        for k in ("low", "high"):
            if not math.isfinite(d[k]):
                d[k] = None
        return d


def _boot_medians(x: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    idx = rng.integers(0, x.size, size=(n, x.size))
    return np.median(x[idx], axis=1)


def ratio_interval(old_samples, new_samples, *, confidence: float = CONFIDENCE, seed: int = 0) -> Ratio:
    """Speed-up ``median(old) / median(new)`` of two sets of times, with its bootstrap interval."""
    old = np.asarray(old_samples, dtype=np.float64)
    new = np.asarray(new_samples, dtype=np.float64)
    if old.size == 0 or new.size == 0:
        raise ValueError("ratio_interval needs at least one sample on each side")
    value = float(np.median(old) / np.median(new))
    src = f"bootstrap of {old.size}+{new.size} samples"
    if old.size < 2 or new.size < 2:
        return Ratio(value, -math.inf, math.inf, confidence, src + " (too few for an interval)")
    rng = np.random.default_rng(seed)
    r = _boot_medians(old, rng, _BOOT) / _boot_medians(new, rng, _BOOT)
    a = (1 - confidence) / 2
    return Ratio(value, float(np.quantile(r, a)), float(np.quantile(r, 1 - a)), confidence, src)


def geomean_interval(rows, *, confidence: float = CONFIDENCE, seed: int = 0) -> Ratio:
    """Weighted geometric mean of per-bucket speed-ups; ``rows`` = [(weight, old_samples, new_samples)].

    The interval resamples every bucket's samples together, so it carries each bucket's noise."""
    rows = [(float(w), np.asarray(o, np.float64), np.asarray(n, np.float64)) for w, o, n in rows]
    rows = [r for r in rows if r[0] > 0 and r[1].size and r[2].size]
    if not rows:
        raise ValueError("geomean_interval needs at least one bucket with samples")
    wsum = sum(w for w, _, _ in rows)
    value = math.exp(sum(w * math.log(np.median(o) / np.median(n)) for w, o, n in rows) / wsum)
    total = sum(o.size + n.size for _, o, n in rows)
    src = f"bootstrap of {total} samples over {len(rows)} buckets"
    if any(o.size < 2 or n.size < 2 for _, o, n in rows):
        return Ratio(value, -math.inf, math.inf, confidence, src + " (a bucket has too few for an interval)")
    rng = np.random.default_rng(seed)
    logs = np.zeros(_BOOT)
    for w, o, n in rows:
        logs += w * np.log(_boot_medians(o, rng, _BOOT) / _boot_medians(n, rng, _BOOT))
    g = np.exp(logs / wsum)
    a = (1 - confidence) / 2
    return Ratio(value, float(np.quantile(g, a)), float(np.quantile(g, 1 - a)), confidence, src)


def gain_interval(new: float, old: float, aa_sd: float, pairs: int, *, confidence: float = CONFIDENCE) -> Ratio:
    """``new / old`` of two objectives (higher is better), +- z x the A/A spread of relative differences."""
    value = new / old
    if not math.isfinite(aa_sd) or pairs < 2:
        return Ratio(value, -math.inf, math.inf, confidence, f"A/A spread unknown ({pairs} pair(s))")
    z = _Z95 if confidence == CONFIDENCE else _z(confidence)
    return Ratio(value, value - z * aa_sd, value + z * aa_sd, confidence,
                 f"A/A spread {aa_sd * 100:.2f}% over {pairs} pairs")


def _z(confidence: float) -> float:
    """Two-sided normal quantile by bisection on erf (no scipy)."""
    lo, hi, target = 0.0, 10.0, confidence
    for _ in range(80):
        mid = (lo + hi) / 2
        if math.erf(mid / math.sqrt(2)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
