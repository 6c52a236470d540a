"""Measurement: what one timing run of a forward on a workload found, and what it ran on.

Semantics (one place, so every number means the same thing):
- a *sample* is the time of one forward call of one bucket's phase on that
  bucket's shape (one decode step, or one whole prefill), in seconds;
- on a GPU it is the CUDA-event time around one replay of a CUDA graph of the
  forward (eager launches, also between CUDA events, only where capture
  failed; ``cuda_graph`` says which); on a CPU it is ``time.perf_counter_ns``
  around the call;
- each bucket gets ``warmup`` unrecorded calls, then recorded ones, inputs
  rotated over ``rotations`` fresh sets so no cache serves a repeat: a fixed
  number, or (the engine's default) adaptively between ``min_reps`` and
  ``reps``: timing stops once the 95 % confidence interval of the median
  lies within +-``ci_rel`` of it (``stop`` says "ci", "max_reps" or
  "fixed"; ``reps`` is how many were recorded);
- ``median_s`` is the statistic used for the objective; ``ci_low_s`` and
  ``ci_high_s`` bound it (95 %, distribution-free, from order statistics);
  ``iqr_s`` and ``mad_s`` say how noisy the samples were;
- every call gets fresh input values (new token ids; a fresh shuffle of each
  floating input), written outside the timed region, and a sample of the
  timed calls (two at random and the last; ``checked``) has its outputs and
  cache writes compared with the reference on those inputs: a forward that
  caches outputs, returns constants or is right at some shapes only fails
  (``checks`` in the Measurement says what was checked);
- with process isolation the clock is the engine worker's, around one round
  trip into the candidate's own process (``env.isolation``, ``env.timed``):
  candidate code cannot reach it;
- the objective is ``tkcc.traffic.metrics.objective(workload, medians)``.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from math import comb

CONFIDENCE = 0.95


def median_ci(samples: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(low, high, coverage): a distribution-free confidence interval of the median from order statistics.

    [x_(k), x_(n+1-k)] (sorted, 1-based) covers the true median with probability
    1 - 2 P(Binomial(n, 1/2) <= k - 1), whatever the distribution; k is the largest
    with coverage >= ``confidence``. With too few samples for that (n < 6 at 95 %),
    the interval is [min, max] and its coverage is below ``confidence``.
    """
    s = sorted(samples)
    n = len(s)
    if n == 0:
        raise ValueError("median_ci: no samples")
    k, cover = 1, 1.0 - 2.0 * 0.5 ** n  # k = 1: [min, max]
    tail = 0.0
    for j in range(1, n // 2 + 1):  # coverage of [x_(j), x_(n+1-j)]
        tail += comb(n, j - 1) * 0.5 ** n
        c = 1.0 - 2.0 * tail
        if c < confidence:
            break
        k, cover = j, c
    return s[k - 1], s[n - k], cover


def ci_tight(samples: list[float], ci_rel: float, confidence: float = CONFIDENCE) -> bool:
    """True when the median's ``confidence`` interval lies within +-``ci_rel`` of the median."""
    lo, hi, cover = median_ci(samples, confidence)
    med = statistics.median(samples)
    return cover >= confidence and med > 0 and (med - lo) <= ci_rel * med and (hi - med) <= ci_rel * med


@dataclass
class BucketTiming:
    key: str
    phase: str
    weight: float
    median_s: float
    iqr_s: float
    mad_s: float
    min_s: float
    reps: int
    cuda_graph: bool
    samples_s: list[float] = field(default_factory=list)
    note: str = ""
    ci_low_s: float | None = None   # 95 % confidence interval of the median (order statistics)
    ci_high_s: float | None = None
    stop: str = "fixed"             # "fixed": reps asked; "ci": the interval was tight; "max_reps": it never was
    warmup: int | None = None       # unrecorded calls before the samples
    checked: int = 0                # timed calls whose outputs were compared with the reference

    @classmethod
    def from_samples(cls, key: str, phase: str, weight: float, samples: list[float], cuda_graph: bool,
                     note: str = "", stop: str = "fixed", warmup: int | None = None) -> "BucketTiming":
        s = sorted(samples)
        med = statistics.median(s)
        q = statistics.quantiles(s, n=4, method="inclusive") if len(s) >= 2 else [s[0]] * 3
        mad = statistics.median(abs(x - med) for x in s)
        lo, hi, _ = median_ci(s)
        return cls(key, phase, weight, med, q[2] - q[0], mad, s[0], len(s), cuda_graph, list(samples), note,
                   lo, hi, stop, warmup)


@dataclass
class Measurement:
    """Per-bucket timings of one forward (a candidate or the baseline) on one tier, with its provenance."""

    candidate: str
    tier: str
    blocks: int
    buckets: list[BucketTiming]
    objective_name: str
    objective: float | None
    workload_fingerprint: str
    validation: dict
    env: dict
    wall_s: float = 0.0           # worker-side time of the whole measurement
    supervisor_wall_s: float = 0.0  # the same, timed by the supervisor process (out of the candidate's reach)
    timing_consistent: bool = True  # sum of samples <= supervisor wall time
    note: str = ""
    checks: dict = field(default_factory=dict)  # sampled output checks of the timed calls (see the docstring)

    def medians(self) -> dict[str, float]:
        return {b.key: b.median_s for b in self.buckets}

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Measurement":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}  # what an engine added beside it (supervisor_wall_s, jit)
        d["buckets"] = [BucketTiming(**b) for b in d.get("buckets", [])]
        return cls(**d)

    def summary(self) -> str:
        obj = "n/a" if self.objective is None else f"{self.objective:.4g}"
        rows = [f"{self.candidate} on {self.tier} tier ({self.blocks} blocks), {self.env.get('device_name')}"
                f" {self.env.get('dtype')}: {self.objective_name} = {obj}"]
        for b in self.buckets:
            rows.append(f"  {b.key:<32} median {b.median_s * 1e3:9.3f} ms  iqr {b.iqr_s * 1e3:8.3f} ms"
                        f"  n={b.reps}{f' ({b.stop})' if b.stop != 'fixed' else ''}{'  graph' if b.cuda_graph else ''}")
        return "\n".join(rows)


_COMMIT: str | None = None


def commit() -> str:
    """The git commit of the tkcc tree (with '+dirty' if it has local changes), or 'unknown'."""
    global _COMMIT
    if _COMMIT is None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            rev = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                 text=True, timeout=5).stdout.strip()
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            _COMMIT = (rev + ("+dirty" if dirty else "")) if rev else "unknown"
        except (OSError, subprocess.SubprocessError):
            _COMMIT = "unknown"
    return _COMMIT


def environment(device, dtype) -> dict:
    """What a measurement ran on: device name, software versions, dtype, commit, host."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine()
        name = f"cpu ({name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # triton is optional on CPU-only installs
        triton_version = None
    return {
        "device": str(dev),
        "device_name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "dtype": str(dtype).replace("torch.", ""),
        "commit": commit(),
        "host": platform.node(),
    }
