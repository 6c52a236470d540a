"""External-agent proposer: workspace contents, plan and source returns, and every failure mode."""
import sys

import pytest

from tkcc.agents.external import GOAL, ExternalAgent
from tkcc.errors import TkccError


def _artifact(tmp_path):
    art = tmp_path / "base"
    (art / "kernels").mkdir(parents=True)
    (art / "forward_decode.py").write_text("def forward(x):\n    return x\n")
    (art / "manifest.json").write_text("{}")
    return art


def _agent(tmp_path, script, **kw):
    path = tmp_path / "agent.py"
    path.write_text(script)
    return ExternalAgent(f"{sys.executable} {path}", tmp_path / "ws", base_artifact=_artifact(tmp_path), **kw)


def test_workspace_has_goal_alone_by_default(tmp_path):
    agent = _agent(tmp_path, "open('plan.json','w').write('[{\"name\": \"dce\", \"params\": {}}]')")
    ws = agent.prepare()
    assert (ws / "GOAL.md").read_text().strip() == GOAL
    assert (ws / "artifact" / "forward_decode.py").exists()
    assert (ws / "measurements.json").exists() and (ws / "CONTEXT.json").exists()


def test_notes_are_appended(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("Fuse the router.")
    agent = _agent(tmp_path, "pass", notes=notes)
    assert "Fuse the router." in (agent.prepare() / "GOAL.md").read_text()


def test_plan_returned(tmp_path):
    agent = _agent(tmp_path, "open('plan.json','w').write('[{\"name\": \"dce\", \"params\": {}}]')")
    [c] = agent.propose(1, [])
    assert [s.name for s in c.plan.steps] == ["dce"] and c.artifact_dir is None


def test_modified_source_returned(tmp_path):
    agent = _agent(tmp_path, "p='artifact/forward_decode.py'; open(p,'a').write('# faster\\n')")
    [c] = agent.propose(1, [])
    assert c.artifact_dir is not None and c.key.startswith("src-")
    assert "# faster" in (c.artifact_dir / "forward_decode.py").read_text()


@pytest.mark.parametrize("script,match", [
    ("import sys; sys.exit(3)", "exited with 3"),
    ("import time; time.sleep(60)", "limit"),
    ("open('plan.json','w').write('not json')", "bad"),
    ("open('plan.json','w').write('{\"a\": 1}')", "bad"),
    ("pass", "changed nothing"),
])
def test_failures_are_clear(tmp_path, script, match):
    agent = _agent(tmp_path, script, time_limit_s=2)
    with pytest.raises(TkccError, match=match):
        agent.propose(1, [])


def test_missing_command(tmp_path):
    with pytest.raises(TkccError, match="not found"):
        ExternalAgent("definitely-not-a-command-xyz --go", tmp_path)
    with pytest.raises(TkccError, match="empty"):
        ExternalAgent("  ", tmp_path)
