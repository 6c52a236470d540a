"""Experiment store: every candidate, plan, measurement and verdict, durable in SQLite (WAL).

Why SQLite in WAL mode: a campaign killed with SIGKILL at any moment loses no
committed row (each experiment is one transaction), readers (``tkcc report``,
``watch``) never block the writer, and results already measured for the same
artifact, workload and tier are found by one indexed lookup instead of being
measured again.

Opening a store checks it before anything else runs (``ExperimentStore(path)``
raises ``StoreError`` naming the path and the cause): a 0-byte file, a file
that is not SQLite, a truncated or corrupt database, an SQLite database of
something else, a folder, or a path that cannot be written.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from tkcc.errors import TkccError

SCHEMA_VERSION = 1
_TABLES = {"meta", "campaigns", "experiments", "ships"}


class StoreError(TkccError):
    """The experiment store cannot be used: the message names the path and the cause."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS campaigns (
    id INTEGER PRIMARY KEY,
    name TEXT UNIQUE NOT NULL,
    model TEXT NOT NULL,
    config TEXT NOT NULL,          -- JSON: trace, budget, proposer, tiers, ...
    status TEXT NOT NULL,          -- running | done | failed
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS experiments (
    id INTEGER PRIMARY KEY,
    campaign_id INTEGER NOT NULL REFERENCES campaigns(id),
    candidate TEXT NOT NULL,       -- plan hash (or source hash for agent candidates)
    plan TEXT NOT NULL,            -- plan JSON
    proposer TEXT NOT NULL,
    artifact_hash TEXT,
    workload_fp TEXT NOT NULL,
    tier TEXT NOT NULL,            -- fast | slow
    objective REAL,                -- workload-weighted objective, higher is better
    measurement TEXT,              -- JSON of the engine's Measurement
    verdict TEXT NOT NULL,         -- measured | invalid | crashed | timeout | reused
    reason TEXT,
    started REAL NOT NULL,
    finished REAL NOT NULL,
    engine TEXT,                   -- the engine (Ray actor) that measured it, NULL with one engine
    timing TEXT                    -- JSON: seconds per phase, on the engine's critical path and in parallel
);
CREATE INDEX IF NOT EXISTS exp_reuse ON experiments(artifact_hash, workload_fp, tier);
CREATE INDEX IF NOT EXISTS exp_campaign ON experiments(campaign_id, tier);
CREATE TABLE IF NOT EXISTS ships (
    id INTEGER PRIMARY KEY,
    campaign_id INTEGER NOT NULL REFERENCES campaigns(id),
    candidate TEXT NOT NULL,
    plan TEXT NOT NULL,
    objective REAL,
    action TEXT NOT NULL,          -- ship | revert | refused | stay
    reason TEXT NOT NULL,
    time REAL NOT NULL,
    detail TEXT                    -- JSON: the decision's numbers (gain, threshold, A/A spread, pairs, ...)
);
"""

# Columns added after a table's first release, added in place to an older store (additive: an older tkcc
# still reads the store, it just does not see the new column).
_ADDED_COLUMNS = {"ships": [("detail", "TEXT")], "experiments": [("engine", "TEXT"), ("timing", "TEXT")]}
_EXP_COLUMNS = ("id, campaign_id, candidate, plan, proposer, artifact_hash, workload_fp, tier, objective, measurement,"
                " verdict, reason, started, finished, engine, timing")


@dataclass
class Experiment:
    id: int
    campaign_id: int
    candidate: str
    plan: list
    proposer: str
    artifact_hash: str | None
    workload_fp: str
    tier: str
    objective: float | None
    measurement: dict | None
    verdict: str
    reason: str | None
    started: float
    finished: float
    engine: str | None = None  # the engine (Ray actor) that measured it, when a pool of engines did
    timing: dict | None = None  # seconds per phase: {"critical": {phase: s}, "parallel": {phase: s}}


class ExperimentStore:
    """One SQLite file per deployment; many campaigns in it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        _check_file(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"experiment store {self.path}: cannot open it ({e})") from None
        try:
            self._check_database()
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._init_schema()
        except sqlite3.Error as e:
            self.db.close()
            raise StoreError(f"experiment store {self.path}: {_sqlite_cause(e)}") from None
        except TkccError:
            self.db.close()
            raise

    def _check_database(self) -> None:
        """An existing file must be an intact SQLite database holding tkcc's tables (or none: a new store)."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        rows = self.db.execute("PRAGMA quick_check").fetchall()
        if [r[0] for r in rows] != ["ok"]:
            raise StoreError(f"experiment store {self.path}: the database is corrupt (SQLite integrity check: "
                             f"{'; '.join(str(r[0]) for r in rows[:3])})")
        tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and not tables & _TABLES:
            raise StoreError(f"experiment store {self.path}: an SQLite database of something else (tables "
                             f"{sorted(tables)[:8]}), not a tkcc experiment store; use another --store path")
        if tables & _TABLES and "meta" not in tables:
            raise StoreError(f"experiment store {self.path}: tables {sorted(tables & _TABLES)} but no 'meta' "
                             "table: not written by tkcc, or damaged")

    def _init_schema(self) -> None:
        for stmt in _SCHEMA.split(";"):
            if stmt.strip():
                self.db.execute(stmt)
        for table, cols in _ADDED_COLUMNS.items():
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for name, kind in cols:
                if name not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
        row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            self.db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) != SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: experiment store has schema version {row[0]}, this tkcc reads version "
                f"{SCHEMA_VERSION}; use a new --store path or the tkcc version that wrote it"
            )

    # campaigns -----------------------------------------------------------------------------
    def open_campaign(self, name: str, model: str, config: dict, resume: bool) -> int:
        row = self.db.execute("SELECT id, model FROM campaigns WHERE name=?", (name,)).fetchone()
        now = time.time()
        if row is not None:
            if not resume:
                raise TkccError(f"campaign {name!r} already exists in {self.path}; pass --resume to continue it")
            if row[1] != model:
                raise TkccError(f"campaign {name!r} was for model {row[1]!r}, not {model!r}")
            self.db.execute("UPDATE campaigns SET status='running', updated=? WHERE id=?", (now, row[0]))
            return int(row[0])
        if resume:
            raise TkccError(f"--resume: no campaign named {name!r} in {self.path}")
        cur = self.db.execute(
            "INSERT INTO campaigns(name, model, config, status, created, updated) VALUES (?,?,?,?,?,?)",
            (name, model, json.dumps(config, sort_keys=True, default=str), "running", now, now),
        )
        return int(cur.lastrowid)

    def campaign(self, name_or_id) -> dict:
        col = "id" if isinstance(name_or_id, int) else "name"
        row = self.db.execute(f"SELECT id, name, model, config, status, created, updated FROM campaigns WHERE {col}=?",
                              (name_or_id,)).fetchone()
        if row is None:
            raise TkccError(f"no campaign {name_or_id!r} in {self.path}")
        keys = ("id", "name", "model", "config", "status", "created", "updated")
        out = dict(zip(keys, row))
        out["config"] = json.loads(out["config"])
        return out

    def campaigns(self) -> list[dict]:
        return [self.campaign(int(r[0])) for r in self.db.execute("SELECT id FROM campaigns ORDER BY id")]

    def update_config(self, campaign_id: int, **changes) -> dict:
        """Set keys of a campaign's config (e.g. its sessions across resumes); returns the new config."""
        cfg = self.campaign(int(campaign_id))["config"]
        cfg.update(changes)
        self.db.execute("UPDATE campaigns SET config=?, updated=? WHERE id=?",
                        (json.dumps(cfg, sort_keys=True, default=str), time.time(), campaign_id))
        return cfg

    def set_status(self, campaign_id: int, status: str) -> None:
        self.db.execute("UPDATE campaigns SET status=?, updated=? WHERE id=?", (status, time.time(), campaign_id))

    # experiments ---------------------------------------------------------------------------
    def record(self, campaign_id: int, *, candidate: str, plan: list, proposer: str, workload_fp: str, tier: str,
               verdict: str, objective: float | None = None, measurement: dict | None = None,
               artifact_hash: str | None = None, reason: str | None = None, started: float | None = None,
               engine: str | None = None, timing: dict | None = None) -> int:
        """Append one finished experiment; committed (fsync'd) before this returns."""
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO experiments(campaign_id, candidate, plan, proposer, artifact_hash, workload_fp, tier,"
            " objective, measurement, verdict, reason, started, finished, engine, timing)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (campaign_id, candidate, json.dumps(plan, sort_keys=True), proposer, artifact_hash, workload_fp, tier,
             objective, json.dumps(measurement, default=str) if measurement is not None else None, verdict, reason,
             started if started is not None else now, now, engine,
             json.dumps(timing, sort_keys=True) if timing is not None else None),
        )
        return int(cur.lastrowid)

    def reusable(self, artifact_hash: str, workload_fp: str, tier: str) -> Experiment | None:
        """A finished measurement of the same artifact on the same workload and tier, if any."""
        row = self.db.execute(
            f"SELECT {_EXP_COLUMNS} FROM experiments WHERE artifact_hash=? AND workload_fp=? AND tier=? AND "
            "verdict='measured' ORDER BY id DESC LIMIT 1", (artifact_hash, workload_fp, tier)).fetchone()
        return self._exp(row) if row else None

    def measurements_of(self, artifact_hash: str, workload_fp: str, tier: str, limit: int = 50) -> list[Experiment]:
        """Finished measurements of one artifact on one workload and tier, newest first (the caller decides
        which of them were taken under conditions it may reuse)."""
        rows = self.db.execute(
            f"SELECT {_EXP_COLUMNS} FROM experiments WHERE artifact_hash=? AND workload_fp=? AND tier=? AND "
            "verdict='measured' ORDER BY id DESC LIMIT ?", (artifact_hash, workload_fp, tier, limit))
        return [self._exp(r) for r in rows]

    def experiments(self, campaign_id: int | None = None, tier: str | None = None) -> list[Experiment]:
        q, args = f"SELECT {_EXP_COLUMNS} FROM experiments WHERE 1=1", []
        if campaign_id is not None:
            q += " AND campaign_id=?"
            args.append(campaign_id)
        if tier is not None:
            q += " AND tier=?"
            args.append(tier)
        return [self._exp(r) for r in self.db.execute(q + " ORDER BY id", args)]

    def seen_candidates(self, campaign_id: int, tier: str) -> set[str]:
        rows = self.db.execute("SELECT DISTINCT candidate FROM experiments WHERE campaign_id=? AND tier=?",
                               (campaign_id, tier))
        return {r[0] for r in rows}

    @staticmethod
    def _exp(row) -> Experiment:
        (id_, cid, cand, plan, prop, ah, wfp, tier, obj, meas, verdict, reason, started, finished, engine,
         timing) = row
        return Experiment(id_, cid, cand, json.loads(plan), prop, ah, wfp, tier, obj,
                          json.loads(meas) if meas else None, verdict, reason, started, finished, engine,
                          json.loads(timing) if timing else None)

    # ship history --------------------------------------------------------------------------
    def record_ship(self, campaign_id: int, candidate: str, plan: list, objective: float | None, action: str,
                    reason: str, detail: dict | None = None) -> int:
        """One ship decision (ship, revert, refused, or stay: measured but not shipped) with its reason."""
        cur = self.db.execute(
            "INSERT INTO ships(campaign_id, candidate, plan, objective, action, reason, time, detail)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (campaign_id, candidate, json.dumps(plan, sort_keys=True), objective, action, reason, time.time(),
             json.dumps(detail, default=str) if detail is not None else None))
        return int(cur.lastrowid)

    def ships(self, campaign_id: int | None = None) -> list[dict]:
        q = "SELECT id, campaign_id, candidate, plan, objective, action, reason, time, detail FROM ships"
        rows = self.db.execute(q + (" WHERE campaign_id=?" if campaign_id is not None else "") + " ORDER BY id",
                               (campaign_id,) if campaign_id is not None else ())
        keys = ("id", "campaign_id", "candidate", "plan", "objective", "action", "reason", "time", "detail")
        return [dict(zip(keys, r), plan=json.loads(r[3]), detail=json.loads(r[8]) if r[8] else None) for r in rows]

    def close(self) -> None:
        self.db.close()


