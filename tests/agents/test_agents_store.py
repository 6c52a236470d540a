"""Experiment store: durable rows, reuse lookup, resume rules, version check, SIGKILL safety."""
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from tkcc.agents.store import ExperimentStore
from tkcc.errors import TkccError


def _record(store, cid, i, **kw):
    args = dict(candidate=f"c{i}", plan=[{"name": "dce", "params": {}}], proposer="search", workload_fp="w1",
                tier="fast", verdict="measured", objective=float(i), artifact_hash=f"a{i}")
    args.update(kw)
    return store.record(cid, **args)


def test_record_and_reuse(tmp_path):
    s = ExperimentStore(tmp_path / "x.db")
    cid = s.open_campaign("c", "olmoe-tiny", {"budget": 1}, resume=False)
    _record(s, cid, 1)
    _record(s, cid, 2, verdict="invalid", objective=None, reason="NaN in logits")
    assert s.reusable("a1", "w1", "fast").objective == 1.0
    assert s.reusable("a1", "w2", "fast") is None  # other workload: must be measured again
    assert s.reusable("a1", "w1", "slow") is None
    assert s.reusable("a2", "w1", "fast") is None  # a failed row is never reused
    assert [e.verdict for e in s.experiments(cid)] == ["measured", "invalid"]


def test_resume_rules(tmp_path):
    s = ExperimentStore(tmp_path / "x.db")
    s.open_campaign("c", "m", {}, resume=False)
    with pytest.raises(TkccError, match="--resume"):
        s.open_campaign("c", "m", {}, resume=False)
    with pytest.raises(TkccError, match="no campaign"):
        s.open_campaign("other", "m", {}, resume=True)
    with pytest.raises(TkccError, match="was for model"):
        s.open_campaign("c", "m2", {}, resume=True)
    assert s.open_campaign("c", "m", {}, resume=True) == 1


def test_incompatible_version(tmp_path):
    p = tmp_path / "x.db"
    ExperimentStore(p).close()
    db = sqlite3.connect(p)
    db.execute("UPDATE meta SET value='999' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(TkccError, match="schema version 999"):
        ExperimentStore(p)


def test_sigkill_loses_no_committed_row(tmp_path):
    """A writer killed mid-stream keeps every row it had recorded before the kill."""
    p = tmp_path / "x.db"
    code = f"""
import sys, time
from tkcc.agents.store import ExperimentStore
s = ExperimentStore({str(p)!r})
cid = s.open_campaign("k", "m", {{}}, resume=False)
i = 0
while True:
    s.record(cid, candidate=f"c{{i}}", plan=[], proposer="p", workload_fp="w", tier="fast", verdict="measured",
             objective=float(i))
    print(i, flush=True)
    i += 1
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    acked = -1
    deadline = time.time() + 60
    while acked < 30 and time.time() < deadline:
        acked = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    rows = ExperimentStore(p).experiments()
    assert len(rows) >= acked + 1  # everything acknowledged is there
    assert [r.objective for r in rows] == [float(i) for i in range(len(rows))]


# ------------------------------------------------------------------ bad stores: the path and the cause, at once
def _bad_stores(tmp_path):
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"\x89PNG\r\n" + os.urandom(3000))
    good = tmp_path / "good.db"
    s = ExperimentStore(good)
    cid = s.open_campaign("c", "m", {}, resume=False)
    for i in range(200):
        _record(s, cid, i)
    s.close()
    data = good.read_bytes()
    truncated = tmp_path / "truncated.db"
    truncated.write_bytes(data[: len(data) // 2 + 100])
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(data[:4096] + os.urandom(len(data) - 4096))
    other = tmp_path / "other.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, blob BLOB)")
    db.commit()
    db.close()
    folder = tmp_path / "folder.db"
    folder.mkdir()
    return [(empty, "empty (0 bytes)"), (garbage, "not an SQLite database"), (truncated, "truncated"),
            (corrupt, "corrupt"), (other, "something else"), (folder, "is a folder")]


def test_bad_stores_are_refused_naming_the_path_and_the_cause(tmp_path):
    from tkcc.agents.store import StoreError

    for path, cause in _bad_stores(tmp_path):
        size = path.stat().st_size if path.is_file() else None
        with pytest.raises(StoreError) as e:
            ExperimentStore(path)
        assert str(path) in str(e.value) and cause in str(e.value), (path, str(e.value))
        if size is not None:
            assert path.stat().st_size == size  # never "repaired" or re-created


def test_campaign_refuses_a_bad_store_and_too_few_aa_pairs_before_any_engine_starts(tmp_path, monkeypatch, capsys):
    import tkcc.agents.engine_eval as engine_eval
    from tkcc.agents.noise import MIN_AA_SAMPLES
    from tkcc.cli import main

    def no_engine(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(engine_eval, "spawned_engine", no_engine)
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    assert main(["campaign", "--model", "llama-tiny", "--store", str(empty), "--budget", "5s"]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "empty (0 bytes)" in err
    good = tmp_path / "new.db"
    assert main(["campaign", "--model", "llama-tiny", "--store", str(good), "--aa-pairs", "2"]) == 2
    err = capsys.readouterr().err
    assert "--aa-pairs 2" in err and f"at least {MIN_AA_SAMPLES}" in err
    assert not good.exists()  # refused before the store was even created
