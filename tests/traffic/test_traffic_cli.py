"""`tkcc trace stats` and `tkcc trace drift` end to end through tkcc.cli.main."""
import json

import pytest

from tkcc.cli import main
from tkcc.traffic import bundled_trace


def _run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_stats_json_and_png(tmp_path, capsys):
    png = tmp_path / "conv.png"
    rc, out, _ = _run(capsys, ["trace", "stats", str(bundled_trace("azure-conv")), "--json", "--png", str(png)])
    assert rc == 0
    d = json.loads(out)
    assert d["requests"] == 19366 and d["format"] == "azure2023"
    assert [d["input"][k] for k in ("p50", "p90", "p99")] == [1020, 2735, 4142]
    assert [d["output"][k] for k in ("p50", "p90", "p99")] == [129, 424, 601]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_stats_text_default_png_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _run(capsys, ["trace", "stats", str(bundled_trace("sharegpt"))])
    assert rc == 0 and "no timestamps" in out and "5,696" in out
    assert (tmp_path / "sharegpt_8k_filtered_stats_llama2_tokenizer-stats.png").exists()


def test_drift_json(tmp_path, capsys):
    png = tmp_path / "d.png"
    rc, out, _ = _run(capsys, ["trace", "drift", str(bundled_trace("azure-conv")), "--window", "10m", "--json",
                               "--png", str(png)])
    assert rc == 0
    d = json.loads(out)
    assert isinstance(d["windows"], list) and len(d["windows"]) == 6
    assert all("drift" in w for w in d["windows"])
    assert d["windows"][2]["drift"] and not d["windows"][1]["drift"] and 5 in d["drift_windows"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    rc, out, _ = _run(capsys, ["trace", "drift", str(bundled_trace("azure-code")), "--window", "10m", "--json",
                               "--no-png"])
    assert rc == 0 and json.loads(out)["drift_windows"] == []


def test_drift_servegen_days_text(tmp_path, capsys):
    rc, out, _ = _run(capsys, ["trace", "drift", str(bundled_trace("servegen-m-large-80")), "--window", "1d",
                               "--png", str(tmp_path / "sg.png")])
    assert rc == 0 and "day 11" in out and "DRIFT up" in out and (tmp_path / "sg.png").exists()


def test_bad_file_and_skip_bad(tmp_path, capsys):
    p = tmp_path / "bad.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,10,2\n2023-11-16 18:00:01.0,x,3\n"
                 "2023-11-16 18:00:02.0,10,3\n")
    rc, out, err = _run(capsys, ["trace", "stats", str(p), "--json", "--no-png"])
    assert rc == 2 and "bad.csv:3" in err and "ContextTokens" in err
    assert json.loads(out)["type"] == "TraceFormatError"
    rc, out, _ = _run(capsys, ["trace", "stats", str(p), "--json", "--no-png", "--skip-bad"])
    d = json.loads(out)
    assert rc == 0 and d["skipped"] == 1 and d["requests"] == 2 and d["skipped_lines"][0]["line"] == 3
    rc, out, err = _run(capsys, ["trace", "drift", str(p), "--window", "lots", "--no-png"])
    assert rc == 2 and "bad window" in err


def test_unknown_format_flag(tmp_path, capsys):
    p = tmp_path / "x.txt"
    p.write_text("hello\n")
    rc, _, err = _run(capsys, ["trace", "stats", str(p), "--no-png"])
    assert rc == 2 and "unknown trace format" in err
    with pytest.raises(SystemExit):
        main(["trace", "stats", str(p), "--format", "parquet"])


@pytest.mark.parametrize("rows", [1, 2])
def test_stats_and_drift_on_a_one_request_or_zero_span_trace(tmp_path, capsys, rows):
    """One request, or all requests at one instant: a clear line, no traceback, with --json too."""
    p = tmp_path / "tiny.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "2023-11-16 18:15:46.6805900,374,44\n" * rows)
    rc, out, err = _run(capsys, ["trace", "stats", str(p), "--png", str(tmp_path / "s.png")])
    assert rc == 0 and "span 0 s" in out and "no arrival rate" in out, err
    assert (tmp_path / "s.png").stat().st_size > 1000
    rc, out, _ = _run(capsys, ["trace", "stats", str(p), "--no-png", "--json"])
    d = json.loads(out)
    assert rc == 0 and d["requests"] == rows and d["span_s"] == 0 and d["req_per_s"] is None
    rc, out, _ = _run(capsys, ["trace", "drift", str(p), "--png", str(tmp_path / "d.png"), "--json"])
    d = json.loads(out)
    assert rc == 0 and "nothing to compare" in d["note"] and "--min-requests" in d["note"]
    rc, out, _ = _run(capsys, ["trace", "drift", str(p), "--no-png"])
    assert rc == 0 and "nothing to compare" in out


def test_bundled_names_and_missing_paths(tmp_path, capsys):
    rc, out, _ = _run(capsys, ["trace", "stats", "azure-code", "--no-png", "--json"])
    assert rc == 0 and json.loads(out)["format"] == "azure2023"
    rc, _, err = _run(capsys, ["trace", "drift", str(tmp_path / "gone.csv"), "--no-png"])
    assert rc == 2 and "no such file" in err and "azure-conv" in err and "sharegpt" in err
