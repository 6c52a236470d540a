"""The ship rule: a candidate ships only when its gain beats the measured noise.

The noise is measured, not assumed: A/A runs measure the same candidate twice
in the same engine and record the relative difference of the two objectives.
Rule: ship B over the current A when ``obj_B / obj_A - 1 > threshold``, where
``threshold = max(floor, z * sd)`` and ``sd`` is the standard deviation of the
A/A relative differences. With z = 3 a normally distributed A/A difference
exceeds the threshold about 0.13% of the time (one-sided), under the 1%
false-ship budget even when the noise is somewhat heavier-tailed than normal;
the floor keeps a lucky quiet A/A sample from shrinking the bar to nothing.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from tkcc.errors import TkccError

DEFAULT_Z = 3.0
DEFAULT_FLOOR = 0.01  # 1% — below this a win is not worth a swap on any machine we have measured
MIN_AA_SAMPLES = 3


def check_aa_pairs(n: int) -> int:
    """``--aa-pairs``: fewer A/A pairs than the noise model needs would mean nothing can ever ship."""
    if not isinstance(n, int) or isinstance(n, bool) or n < MIN_AA_SAMPLES:
        raise TkccError(f"--aa-pairs {n}: the ship rule needs at least {MIN_AA_SAMPLES} A/A pairs to measure the "
                        f"noise (with fewer, no candidate could ever ship); pass --aa-pairs {MIN_AA_SAMPLES} or more")
    return n


@dataclass
class NoiseModel:
    aa_diffs: list[float] = field(default_factory=list)  # relative differences b/a - 1 of A/A pairs
    z: float = DEFAULT_Z
    floor: float = DEFAULT_FLOOR
    min_pairs: int = MIN_AA_SAMPLES  # pairs needed before anything can ship

    def add_pair(self, a: float, b: float) -> float:
        d = b / a - 1.0
        self.aa_diffs.append(d)
        return d

    @property
    def sd(self) -> float:
        if len(self.aa_diffs) < 2:
            return math.inf
        return statistics.pstdev(self.aa_diffs) if len(self.aa_diffs) < 3 else statistics.stdev(self.aa_diffs)

    @property
    def calibrated(self) -> bool:
        return len(self.aa_diffs) >= max(2, self.min_pairs)

    def threshold(self) -> float:
        return max(self.floor, self.z * self.sd) if self.calibrated else math.inf

    def decide(self, new: float, current: float) -> tuple[bool, str]:
        """(ship?, why) for objective ``new`` against ``current`` (higher is better)."""
        d = self.explain(new, current)
        return d["ship"], d["why"]

    def explain(self, new: float, current: float) -> dict:
        """The ship decision with its numbers: gain, threshold, A/A spread and pairs, and why, in one dict."""
        n = len(self.aa_diffs)
        gain = new / current - 1.0
        out = {"ship": False, "gain": gain, "new": new, "current": current, "pairs": n, "min_pairs": self.min_pairs,
               "z": self.z, "floor": self.floor, "aa_sd": self.sd if n >= 2 else None,
               "threshold": self.threshold() if self.calibrated else None}
        if not self.calibrated:
            out["why"] = (f"gain {gain * 100:+.2f}% ({new:.4g} vs {current:.4g}), but the noise is not yet measured "
                          f"({n} of {self.min_pairs} A/A pairs): stays")
            return out
        thr = self.threshold()
        out["ship"] = gain > thr
        bar = "the 1% floor" if thr == self.floor else f"z={self.z:g} x A/A sd {self.sd * 100:.2f}%"
        out["why"] = (f"gain {gain * 100:+.2f}% ({new:.4g} vs {current:.4g}) "
                      f"{'beats' if out['ship'] else 'is under'} the threshold {thr * 100:.2f}% "
                      f"({bar}, {n} A/A pairs): {'ships' if out['ship'] else 'stays'}")
        return out
