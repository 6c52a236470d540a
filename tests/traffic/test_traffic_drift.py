"""Drift detector on the README's examples, KS against scipy, and following a growing file."""
import json

import numpy as np
import pytest

from tkcc.errors import TkccError, TraceFormatError
from tkcc.traffic import (RollingWorkload, TraceFollower, TraceRecorder, bundled_trace, detect_drift, load_trace,
                          parse_window, windowed)
from tkcc.traffic.drift import ks_2samp


def test_window_stats_match_readme(conv, code):
    # ../shared/traces/README.md drift example 1 (10-minute windows from the first request)
    ws = [w for w, _ in windowed(conv, 600)]
    assert [w.requests for w in ws] == [2867, 3118, 4123, 4068, 3125, 2065]
    assert [w.input["p50"] for w in ws] == [1041, 1042, 1002, 442, 1019, 1053]
    assert [w.input["p90"] for w in ws] == [2221, 2519, 4082, 2700, 2348, 1351]
    assert round(ws[-1].end_s - ws[-1].start_s) == 502
    p90 = [w.input["p90"] for w, _ in windowed(code, 600)]
    assert min(p90) == 4678 and max(p90) == 5664


def test_azure_conv_drifts_within_the_hour(conv):
    rep = detect_drift(conv, "10m")
    by = {w.index: w for w in rep.windows}
    assert not by[1].drift and by[0].note == "reference"
    assert by[2].drift and by[2].reoptimize and by[2].shifts["input_p90"] == pytest.approx(4082 / 2221)
    assert by[5].drift and by[5].direction == "down" and by[5].field == "input_p90"
    assert by[5].magnitude == pytest.approx(2348 / 1351)
    assert by[5].reference == 4


def test_azure_code_is_quiet(code):
    for window in ("5m", "10m", "20m"):
        assert detect_drift(code, window).drifted == []


def test_servegen_client80_across_days(client80):
    rep = detect_drift(client80, "1d")
    by = {int(w.start_s // 86400): w for w in rep.windows}
    assert by[3].requests == 0 and by[3].note == "empty"
    # P90 of input goes 1,113 (day 8) -> 11,777 (day 11): the detector flags a large upward move in days 9-11
    ups = [by[d] for d in (9, 10, 11) if by[d].drift and by[d].direction == "up"
           and any(k.startswith("input") and r >= 3 for k, r in by[d].shifts.items())]
    assert ups and max(w.magnitude for w in ups) >= 5
    assert by[11].input["p90"] > 9000 and by[8].input["p90"] < 1400
    assert all(w.reoptimize for w in ups)


def test_servegen_m_mid_81_day3_jump():
    tr = load_trace(bundled_trace("servegen-m-mid-81"), seed=1)
    by = {int(w.start_s // 86400): w for w in detect_drift(tr, "1d").windows}
    assert by[3].drift and by[3].direction == "up" and by[3].shifts["input_p90"] > 10


def test_high_volume_client_is_quiet():
    tr = load_trace(bundled_trace("servegen-m-small-14"), max_requests=200_000)
    assert detect_drift(tr, "1d").drifted == []


def test_ks_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for n, m, shift in ((50, 80, 0.0), (400, 300, 0.2), (3000, 2000, 0.05), (1000, 1000, 0.0)):
        a = rng.lognormal(6, 1, n).round()
        b = (rng.lognormal(6 + shift, 1, m)).round()
        d, p = ks_2samp(a, b)
        ref = stats.ks_2samp(a, b, method="asymp")
        assert d == pytest.approx(ref.statistic, abs=1e-12)
        assert p == pytest.approx(ref.pvalue, rel=0.2, abs=2e-3)


def test_parse_window_and_no_timestamps():
    assert parse_window("10m") == 600 and parse_window("6h") == 21600 and parse_window("1d") == 86400
    assert parse_window("90s") == 90 and parse_window(30) == 30
    with pytest.raises(TkccError, match="bad window"):
        parse_window("10 parsecs")
    with pytest.raises(TkccError, match="no timestamps"):
        detect_drift(load_trace(bundled_trace("sharegpt")), "10m")


def test_follower_reads_complete_lines_only(tmp_path, conv):
    src = bundled_trace("azure-conv").read_text().splitlines(True)
    p = tmp_path / "live.csv"
    f = open(p, "w")
    f.write(src[0] + src[1] + src[2][:12])
    f.flush()
    fo = TraceFollower(p)
    first = fo.poll()
    assert len(first) == 1
    assert fo.poll() is None
    f.write(src[2][12:] + "".join(src[3:1001]))
    f.flush()
    more = fo.poll()
    assert len(more) == 999 and np.allclose(more.arrival_s, conv.arrival_s[1:1000], atol=1e-5)
    f.write("2023-11-16 18:15:40.0000000,5,5\n")  # earlier than what was read
    f.flush()
    with pytest.raises(TraceFormatError, match="before the previous poll") as e:
        fo.poll()
    assert e.value.line == 1002
    f.close()
    p.write_text(src[0])
    with pytest.raises(TraceFormatError, match="shrank"):
        fo.poll()


def test_rolling_workload_with_recorder(tmp_path, conv):
    p = tmp_path / "rec.tkcc.jsonl"
    rw = RollingWorkload(p, horizon="10m")
    with TraceRecorder(p, model="olmoe-16l") as rec:
        assert rw.update() == 0
        for i in range(len(conv)):
            if conv.arrival_s[i] >= 1200:
                break
            rec.record(conv.arrival_s[i], conv.input_tokens[i], conv.output_tokens[i])
        assert rw.update() > 0
        cur = rw.current()
        assert cur.arrival_s.min() >= cur.arrival_s.max() - 600
        rw.set_reference()
        assert not rw.check().drift
        w = rw.workload(max_context=8192)
        assert w.meta["requests"] == len(cur)
        for i in range(i, len(conv)):
            if conv.arrival_s[i] >= 1800:
                break
            rec.record(conv.arrival_s[i], conv.input_tokens[i], conv.output_tokens[i])
        rw.update()
        verdict = rw.check()
        assert verdict.drift and verdict.reoptimize and verdict.direction in ("up", "down")
    lines = p.read_text().splitlines()
    assert json.loads(lines[0])["tkcc_trace"] == 1 and len(lines) > 1000
    with pytest.raises(TkccError, match="cannot follow"):
        TraceFollower(bundled_trace("sharegpt")).poll()
