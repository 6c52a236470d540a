"""A store written before ship decisions had their numbers (no ``ships.detail``) opens, keeps its rows,
and takes the new column in place."""
import sqlite3

from tkcc.agents.store import ExperimentStore

_OLD = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
CREATE TABLE campaigns (id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, model TEXT NOT NULL, config TEXT NOT NULL,
    status TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE experiments (id INTEGER PRIMARY KEY, campaign_id INTEGER NOT NULL REFERENCES campaigns(id),
    candidate TEXT NOT NULL, plan TEXT NOT NULL, proposer TEXT NOT NULL, artifact_hash TEXT, workload_fp TEXT NOT NULL,
    tier TEXT NOT NULL, objective REAL, measurement TEXT, verdict TEXT NOT NULL, reason TEXT, started REAL NOT NULL,
    finished REAL NOT NULL);
CREATE TABLE ships (id INTEGER PRIMARY KEY, campaign_id INTEGER NOT NULL REFERENCES campaigns(id),
    candidate TEXT NOT NULL, plan TEXT NOT NULL, objective REAL, action TEXT NOT NULL, reason TEXT NOT NULL,
    time REAL NOT NULL);
INSERT INTO campaigns VALUES (1, 'old', 'm', '{"budget_s": 60}', 'done', 1.0, 2.0);
INSERT INTO ships VALUES (1, 1, 'abc', '[]', 100.0, 'ship', 'baseline', 1.5);
"""


def test_an_old_store_opens_and_gains_the_detail_column(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(_OLD)
    db.commit()
    db.close()
    store = ExperimentStore(path)
    ships = store.ships(1)
    assert ships == [{"id": 1, "campaign_id": 1, "candidate": "abc", "plan": [], "objective": 100.0,
                      "action": "ship", "reason": "baseline", "time": 1.5, "detail": None}]
    store.record_ship(1, "def", [], 120.0, "stay", "gain +20% is under the threshold", {"gain": 0.2})
    assert store.ships(1)[-1]["detail"] == {"gain": 0.2}
    cfg = store.update_config(1, sessions=[{"budget_s": 60}])
    assert store.campaign("old")["config"] == cfg == {"budget_s": 60, "sessions": [{"budget_s": 60}]}
    store.close()
    # and an older reader's query (the columns it knows) still works on the migrated file
    rows = sqlite3.connect(path).execute("SELECT id, candidate, action, reason FROM ships ORDER BY id").fetchall()
    assert rows == [(1, "abc", "ship", "baseline"), (2, "def", "stay", "gain +20% is under the threshold")]


def test_an_old_store_gains_the_engine_column_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(_OLD + "INSERT INTO experiments VALUES (1, 1, 'abc', '[]', 'search', 'h', 'w', 'fast', 2.0, "
                            "NULL, 'measured', 'ok', 1.0, 2.0);")
    db.commit()
    db.close()
    store = ExperimentStore(path)
    old = store.experiments(1)
    assert [(e.id, e.candidate, e.objective, e.engine) for e in old] == [(1, "abc", 2.0, None)]
    rid = store.record(1, candidate="def", plan=[], proposer="search", workload_fp="w", tier="fast",
                       verdict="measured", objective=3.0, engine="engine-1")
    assert [(e.id, e.engine) for e in store.experiments(1)] == [(1, None), (rid, "engine-1")]
    store.close()
    rows = sqlite3.connect(path).execute("SELECT id, candidate, objective FROM experiments ORDER BY id").fetchall()
    assert rows == [(1, "abc", 2.0), (2, "def", 3.0)]
