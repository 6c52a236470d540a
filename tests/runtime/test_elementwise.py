"""The chunked element-wise checks of validation against the one-shot expressions they replace, on fresh
random inputs with NaN/Inf sprinkled in, at shapes that do and do not divide the chunk."""
from __future__ import annotations

import pytest
import torch

from tkcc.runtime import elementwise as ew


def _one_shot_max_abs(a, b):
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs()
    d = d[torch.isfinite(d)]
    return float(d.max()) if d.numel() else 0.0


def _one_shot_scale(a):
    a = a.abs()
    return float(torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype)).amax()) if a.numel() else 0.0


def _pair(shape, dtype, seed, specials):
    g = torch.Generator().manual_seed(seed)
    r = (torch.randn(shape, generator=g) * 3).to(dtype)
    o = (r.float() + torch.randn(shape, generator=g) * 1e-2).to(dtype)
    if specials and r.numel():
        for t in (r, o):
            idx = torch.randint(0, t.numel(), (max(1, t.numel() // 50),), generator=g)
            vals = torch.tensor([float("nan"), float("inf"), -float("inf")])[
                torch.randint(0, 3, idx.shape, generator=g)].to(dtype)
            t.view(-1)[idx] = vals
    return r, o


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5, 11), (2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("specials", [False, True])
def test_chunked_checks_equal_the_one_shot_expressions(monkeypatch, shape, dtype, specials):
    monkeypatch.setattr(ew, "CHUNK", 7)  # many chunks, one shorter than the rest
    for seed in range(3):
        r, o = _pair(shape, dtype, 100 * seed + len(shape), specials)
        assert ew.max_abs_diff(r, o) == _one_shot_max_abs(r, o)
        assert ew.max_finite_abs(r) == _one_shot_scale(r)
        assert ew.nonfinite_where_finite(r, o) == int((~torch.isfinite(o) & torch.isfinite(r)).sum())
        assert ew.all_finite(r) == bool(torch.isfinite(r).all())
        assert ew.all_zero(r) == bool((r == 0).all())
        for atol, rtol in ((1e-3, 1e-3), (0.1, 0.0), (0.0, 0.0)):
            assert ew.allclose(o, r, atol, rtol) == torch.allclose(o.float(), r.float(), atol=atol, rtol=rtol,
                                                                   equal_nan=True)
        same = r.clone()
        assert ew.equal_nan(r, same) == bool(torch.isclose(r, same, rtol=0, atol=0, equal_nan=True).all())
        assert ew.equal_nan(r, o) == bool(torch.isclose(r, o, rtol=0, atol=0, equal_nan=True).all())


def test_a_difference_in_the_last_short_chunk_is_found(monkeypatch):
    monkeypatch.setattr(ew, "CHUNK", 4)
    r = torch.zeros(10)
    o = r.clone()
    o[9] = 2.5
    assert ew.max_abs_diff(r, o) == 2.5 and not ew.allclose(o, r, 1e-3, 1e-3) and not ew.equal_nan(r, o)
    o[9] = float("nan")
    assert ew.nonfinite_where_finite(r, o) == 1 and not ew.all_finite(o) and ew.max_abs_diff(r, o) == 0.0
    assert ew.all_zero(r) and not ew.all_zero(torch.tensor([0.0, 0.0, 0.0, 0.0, 1e-30]))


def test_integer_outputs_compare_as_before():
    r = torch.arange(20, dtype=torch.int64)
    o = r.clone()
    o[13] += 5
    assert ew.max_abs_diff(r, o) == 5.0 and ew.max_finite_abs(r) == 19.0
