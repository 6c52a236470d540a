"""The external coding-agent proposer end to end: ``tkcc campaign --proposer agent --agent-cmd CMD``.

The agent is a real program (a small Python script) run in the workspace tkcc prepares: the goal, the
generated forward of each tier, the engine's source and the measurements so far. One agent edits the
generated forward source of both tiers; the engine opens the edited (resealed) artifacts, validates and
measures them. Another returns garbage in the forward source; the engine refuses it and the campaign goes
on. Both campaigns use one running engine (``--engine-socket``).

The command runs in this process (``tkcc.cli.main``), its campaign on a fake clock: each engine step and
each agent round advances it by a fixed cost (the engine and the agent behind them are real), so how many
rounds fit in the budget does not depend on the machine's load.
"""
from __future__ import annotations

import dataclasses
import json
import sqlite3
import sys
import textwrap

import pytest
from campaign_helpers import FakeClock

pytestmark = pytest.mark.timeout(300)

# An edit a person (or a coding agent) might make: wrap the generated decode forward so it runs without
# autograd bookkeeping. It keeps the outputs bit for bit.
EDIT = textwrap.dedent('''
    import glob, json, pathlib
    goal = pathlib.Path("GOAL.md").read_text()
    ctx = json.loads(pathlib.Path("CONTEXT.json").read_text())
    seen = json.loads(pathlib.Path("measurements.json").read_text())
    assert "as fast as possible" in goal and set(ctx["artifact"]) == {"fast", "slow"}, (goal, ctx)
    assert pathlib.Path(ctx["engine_source"], "engine.py").exists() and "outcomes" in seen
    for path in sorted(glob.glob("artifact/*/forward_decode.py")):
        src = pathlib.Path(path).read_text()
        src += """

    _generated_bind = bind


    def bind(model, state, constants):
        generated = _generated_bind(model, state, constants)

        def forward(input_ids, cache_position):
            with torch.no_grad():
                return generated(input_ids, cache_position)

        return forward
    """
        pathlib.Path(path).write_text(src)
        print("edited", path)
''')

GARBAGE = textwrap.dedent('''
    import glob, pathlib
    for path in glob.glob("artifact/*/forward_decode.py"):
        pathlib.Path(path).write_text("def bind(model, state, constants):\\n    return 1 +* 2 garbage\\n")
''')


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tkcc.agents.engine_eval import spawned_engine

    tmp = tmp_path_factory.mktemp("agent-engine")
    with spawned_engine("llama-tiny", "cpu", state_dir=str(tmp), extra=("--threads", "1", "--max-cache-len", "64")) \
            as client:
        yield client


# fake seconds each step costs: an engine build, a measurement per tier, a ship (the slow tier's re-validation)
# and an agent round
COSTS = {"build": 1.0, "fast": 2.0, "slow": 6.0, "ship": 6.0, "agent": 5.0}
BUDGET_S = 60.0  # fake seconds: the baseline, the A/A pairs and a few agent rounds


class _Stepped:
    """The real evaluator or proposer, each call of ``steps`` advancing ``clock`` by its fixed cost."""

    def __init__(self, inner, clock, steps: dict):
        self._inner, self._clock, self._steps = inner, clock, steps

    def __getattr__(self, name):
        fn = getattr(self._inner, name)
        if name not in self._steps:
            return fn

        def step(*args, **kw):
            try:
                return fn(*args, **kw)
            finally:
                self._clock.t += self._steps[name](*args, **kw)

        return step


def _on_a_fake_clock(monkeypatch) -> FakeClock:
    """Have ``tkcc campaign`` keep its budget on a fake clock that the engine's steps and the agent advance."""
    import tkcc.agents.campaign as campaign

    clock, real = FakeClock(), campaign.run_campaign

    def run_campaign(cfg, store, proposer, evaluator, progress=True, **kw):
        ev = _Stepped(evaluator, clock, {"build": lambda cand, tier: COSTS["build"],
                                         "measure": lambda key, tier: COSTS[tier],
                                         "ship": lambda key: COSTS["ship"]})
        agent = _Stepped(proposer, clock, {"propose": lambda *a, **k: COSTS["agent"]})
        return real(dataclasses.replace(cfg, started=clock()), store, agent, ev, progress, clock=clock, **kw)

    monkeypatch.setattr(campaign, "run_campaign", run_campaign)  # what the command calls
    return clock


def _campaign(engine, tmp_path, monkeypatch, capsys, name: str, script: str) -> tuple[list, dict]:
    from tkcc.cli import main

    agent = tmp_path / f"{name}.py"
    agent.write_text(script)
    store = tmp_path / "store.db"
    clock = _on_a_fake_clock(monkeypatch)
    argv = ["campaign", "--engine-socket", engine.socket_path, "--store", str(store), "--name", name, "--budget",
            f"{BUDGET_S:.0f}s", "--batch", "1", "--reps", "5", "--no-progress", "--json", "--proposer", "agent",
            "--agent-cmd", f"{sys.executable} {agent}", "--agent-time-limit", "60s"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    capsys.readouterr()
    t0 = clock()
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:] + captured.out[-3000:]
    out = json.loads(captured.out)
    assert out["budget"]["total_s"] == BUDGET_S and clock() - t0 <= BUDGET_S, (out["budget"], clock() - t0)
    db = sqlite3.connect(store)
    cid = db.execute("SELECT id FROM campaigns WHERE name=?", (name,)).fetchone()[0]
    rows = db.execute("SELECT proposer, tier, verdict, objective, reason, candidate FROM experiments "
                      "WHERE campaign_id=? ORDER BY id", (cid,)).fetchall()
    db.close()
    return rows, out


def test_a_scripted_agent_edits_the_generated_forward_and_it_is_validated_and_measured(engine, tmp_path, monkeypatch,
                                                                                      capsys):
    rows, out = _campaign(engine, tmp_path, monkeypatch, capsys, "edits", EDIT)
    agent = [r for r in rows if r[0] == "agent"]
    assert agent, rows
    measured = [r for r in agent if r[2] == "measured"]
    assert measured and all(r[1] == "fast" for r in measured[:1]) and measured[0][3] > 0, agent
    assert all(r[5].startswith("src-") for r in agent)
    ws = sorted((tmp_path / "store.agent").glob("round-*"))[0]
    for tier in ("fast", "slow"):  # each tier's own forward, edited and resealed against its model
        manifest = json.loads((ws / "sealed" / tier / "manifest.json").read_text())
        assert manifest["edited_from"] and manifest["artifact_hash"] != manifest["edited_from"]
        assert "_generated_bind" in (ws / "sealed" / tier / "forward_decode.py").read_text()
    assert "edited" in (ws / "agent.log").read_text()


def test_an_agent_that_returns_garbage_is_refused_and_the_campaign_goes_on(engine, tmp_path, monkeypatch, capsys):
    rows, out = _campaign(engine, tmp_path, monkeypatch, capsys, "garbage", GARBAGE)
    agent = [r for r in rows if r[0] == "agent"]
    assert agent and all(r[2] == "invalid" for r in agent), agent
    assert "failed to import" in agent[0][4] and "SyntaxError" in agent[0][4], agent[0][4]
    assert [s["reason"] for s in out["ships"]] == ["baseline"]  # nothing but the baseline ever served
    assert len(agent) >= 2  # refused, and the next round ran