def _check_file(path: Path) -> None:
    """What can be said of the path before SQLite opens it (which would silently re-create a 0-byte file)."""
    if path.is_dir():
        raise StoreError(f"experiment store {path}: is a folder; name a file (e.g. {path / 'tkcc-campaigns.db'})")
    if not path.exists():
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise StoreError(f"experiment store {path}: {parent} is a file, not a folder")
        if parent is not None and not os.access(parent, os.W_OK):
            raise StoreError(f"experiment store {path}: cannot create it ({parent} is not writable)")
        return
    size = path.stat().st_size
    if size == 0:
        raise StoreError(f"experiment store {path}: the file is empty (0 bytes), not a database; a store is "
                         "never empty once created: remove the file to start a new store, or restore it")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise StoreError(f"experiment store {path}: cannot read it ({e.strerror})") from None
    if head != b"SQLite format 3\x00":
        raise StoreError(f"experiment store {path}: not an SQLite database ({size} bytes; it starts with "
                         f"{head[:8]!r}, a store starts with b'SQLite f')")
    if size < 512 or size % 512:
        raise StoreError(f"experiment store {path}: truncated ({size} bytes is not a whole number of database "
                         "pages)")
    if not os.access(path, os.R_OK | os.W_OK):
        raise StoreError(f"experiment store {path}: not readable and writable by this user")


def _sqlite_cause(e: Exception) -> str:
    text = str(e)
    if "not a database" in text:
        return f"not an SQLite database, or encrypted or truncated ({text})"
    if "malformed" in text:
        return f"the database is corrupt ({text})"
    if "locked" in text:
        return f"the database is locked by another process ({text})"
    return text
