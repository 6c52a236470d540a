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
