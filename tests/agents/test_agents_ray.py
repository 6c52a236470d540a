"""`tkcc campaign --ray`: one engine per Ray actor on a local Ray cluster, CPU engines on llama-tiny.

* The command runs a campaign on 2 engine actors; it finishes, and the store holds rows measured by each
  actor (the ``engine`` column), every screening row of engine-1 scaled by its own reference.
* One actor's engine is SIGKILLed mid-campaign: its in-flight experiment is retried once on the other
  engine and recorded (the row says so); every screened candidate has its row; the campaign goes on.
"""
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp):
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}  # TMPDIR stays short: Ray puts sockets there


def test_a_campaign_on_two_engine_actors_stores_each_actors_rows(tmp_path):
    store = tmp_path / "store.db"
    argv = [sys.executable, "-m", "tkcc.cli", "campaign", "--model", "llama-tiny", "--budget", "35s", "--store",
            str(store), "--name", "two", "--ray", "--engines", "2", "--json", "--no-progress"]
    p = subprocess.run(argv, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert set(out["engines"]) == {"engine-0", "engine-1"}
    assert out["engine_deaths"] == []
    db = sqlite3.connect(store)
    assert db.execute("SELECT status FROM campaigns WHERE name='two'").fetchone() == ("done",)
    rows = db.execute("SELECT engine, proposer, verdict, measurement FROM experiments").fetchall()
    by_engine = {e: [r for r in rows if r[0] == e] for e in ("engine-0", "engine-1")}
    assert all(by_engine.values()), rows
    assert all(r[0] in by_engine for r in rows)  # every row names its engine
    assert {r[1] for r in by_engine["engine-1"]} >= {"engine-reference", "search"}
    assert {out["engines"][e]["experiments"] for e in by_engine} == {len(v) for v in by_engine.values()}
    # engine-1's candidates are compared with engine-1's own measurement of what serves
    scaled = [json.loads(r[3]) for r in by_engine["engine-1"] if r[1] == "search" and r[2] == "measured"]
    assert scaled and all(m["engine"] == "engine-1" and m["scale"] > 0 and m["raw_objective"] > 0 for m in scaled)
    # ship decisions are taken on one engine: the A/A pairs are all the home engine's
    assert {r[0] for r in rows if r[1] == "aa"} <= {"engine-0"}


@pytest.fixture
def local_ray():
    from tkcc.agents.ray_pool import init_ray

    ours = init_ray(None, num_cpus=3)
    yield
    if ours:
        ray.shutdown()


def test_an_engine_killed_mid_campaign_has_its_experiment_retried_and_no_row_is_lost(tmp_path, local_ray,
                                                                                   monkeypatch):
    from tkcc.agents.campaign import CampaignConfig, run_campaign
    from tkcc.agents.cli import _workload_for
    from tkcc.agents.ray_pool import RayEvaluator
    from tkcc.agents.search import BayesianSearch, SearchSpace
    from tkcc.agents.store import ExperimentStore
    from tkcc.traffic.names import load_named_trace

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    trace = load_named_trace("azure-conv")
    ev = RayEvaluator("llama-tiny", 2, lambda c: _workload_for(c, trace), reps=5)
    try:
        victim = ev.engines()["engine-1"]["pid"]
        path = tmp_path / "store.db"
        killed, sent = threading.Event(), []

        def kill_on_second_candidate(engine, cand, kind):  # engine-1 has a row; its next experiment is in flight
            if engine == "engine-1" and kind == "candidate":
                sent.append(cand.key)
                if len(sent) == 2:
                    os.kill(victim, signal.SIGKILL)
                    killed.set()

        ev.on_dispatch = kill_on_second_candidate
        store = ExperimentStore(path)
        cfg = CampaignConfig(name="kill", model="llama-tiny", budget_s=40, batch=2)  # room for engine-1's 2nd candidate
        state = run_campaign(cfg, store, BayesianSearch(SearchSpace.from_registry(exact_only=True), seed=0), ev,
                             progress=False)
        deaths = list(ev.deaths)
    finally:
        ev.close()
    assert killed.is_set()
    assert [d["engine"] for d in deaths][:1] == ["engine-1"] and "exited" in deaths[0]["why"]
    rows = store.experiments(state.campaign_id)
    assert store.campaign("kill")["status"] == "done"
    retried = [r for r in rows if (r.measurement or {}).get("retry")]
    assert len(retried) == 1, [(r.engine, r.reason) for r in rows]
    r = retried[0]
    assert r.candidate == sent[1], (sent, [(e.engine, e.candidate, e.proposer, e.reason) for e in rows])
    assert r.engine != "engine-1" and r.measurement["retry"]["engine"] == "engine-1"
    assert "retried on" in r.reason and "after engine-1 died" in r.reason
    # no row lost: every screened candidate has one row, and the campaign went on after the death
    assert sum(e.proposer == "search" and e.tier == "fast" for e in rows) == state.tried
    # the campaign went on after the death: it finished (status done above), and whatever it measured after the
    # retry (how much depends on the budget left on this machine) came from live engines only
    assert not [e for e in rows if e.engine == "engine-1" and e.id > r.id]
