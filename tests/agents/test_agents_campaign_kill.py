"""A campaign SIGKILLed at any moment loses no finished row and leaves no process behind.

The campaign starts its own engine (``tkcc serve``: supervisor, worker, one process per candidate). It is
killed with SIGKILL three times: while its engine starts, during the A/A calibration, and while the search's
candidates are measured; after each kill the same campaign is resumed. Every row the store held before a
kill is still there after it, and within seconds no process of the campaign's session is left: the engine
dies with the campaign (parent-death signal), its worker with the engine, each candidate's process with
the worker.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.serial, pytest.mark.slow, pytest.mark.timeout(300)]


# how long what the killed campaign started may take to notice and exit: an engine's spawned compile worker still
# importing torch when its parent dies exits once its bootstrap reads the closed pipe (a CI run on a loaded 2-core
# machine saw one, and multiprocessing's resource tracker, still there after 15 s)
ORPHANS_S = 60


def _session(sid: int) -> list[tuple[int, str]]:
    """(pid, command) of every live process in session ``sid`` (zombies excluded)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            out.append((int(name), cmd))
        except (OSError, ValueError):
            continue
    return out


def _rows(store) -> list[tuple]:
    if not os.path.exists(store):
        return []
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=30)
    try:
        return db.execute("SELECT id, proposer, tier, verdict, objective FROM experiments ORDER BY id").fetchall()
    except sqlite3.OperationalError:
        return []  # the schema is not there yet
    finally:
        db.close()


def _launch(store: str, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tkcc.cli", "campaign", "--model", "llama-tiny", "--budget", "10m", "--store", store,
           "--name", "killed", "--no-progress", "--json", "--reps", "5", "--batch", "2",
           "--engine-arg=--threads", "--engine-arg=1", "--engine-arg=--max-cache-len", "--engine-arg=64"]
    if resume:
        cmd.append("--resume")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own session: every process it starts is found by sid


def _wait_for(cond, timeout: float, what: str, proc) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the campaign exited before {what}: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigkill_at_three_moments_loses_no_row_and_leaves_no_process(tmp_path):
    store = str(tmp_path / "campaigns.db")
    moments = [
        ("engine start-up", lambda p: len(_session(p.pid)) >= 3 and not _rows(store)),  # serve and its worker up
        ("A/A calibration", lambda p: any(r[1] == "aa" for r in _rows(store))),
        ("search measurements", lambda p: sum(r[1] == "search" for r in _rows(store)) >= 2),
    ]
    for i, (moment, ready) in enumerate(moments):
        proc = _launch(store, resume=bool(_rows(store)) or i == 2)
        try:
            _wait_for(lambda: ready(proc), 240, moment, proc)
            before = _rows(store)
            live = _session(proc.pid)
            assert len(live) >= 2, live  # the campaign and at least its engine
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            end = time.time() + ORPHANS_S
            while time.time() < end and _session(proc.pid):
                time.sleep(0.1)
            left = _session(proc.pid)
            assert not left, f"after a SIGKILL during {moment}, processes are left: {left}"
            after = _rows(store)
            assert after[:len(before)] == before, f"rows lost after a SIGKILL during {moment}"
        finally:  # whatever the outcome, leave nothing of this session running
            for pid, _ in _session(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if proc.poll() is None:
                proc.wait(30)
            proc.stderr.close()
    rows = _rows(store)
    assert any(r[1] == "search" for r in rows) and all(r[3] in ("measured", "invalid") for r in rows)
    db = sqlite3.connect(store)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
