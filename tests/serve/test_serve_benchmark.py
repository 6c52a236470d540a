"""benchmarks/serve.py's drift-run arithmetic on made-up numbers: pacing, and where each request's TPOT goes."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import serve as bench_serve
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench_serve


def _reqs(n, seed):
    rng = np.random.default_rng(seed)
    return [(float(t), [1, 2], 4) for t in np.cumsum(rng.exponential(1.0, n))]


@pytest.mark.parametrize("limit,util", [(1000.0, 0.5), (40.0, None), (10.0, 0.85)])
def test_pace_offers_the_asked_share_of_capacity_or_more_to_fit_the_limit(bench, limit, util):
    ra, rb = _reqs(60, 1), _reqs(40, 2)
    service = {"azure-conv": 0.1, "servegen-m-mid-81": 0.4}
    reqs, plan = bench.pace(ra, rb, service, SimpleNamespace(drift_util=0.5), limit)
    busy = 60 * 0.1 + 40 * 0.4
    want = util if util is not None else busy / (limit - 5.0)
    assert plan["utilisation"] == pytest.approx(want)
    n_a, n_b = plan["requests"]
    if busy / want <= limit - 5.0:
        assert (n_a, n_b) == (60, 40)
    else:  # not even 0.85 fits: fewer of each phase, in proportion, and the run then fits
        keep = (limit - 5.0) * want / busy
        assert (n_a, n_b) == (int(60 * keep), int(40 * keep))
        assert (n_a * 0.1 + n_b * 0.4) / want <= limit - 5.0
    t = np.array([a for a, _, _ in reqs])
    assert len(reqs) == n_a + n_b and t[0] == 0.0 and np.all(np.diff(t) >= 0)
    # each phase's mean rate is its share of its own capacity; the switch comes after the first phase
    assert (n_a - 1) / t[n_a - 1] == pytest.approx(want / 0.1)
    assert (n_b - 1) / (t[-1] - t[n_a]) == pytest.approx(want / 0.4)
    assert plan["switch_at_s"] == pytest.approx(t[n_a]) and t[n_a] > t[n_a - 1]


def test_watch_measuring_windows_and_the_requests_inside_them(bench):
    events = [{"kind": "waiting", "time": 1.0}, {"kind": "reference", "time": 10.0}, {"kind": "campaign", "time": 50.0},
              {"kind": "quiet", "time": 60.0}, {"kind": "drift", "time": 100.0}, {"kind": "recheck", "time": 105.0},
              {"kind": "campaign", "time": 150.0}, {"kind": "drift", "time": 200.0}]
    windows = bench.measuring_windows(events, now=230.0)
    assert windows == [(10.0, 50.0), (100.0, 150.0), (200.0, 230.0)]

    def r(first, last, n=5):  # a request whose tokens came from first to last (time.time())
        return {"status": 200, "error": None, "max_tokens": n, "wall0": 0.0, "forward": "f",
                "tokens": list(np.linspace(first, last, n))}
    res = [r(20, 21), r(49, 51), r(60, 61, n=3), r(150.5, 151), r(225, 226), {"status": 500, "error": "x",
                                                                                "max_tokens": 5, "tokens": []}]
    split = bench.by_measuring(res, windows)
    assert split["while_measuring"]["n"] == 3 and split["idle"]["n"] == 2
    assert split["idle"]["median"] == pytest.approx(np.median([1000 * 1 / 2, 1000 * 0.5 / 4]))


def test_tpot_by_stretch_between_swaps(bench):
    def r(first, step, fwd):
        return {"status": 200, "error": None, "max_tokens": 3, "wall0": 0.0, "forward": fwd,
                "tokens": [first, first + step, first + 2 * step]}
    ships = [{"time": 10.0}, {"time": 20.0}]
    res = [r(1, 0.003, "a"), r(12, 0.023, "a"), r(15, 0.023, "a"), r(25, 0.003, "b")]
    out = bench.by_serving_window(res, ships)
    assert [w["after_swap"] for w in out] == [0, 1, 2]
    assert [w["n"] for w in out] == [1, 2, 1]
    assert out[1]["median"] == pytest.approx(23.0) and out[1]["since"] == 10.0 and out[2]["forward"] == ["b"]


def test_a_flag_given_on_the_command_line_wins_over_the_smoke_settings(bench):
    """--smoke sets small values for the options not given; one given keeps its value even when it equals the
    default (`--smoke --watch` watches: the smoke's own setting is off), and a prefix of another flag is not it."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--watch", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--watch-budget-s", type=float, default=40.0)
    ap.add_argument("--drift-util", type=float, default=0.5)
    assert bench.given_dests(ap, ["--smoke", "--watch"]) == {"watch"}
    assert bench.given_dests(ap, ["--no-watch", "--drift-util=0.1"]) == {"watch", "drift_util"}
    assert bench.given_dests(ap, ["--watch-budget-s", "60"]) == {"watch_budget_s"}
    assert bench.given_dests(ap, []) == set()
