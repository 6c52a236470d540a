"""Compiling ahead in a campaign, and what it reports: experiments per hour, seconds per phase.

The evaluator here compiles real Triton kernels (for sm_90, on this CPU) in a real compile pool: each
candidate's kernels are queued when it is proposed (``prepare``) and its build waits for them. Every budget
decision runs on a fake clock (each step costs fixed fake seconds), so nothing depends on the machine's load.
"""
from __future__ import annotations

import sqlite3

import pytest
import torch
from campaign_helpers import FakeClock, Fuse, Slow, TimedEvaluator, Wide

from tkcc.agents.campaign import CampaignConfig, EvalResult, run_campaign
from tkcc.agents.search import BayesianSearch, SearchSpace
from tkcc.agents.store import ExperimentStore
from tkcc.agents.throughput import PHASES, Throughput, describe, phases_of
from tkcc.errors import TkccError

triton = pytest.importorskip("triton")

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * SCALE + {extra}, mask=m)
'''


def _jobs(extra: str, scale: float) -> list:
    from tkcc.kernels.discovery import deferring
    from tkcc.kernels.render import import_source

    mod = import_source("tkcc_test_campaign", KERNEL.format(extra=extra))
    x = torch.empty(1024, device="meta")
    jobs = []
    with deferring(jobs.append, target="cuda:90:32"):
        mod.scale_kernel[(4,)](x, x, 1024, SCALE=scale, BLOCK=256)
    return jobs


class AheadEvaluator(TimedEvaluator):
    """TimedEvaluator whose candidates have real kernels, compiled ahead in a real pool.

    A plan with the ``slow`` test pass brings a kernel the compiler refuses (a name it cannot resolve)."""

    compiles_ahead = True

    def __init__(self, clock, pool, **kw):
        super().__init__(clock, **kw)
        self.pool, self.events, self.cancelled, self.waits = pool, [], [], {}

    def _owner(self, cand, tier):
        return f"{cand.key}/{tier}"

    def prepare(self, cand, tier):
        names = {s.name for s in cand.plan.steps}
        k = next((s.params.get("k", 0) for s in cand.plan.steps if s.name == "wide_budget_test"), 0)
        extra = "nope" if "slow_budget_test" in names else "0.0"
        self.events.append(("prepare", cand.key, tier))
        return {"queued": self.pool.submit(self._owner(cand, tier), _jobs(extra, 1.0 + k)), "cached": 0}

    def cancel(self, cand):
        self.cancelled.append(cand.key)
        self.pool.cancel(self._owner(cand, "fast"))

    def build(self, cand, tier):
        self.events.append(("build" if cand.proposer == "search" else "build-ref", cand.key, tier))
        out = self.pool.wait(self._owner(cand, tier), timeout=300)
        if out.jobs and not out.ok:
            raise TkccError(f"the engine could not build {cand.key}: {out.reason()}")
        h = super().build(cand, tier)
        self.waits[h] = out
        return h

    def measure(self, ahash, tier):
        res = super().measure(ahash, tier)
        out = self.waits.get(ahash)
        timing = {"critical": {"render": self.build_s, "compile": out.wait_s if out else 0.0,
                               "measure": self.cost[tier]},
                  "parallel": {"compile": out.compile_s if out else 0.0}}
        return EvalResult(res.verdict, res.objective, res.measurement, timing=timing)


@pytest.fixture
def pool(tmp_path, monkeypatch):
    from tkcc.codegen import kernel_cache
    from tkcc.codegen.compile_pool import CompilePool

    monkeypatch.setenv("TKCC_KERNEL_CACHE", str(tmp_path / "render"))
    for k in ("TRITON_CACHE_DIR", "TRITON_CACHE_MANAGER"):
        monkeypatch.delenv(k, raising=False)
    p = CompilePool(kernel_cache.use(tmp_path / "kernels"), workers=2)
    yield p
    p.close()


def test_candidates_compile_ahead_a_failed_kernel_costs_its_candidate_and_throughput_is_reported(tmp_path, pool):
    clock = FakeClock()
    ev = AheadEvaluator(clock, pool)
    store = ExperimentStore(tmp_path / "s.db")
    cfg = CampaignConfig(name="ahead", model="m", budget_s=60.0, started=clock() - 5.0, batch=3, ahead=3)
    state = run_campaign(cfg, store, BayesianSearch(SearchSpace([Fuse, Slow, Wide]), seed=0), ev, progress=False,
                         clock=clock)
    rows = store.experiments(state.campaign_id)
    bad = [e for e in rows if e.verdict == "invalid"]
    assert bad and all("a kernel failed to compile" in e.reason and "nope" in e.reason for e in bad)
    assert any(e.verdict == "measured" and e.id > bad[0].id for e in rows)  # the campaign went on
    # every candidate's compiles were queued before its build, most of them while others were measured
    seen, ahead_at_build = set(), []
    for kind, key, tier in ev.events:
        if kind == "prepare":
            seen.add(key)
        elif kind == "build" and tier == "fast":
            assert key in seen, key
            seen.discard(key)
            ahead_at_build.append(len(seen))
    assert max(ahead_at_build) >= cfg.batch  # the next round was proposed and compiling meanwhile
    built = {k for kind, k, _ in ev.events if kind.startswith("build")}
    assert ev.cancelled and not set(ev.cancelled) & built  # what never ran gave its compiles back
    # throughput: in the store per row, and for the session
    timed = [e for e in rows if e.verdict != "reused"]
    assert all(e.timing and set(e.timing) == {"critical", "parallel"} for e in timed if e.proposer == "search")
    assert any(e.timing["parallel"]["compile"] > 0 for e in timed if e.timing and e.verdict == "measured")
    t = state.throughput
    wall = clock() - cfg.started
    assert t["experiments"] == len(timed) and t["wall_s"] == pytest.approx(wall, abs=0.01)
    assert t["experiments_per_hour"] == pytest.approx(3600 * len(timed) / wall, rel=1e-3)
    assert t["startup_s"] == pytest.approx(5.0)
    assert t["critical_s"]["measure"] == pytest.approx(sum(ev.cost[e.tier] for e in timed if e.verdict == "measured"
                                                            ), rel=1e-6)
    assert any("experiments/hour" in line for line in state.log)
    session = store.campaign("ahead")["config"]["sessions"][0]
    assert session["throughput"] == t


def test_without_an_evaluator_that_compiles_ahead_nothing_is_proposed_ahead(tmp_path):
    clock = FakeClock()
    ev = TimedEvaluator(clock)
    calls = []
    search = BayesianSearch(SearchSpace([Fuse, Slow, Wide]), seed=0)
    propose = search.propose
    search.propose = lambda n, history: calls.append([h for h in history if h.pending]) or propose(n, history)
    cfg = CampaignConfig(name="plain", model="m", budget_s=40.0, started=clock(), batch=3)
    state = run_campaign(cfg, ExperimentStore(tmp_path / "s.db"), search, ev, progress=False, clock=clock)
    assert calls and all(not pend for pend in calls)  # every proposal saw results only
    assert state.throughput["experiments"] > 0 and state.throughput["critical_s"]["other"] > 0


def test_phases_of_an_engine_record():
    build = {"compile_s": 0.9, "jit": {"compile_s": 0.4}, "kernels": {"wait_s": 1.5, "compile_s": 12.0}}
    rec = {"seconds": 3.1, "load": {"compile_s": 0.9, "jit": {"compile_s": 0.0}},
           "validation": {"seconds": 1.0, "jit": {"compile_s": 0.2}}, "swap": {"swap_s": 0.01, "capture_s": 0.4},
           "measurement": {"supervisor_wall_s": 1.2}}
    t = phases_of(rec, build, {"render_s": 0.3})
    c = t["critical"]
    assert c["render"] == pytest.approx(0.5 + 0.3)  # the build less its JIT compiles, and its discovery
    assert c["compile"] == pytest.approx(1.5 + 0.4 + 0.2)  # the wait for the pool, and the JIT's own compiles
    assert c["validate"] == pytest.approx(0.8) and c["capture"] == pytest.approx(0.41)
    assert c["measure"] == pytest.approx(1.2)
    assert c["other"] == pytest.approx(3.1 - (0.8 + 0.41 + 1.2 + 0.2))
    assert t["parallel"]["compile"] == 12.0
    checked = phases_of({**rec, "seconds": 4.0, "measurement": {"supervisor_wall_s": 3.0, "capture_s": 0.5,
                                                                 "checks": {"seconds": {"a": 1.0, "b": 0.25}}}})
    assert checked["critical"]["check"] == pytest.approx(1.25)  # the sampled checks, apart from the timing
    assert checked["critical"]["capture"] == pytest.approx(0.41 + 0.5)  # the graphs the measurement captured first
    assert checked["critical"]["measure"] == pytest.approx(3.0 - 0.5 - 1.25)
    alone = phases_of({**rec, "seconds": 5.0, "kernels": {"wait_s": 0.5, "compile_s": 2.0}})  # built inside it
    assert alone["critical"]["render"] == pytest.approx(0.9) and alone["critical"]["compile"] == pytest.approx(0.7)
    assert alone["critical"]["other"] == pytest.approx(5.0 - (0.9 + 0.5 + 0.8 + 0.41 + 1.2 + 0.2))
    tp = Throughput()
    tp.add("fast", t, 3.1)
    tp.add("slow", None, 2.0)
    j = tp.to_json(wall_s=36.0, startup_s=10.0)
    assert j["experiments"] == 2 and j["experiments_per_hour"] == 200.0 and j["by_tier"] == {"fast": 1, "slow": 1}
    assert set(j["critical_s"]) == set(PHASES) and j["critical_s"]["other"] == pytest.approx(c["other"] + 2.0,
                                                                                              abs=0.01)
    assert "200 experiments/hour" in describe(j)[0] and "12.0 worker-s" in describe(j)[2]


def test_an_old_store_gains_the_timing_column(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript("""
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
CREATE TABLE campaigns (id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, model TEXT NOT NULL, config TEXT NOT NULL,
    status TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE experiments (id INTEGER PRIMARY KEY, campaign_id INTEGER NOT NULL REFERENCES campaigns(id),
    candidate TEXT NOT NULL, plan TEXT NOT NULL, proposer TEXT NOT NULL, artifact_hash TEXT, workload_fp TEXT NOT NULL,
    tier TEXT NOT NULL, objective REAL, measurement TEXT, verdict TEXT NOT NULL, reason TEXT, started REAL NOT NULL,
    finished REAL NOT NULL, engine TEXT);
CREATE TABLE ships (id INTEGER PRIMARY KEY, campaign_id INTEGER NOT NULL REFERENCES campaigns(id),
    candidate TEXT NOT NULL, plan TEXT NOT NULL, objective REAL, action TEXT NOT NULL, reason TEXT NOT NULL,
    time REAL NOT NULL, detail TEXT);
INSERT INTO campaigns VALUES (1, 'old', 'm', '{}', 'done', 1.0, 2.0);
INSERT INTO experiments VALUES (1, 1, 'abc', '[]', 'search', 'h', 'w', 'fast', 2.0, NULL, 'measured', 'ok', 1.0, 2.0,
    'engine-0');
""")
    db.commit()
    db.close()
    store = ExperimentStore(path)
    assert [(e.id, e.engine, e.timing) for e in store.experiments(1)] == [(1, "engine-0", None)]
    timing = {"critical": {"measure": 1.5}, "parallel": {"compile": 4.0}}
    rid = store.record(1, candidate="d", plan=[], proposer="search", workload_fp="w", tier="fast", verdict="measured",
                       objective=3.0, timing=timing)
    assert store.experiments(1)[-1].timing == timing and store.experiments(1)[-1].id == rid
    store.close()
    cols = [r[1] for r in sqlite3.connect(path).execute("PRAGMA table_info(experiments)")]
    assert cols[-2:] == ["engine", "timing"]


def test_the_report_shows_experiments_per_hour_and_the_phases(tmp_path):
    from tkcc.agents.report import write_report

    clock = FakeClock()

    class Phased(TimedEvaluator):
        def measure(self, ahash, tier):
            res = super().measure(ahash, tier)
            res.timing = {"critical": {"render": 0.5, "validate": 1.0, "measure": self.cost[tier] - 1.5},
                          "parallel": {"compile": 7.0}}
            return res

    cfg = CampaignConfig(name="rep", model="m", budget_s=40.0, started=clock() - 4.0, batch=3)
    store = ExperimentStore(tmp_path / "s.db")
    state = run_campaign(cfg, store, BayesianSearch(SearchSpace([Fuse, Slow, Wide]), seed=0), Phased(clock),
                         progress=False, clock=clock)
    store.close()
    html = write_report(tmp_path / "s.db", "rep", tmp_path / "rep.html").read_text()
    t = state.throughput
    assert 'id="throughput"' in html and 'id="plot-throughput"' in html
    assert f"<b>{t['experiments_per_hour']:.0f}</b>" in html and f"{t['critical_s']['validate']:.1f} s" in html
    assert f"{t['parallel_s']['compile']:.1f} worker-s" in html
    old = ExperimentStore(tmp_path / "old.db")  # a campaign that recorded no phases
    cid = old.open_campaign("old", "m", {}, resume=False)
    old.record(cid, candidate="a", plan=[], proposer="baseline", workload_fp="w", tier="fast", verdict="measured",
               objective=1.0)
    old.close()
    assert "Not recorded" in write_report(tmp_path / "old.db", "old", tmp_path / "old.html").read_text()
