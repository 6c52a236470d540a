"""ServeGen sampling reproduces the published per-window rates and length distributions."""
import math

import numpy as np
import pytest

from tkcc.traffic import bundled_trace, load_trace
from tkcc.traffic.servegen import (client_files, read_pdfs, read_rate_table, sample_lengths,
                                   sample_window_arrivals, window_stats_from_pdfs)
from tkcc.traffic.stats import nearest_rank


def test_exact_pdf_stats_match_readme_client80_daily_p90():
    # ../shared/traces/README.md, drift example 2 (request-weighted daily P90 of input tokens)
    want = {0: 1794, 1: 2544, 2: 1041, 4: 284, 5: 310, 6: 1053, 7: 1053, 8: 1113, 9: 509, 10: 2955, 11: 11777,
            12: 11617, 13: 7029}
    reqs = {0: 3634, 1: 5611, 2: 3882, 4: 835, 8: 6229, 11: 7907, 13: 112704}
    got = {int(w["start_s"] // 86400): w for w in window_stats_from_pdfs(bundled_trace("servegen-m-large-80"))}
    assert sorted(got) == sorted(want)  # day 3 has no data
    for d, p90 in want.items():
        assert got[d]["input"]["p90"] == p90
    for d, n in reqs.items():
        assert round(got[d]["est_requests"]) == n


@pytest.mark.parametrize("name,est,inp,out", [
    ("servegen-m-large-80", 182976, (233, 3089, 14819), (52, 111, 2200)),
    ("servegen-m-mid-81", 181463, (1139, 19419, 23882), (220, 3262, 4575)),
])
def test_sampled_client_matches_published_totals(name, est, inp, out):
    tr = load_trace(bundled_trace(name), seed=3)
    rates = read_rate_table(client_files(bundled_trace(name))[0])
    assert round(tr.meta["expected_requests"]) == est and tr.meta["rate_scale"] == 1.0
    # count: renewal process per window; var(N_w) ~ n_w * cv_w^2
    n_w = rates[:, 1] * 600
    sd = math.sqrt(float((n_w * np.maximum(rates[:, 2], 1.0) ** 2).sum()))
    assert abs(len(tr) - est) < 4 * sd
    # percentiles: sampled vs published, within sampling error (a few % of rank)
    for col, pub in ((tr.input_tokens, inp), (tr.output_tokens, out)):
        for q, v in zip((0.5, 0.9, 0.99), pub):
            frac_below = (col <= v).mean()
            assert frac_below >= q - 0.02, (q, v, frac_below)
            assert (col < v).mean() <= q + 0.02


def test_per_window_rate_reproduced_within_sampling_error():
    rates = read_rate_table(client_files(bundled_trace("servegen-m-large-80"))[0])
    rng = np.random.default_rng(0)
    active = rates[rates[:, 1] > 0]
    picks = active[np.linspace(0, len(active) - 1, 12).astype(int)]
    for start, rate, cv, code, shape, scale in picks:
        counts = np.array([sample_window_arrivals(rng, start, rate, int(code), shape, scale).size for _ in range(300)])
        expect = rate * 600
        se = counts.std(ddof=1) / math.sqrt(counts.size)
        assert abs(counts.mean() - expect) < 4 * se + 0.05, (start, rate, counts.mean(), expect)
        t = sample_window_arrivals(rng, start, rate, int(code), shape, scale)
        assert t.size == 0 or (t.min() >= start and t.max() < start + 600)


def test_window_burstiness_follows_published_cv():
    rates = read_rate_table(client_files(bundled_trace("servegen-m-small-14"))[0])
    rng = np.random.default_rng(1)
    row = rates[np.argmax(rates[:, 1])]
    start, rate, cv, code, shape, scale = row
    t = sample_window_arrivals(rng, 0.0, rate, int(code), shape, scale, length=600 * 20)
    gaps = np.diff(t)
    # the gap law of the window: for Weibull/Gamma the CV is fixed by the shape alone
    if int(code) == 1:
        want = 1 / math.sqrt(shape)
    else:
        g1, g2 = math.gamma(1 + 1 / shape), math.gamma(1 + 2 / shape)
        want = math.sqrt(g2 / g1 ** 2 - 1)
    got = gaps.std() / gaps.mean()
    assert abs(got - want) / want < 0.25
    assert abs(gaps.mean() - 1 / rate) / (1 / rate) < 0.1


def test_lengths_follow_the_window_pdf():
    pdfs = read_pdfs(client_files(bundled_trace("servegen-m-mid-81"))[1])
    rng = np.random.default_rng(2)
    for start in list(pdfs)[::10]:
        vals, probs = pdfs[start]["input"]
        x = sample_lengths(rng, (vals, probs), 20000)
        ecdf = np.searchsorted(np.sort(x), vals, side="right") / x.size
        assert np.abs(ecdf - np.cumsum(probs)).max() < 1.63 / math.sqrt(x.size) * 1.5  # KS at ~1%


def test_thinning_seed_and_window_selection():
    p = bundled_trace("servegen-m-small-14")
    a = load_trace(p, seed=5, max_requests=50_000)
    b = load_trace(p, seed=5, max_requests=50_000)
    c = load_trace(p, seed=6, max_requests=50_000)
    assert np.array_equal(a.input_tokens, b.input_tokens) and not np.array_equal(a.arrival_s[:100], c.arrival_s[:100])
    assert a.meta["rate_scale"] < 0.001
    assert abs(len(a) - 50_000) < 0.1 * 50_000
    # thinning keeps the shape of the daily volume curve
    rates = read_rate_table(client_files(p)[0])
    day = (rates[:, 0] // 86400).astype(int)
    share_pub = np.bincount(day, weights=rates[:, 1]) / rates[:, 1].sum()
    share_got = np.bincount((a.arrival_s // 86400).astype(int), minlength=share_pub.size) / len(a)
    assert np.abs(share_got - share_pub).max() < 0.02
    d2 = load_trace(p, seed=5, max_requests=None, start_s=86400, end_s=86400 + 3600)
    assert d2.arrival_s.min() >= 86400 and d2.arrival_s.max() < 86400 + 3600
    assert nearest_rank(d2.input_tokens, 0.5) > 0


def test_fast_pdf_parser_equals_literal_eval():
    import ast
    import json

    path = client_files(bundled_trace("servegen-m-large-80"))[1]
    fast = read_pdfs(path)
    raw = json.loads(path.read_text())
    for key, fields in raw.items():
        for name, role in (("input_tokens", "input"), ("output_tokens", "output")):
            d = ast.literal_eval(fields[name])
            if not d:
                assert int(key) not in fast
                continue
            ks = sorted(d)
            v, p = fast[int(key)][role]
            assert np.array_equal(v, np.round(ks).astype(np.int64))
            assert np.allclose(p, np.array([d[k] for k in ks]) / sum(d.values()))


def test_pdf_window_stats_match_all_clients_table(shared_traces):
    """6 h windows of every shared language client against the derived table in ../shared/traces."""
    import csv

    table = {}
    with open(shared_traces / "servegen" / "servegen_window_stats_all_clients.csv") as f:
        for row in csv.DictReader(f):
            table[(row["model"], row["client_id"], int(row["window_start_s"]))] = row
    files = sorted(shared_traces.glob("servegen/language/*/chunk-*-trace.csv"))
    assert files
    checked = 0
    for tf in files:
        model, client = tf.parent.name, tf.name.split("-")[1]
        for w in window_stats_from_pdfs(tf, window_s=21600):
            row = table[(model, client, int(w["start_s"]))]
            assert abs(w["est_requests"] - float(row["est_requests"])) < 1.0
            for role in ("input", "output"):
                for q in ("p50", "p90", "p99"):
                    assert w[role][q] == float(row[f"{role}_{q}"]), (tf.name, w["start_s"], role, q)
            checked += 1
    assert checked > 400
