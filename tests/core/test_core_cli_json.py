"""`--json` means exactly one JSON object on stdout, for every command, on success, on bad input and on a
usage error; and `tkcc --help` starts without importing torch or triton.

(`campaign`, `watch` and `report` are run the same way in tests/agents/test_agents_cli.py.)
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tkcc.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _one_json(capsys, argv, rc=0):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out = capsys.readouterr().out
    data = json.loads(out)  # the whole of stdout, not its last line
    assert rc is None or code == rc, (code, out[-2000:])
    assert isinstance(data, dict)
    return data


def test_help_imports_neither_torch_nor_triton():
    code = (
        "import contextlib, io, json, sys\n"
        "from tkcc.cli import main\n"
        "cmds = [[], ['compile'], ['passes', 'list'], ['golden', 'check'], ['trace', 'stats'], ['trace', 'drift'],\n"
        "        ['serve'], ['submit'], ['engine', 'status'], ['campaign'], ['watch'], ['report']]\n"
        "for c in cmds:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main(c + ['--help'])\n"
        "        except SystemExit:\n"
        "            pass\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []


def test_help_texts_are_complete():
    import contextlib
    import io

    for argv in (["compile"], ["golden", "check"], ["campaign"], ["watch"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
            main(argv + ["--help"])
        text = buf.getvalue()
        assert "None" not in text and "{fast,slow,slow}" not in text and " at at " not in text, text
        if argv == ["compile"]:
            for flag in ("--mode", "--device", "--dtype"):
                line = text.split(flag, 2)[-1].split("\n  --")[0]
                assert len(line.strip()) > 20, (flag, line)  # it has a help text


def test_json_on_the_offline_commands(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = _one_json(capsys, ["passes", "list", "--json"])
    assert d["passes"]
    assert _one_json(capsys, ["passes", "show", "cse", "--json"])["pass"]["name"] == "cse"
    d = _one_json(capsys, ["trace", "stats", "azure-conv", "--no-png", "--json"])  # a bundled name
    assert d["requests"] == 19366
    d = _one_json(capsys, ["trace", "drift", "sharegpt", "--no-png", "--json"], rc=2)
    assert "no timestamps" in d["error"]
    d = _one_json(capsys, ["golden", "check", "--model", "llama-tiny", "--json"], rc=None)  # exact or not here
    assert d["report"]["model"] == "llama-tiny"
    d = _one_json(capsys, ["golden", "record", "--model", "llama-tiny", "--root", str(tmp_path / "g"), "--json"])
    assert d["ok"] and not d["unchanged"]
    again = _one_json(capsys, ["golden", "record", "--model", "llama-tiny", "--root", str(tmp_path / "g"), "--json"])
    assert again["unchanged"] and again["meta"]["recorded_at"] == d["meta"]["recorded_at"]  # files left alone
    d = _one_json(capsys, ["compile", "--model", "llama-tiny", "--no-measure", "--out", str(tmp_path / "out"),
                           "--json"], rc=None)
    assert d["golden"] and d["out"] == str(tmp_path / "out")


def test_json_on_bad_input_and_usage_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = _one_json(capsys, ["compile", "--plan", "missing.json", "--json"], rc=2)
    assert "no such file" in d["error"] and "missing.json" in d["error"]
    d = _one_json(capsys, ["golden", "check", "--model", "no-such-model", "--json"], rc=2)
    assert "not a built-in model" in d["error"] and "golden record" not in d["error"]
    d = _one_json(capsys, ["campaign", "--budget", "-5m", "--json"], rc=2)
    assert d["error"] == "--budget must be a positive duration, got '-5m'"
    d = _one_json(capsys, ["campaign", "--budget", "0", "--json"], rc=2)
    assert "window" not in d["error"] and "--budget must be a positive duration" in d["error"]
    d = _one_json(capsys, ["trace", "stats", "no-such-trace.csv", "--json"], rc=2)
    assert "no such file" in d["error"] and "azure-conv" in d["error"]  # the bundled names are listed
    d = _one_json(capsys, ["trace", "stats", "--json"], rc=2)  # argparse: a missing argument
    assert d["type"] == "UsageError" and "file" in d["error"]
    d = _one_json(capsys, ["compile", "--plan", '[{"name": "cse"}, {"name": "nope"}]', "--json"], rc=2)
    assert "plan step 2 ('nope')" in d["error"]  # steps count from 1, as in the pass table


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tkcc.agents.engine_eval import spawned_engine

    d = tmp_path_factory.mktemp("engine")
    with spawned_engine("llama-tiny", "cpu", state_dir=str(d), extra=("--max-cache-len", "64")) as client:
        yield str(d / "engine.sock"), client


def test_json_on_the_engine_commands(engine, tmp_path, capsys):
    sock, _ = engine
    d = _one_json(capsys, ["engine", "status", "--socket", sock, "--json"])
    assert d["engine"]["model"] == "llama-tiny"
    d = _one_json(capsys, ["submit", "--baseline", "--tier", "fast", "--trace", "azure-conv", "--reps", "3",
                           "--socket", sock, "--json"])  # a bundled trace name works here too
    assert d["ok"] and d["tiers"]["fast"]["measurement"]["objective"]
    assert "candidate None" not in d["text"]
    d = _one_json(capsys, ["engine", "results", "--socket", sock, "--json"])
    assert d["records"]
    d = _one_json(capsys, ["submit", "--plan", "missing-plan.json", "--socket", sock, "--json"], rc=2)
    assert "no such file" in d["error"]
    d = _one_json(capsys, ["engine", "revert", "--tier", "fast", "--socket", sock, "--json"], rc=None)
    assert "reverted" in d or "error" in d
    d = _one_json(capsys, ["engine", "stop", "--socket", sock, "--json"])
    assert d["text"] == "engine stopping"


def test_scratch_folders_are_removed_at_exit_or_kept_with_tkcc_keep_temp(tmp_path):
    code = "from tkcc.scratch import scratch_dir\nprint(scratch_dir('tkcc-compile-').is_dir())\n"
    for keep in ("", "1"):
        tmp = tmp_path / f"t{keep}"
        tmp.mkdir()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp), "TKCC_KEEP_TEMP": keep}
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr
        assert len(list(tmp.glob("tkcc-compile-*"))) == (1 if keep else 0)


def test_an_in_process_compile_keeps_its_artifact_in_a_scratch_folder(monkeypatch):
    import tkcc
    import tkcc.scratch
    from tkcc.frontend.models import build_model

    made = []
    real = tkcc.scratch.scratch_dir
    monkeypatch.setattr(tkcc.scratch, "scratch_dir", lambda prefix: made.append(real(prefix)) or made[-1])
    c = tkcc.compile(build_model("llama-tiny"), measure=False, check=False)
    assert len(made) == 1 and Path(c.artifact.path).parent == made[0]
