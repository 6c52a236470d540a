"""Ratios with intervals: the interval covers the true ratio, and "within noise" means it spans 1."""
import math

import numpy as np
import pytest

from tkcc.traffic.ratios import Ratio, gain_interval, geomean_interval, ratio_interval


def _times(rng, n, scale, sd=0.05):
    return scale * np.exp(rng.normal(0, sd, n))


def test_the_interval_covers_the_true_speedup():
    rng = np.random.default_rng(1)
    hits = 0
    for trial in range(200):
        old, new = _times(rng, 30, 1.1), _times(rng, 30, 1.0)  # a true speed-up of x1.1
        r = ratio_interval(old, new, seed=trial)
        assert r.low <= r.value <= r.high
        hits += r.low <= 1.1 <= r.high
    assert hits >= 0.88 * 200  # a 95% percentile bootstrap of medians, on 30+30 samples


def test_within_noise_when_there_is_no_change_and_not_when_there_is():
    rng = np.random.default_rng(2)
    same = [ratio_interval(_times(rng, 40, 1.0), _times(rng, 40, 1.0), seed=i).within_noise for i in range(100)]
    assert sum(same) >= 85
    r = ratio_interval(_times(rng, 40, 1.5), _times(rng, 40, 1.0))
    assert not r.within_noise and r.label() == "faster" and "within noise" not in r.text()
    r = ratio_interval(_times(rng, 40, 1.0), _times(rng, 40, 1.0, sd=0.3))
    assert r.text().endswith("within noise") or not r.within_noise


def test_deterministic_and_too_few_samples():
    a, b = [1.0, 1.1, 0.9, 1.05], [0.5, 0.55, 0.45, 0.6]
    assert ratio_interval(a, b) == ratio_interval(a, b)
    one = ratio_interval([1.0], [0.5])
    assert one.value == 2.0 and not one.known and one.within_noise and one.label() == "noise not measured"
    assert "interval unknown" in one.text()
    with pytest.raises(ValueError):
        ratio_interval([], [1.0])


def test_geomean_of_one_bucket_is_its_ratio_and_weights_count():
    rng = np.random.default_rng(3)
    old, new = _times(rng, 30, 2.0), _times(rng, 30, 1.0)
    g = geomean_interval([(1.0, old, new)])
    r = ratio_interval(old, new)
    assert g.value == pytest.approx(r.value) and g.low < g.value < g.high
    slow, fast = (_times(rng, 30, 1.0), _times(rng, 30, 2.0)), (_times(rng, 30, 2.0), _times(rng, 30, 1.0))
    heavy_fast = geomean_interval([(0.9, *fast), (0.1, *slow)])
    plain = math.exp(0.9 * math.log(np.median(fast[0]) / np.median(fast[1]))
                     + 0.1 * math.log(np.median(slow[0]) / np.median(slow[1])))
    assert heavy_fast.value == pytest.approx(plain)


def test_gain_interval_from_aa_pairs():
    g = gain_interval(105.0, 100.0, aa_sd=0.01, pairs=5)
    assert g.value == pytest.approx(1.05) and not g.within_noise and "A/A spread 1.00% over 5 pairs" in g.source
    assert gain_interval(101.0, 100.0, aa_sd=0.02, pairs=5).within_noise
    unknown = gain_interval(150.0, 100.0, aa_sd=math.inf, pairs=1)
    assert not unknown.known and unknown.label() == "noise not measured"
    assert Ratio(1.2, 1.1, 1.3).text("%") == "+20.0% [+10.0%, +30.0%]"
    assert unknown.to_json()["low"] is None
