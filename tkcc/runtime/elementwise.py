"""Element-wise checks of two large outputs in bounded memory.

Validation compares whole outputs, and a served long prompt's prefill logits are gigabytes (16k tokens x a
128k vocabulary in bf16: 4 GB). Upcasting both to float64 to subtract them needed four times that again,
inside the candidate's device-memory cap, so a correct candidate ran out of memory on the comparison
(the H200 serve run's watcher). Every function here walks the flattened tensors in chunks of ``CHUNK``
elements: the extra memory is a few chunks, whatever the outputs' size, and the answers are those of the
one-shot expressions in each docstring (``tests/runtime/test_elementwise.py`` checks both).
"""
from __future__ import annotations

import torch

CHUNK = 1 << 24  # elements per step: 128 MiB per float64 temporary


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def _chunks(*ts: torch.Tensor):
    flats = [_flat(t) for t in ts]
    n = flats[0].numel()
    for i in range(0, n, CHUNK):
        yield tuple(f[i:i + CHUNK] for f in flats)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max(|a - b|) over the finite differences, in float64; 0.0 when there is none."""
    worst = 0.0
    for x, y in _chunks(a, b):
        d = (x.double() - y.double()).abs()
        d = d[torch.isfinite(d)]
        if d.numel():
            worst = max(worst, float(d.max()))
    return worst


def max_finite_abs(a: torch.Tensor) -> float:
    """max(|a|) over its finite elements; 0.0 when there is none."""
    worst = 0.0
    for (x,) in _chunks(a):
        m = x.abs()
        m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype, device=m.device))
        if m.numel():
            worst = max(worst, float(m.amax()))
    return worst


def nonfinite_where_finite(ref: torch.Tensor, out: torch.Tensor) -> int:
    """How many elements of ``out`` are NaN/Inf where ``ref`` is finite: (~isfinite(out) & isfinite(ref)).sum()."""
    n = 0
    for r, o in _chunks(ref, out):
        n += int((~torch.isfinite(o) & torch.isfinite(r)).sum())
    return n


def all_finite(a: torch.Tensor) -> bool:
    """torch.isfinite(a).all()"""
    return all(bool(torch.isfinite(x).all()) for (x,) in _chunks(a))


def all_zero(a: torch.Tensor) -> bool:
    """(a == 0).all()"""
    return all(bool((x == 0).all()) for (x,) in _chunks(a))


def allclose(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> bool:
    """torch.allclose(out.float(), ref.float(), atol, rtol, equal_nan=True)"""
    return all(torch.allclose(o.float(), r.float(), atol=atol, rtol=rtol, equal_nan=True)
               for o, r in _chunks(out, ref))


def equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal but for NaNs in the same places: isclose(a, b, rtol=0, atol=0, equal_nan=True).all()."""
    return all(bool(torch.isclose(x, y, rtol=0, atol=0, equal_nan=True).all()) for x, y in _chunks(a, b))
