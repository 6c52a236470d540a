"""Progress to a stderr that is not a terminal: whole lines now and then, never a redrawn bar's ``\\r`` frames
(a piped or logged ``tkcc compile`` / ``tkcc campaign`` was mostly bar frames)."""
import io

from campaign_helpers import FakeClock, Fuse, Slow, TimedEvaluator

from tkcc.agents.campaign import CampaignConfig, run_campaign
from tkcc.agents.progress import LineProgress, progress_writer
from tkcc.agents.search import BayesianSearch, SearchSpace
from tkcc.agents.store import ExperimentStore


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_pipe_gets_the_line_writer_and_a_terminal_the_bar():
    _say, bar = progress_writer("campaign c", True, stream=io.StringIO())
    assert isinstance(bar, LineProgress)
    _say, bar = progress_writer("campaign c", True, stream=_Tty())
    assert not isinstance(bar, LineProgress) and bar is not None
    bar.close()
    assert progress_writer("campaign c", False) == (None, None)


def test_the_line_progress_writes_the_count_at_most_every_interval_and_at_the_end():
    clock, out = FakeClock(), io.StringIO()
    bar = LineProgress("campaign c", out, every_s=15.0, clock=clock)
    for _ in range(3):  # within the interval: nothing yet
        clock.t += 4.0
        bar.update(1)
    assert out.getvalue() == ""
    clock.t += 4.0  # 16 s since the start
    bar.update(1)
    bar.set_postfix_str("fast abc ok")  # just written: not again
    assert out.getvalue().splitlines() == ["campaign c: 4 experiments"]
    bar.write("[fast] abc promoted")
    bar.close()
    assert out.getvalue().splitlines()[1:] == ["[fast] abc promoted", "campaign c: 4 experiments; last: fast abc ok"]


def test_a_campaign_with_progress_on_a_pipe_writes_lines_only(tmp_path, capsys):
    clock = FakeClock()
    ev = TimedEvaluator(clock)
    cfg = CampaignConfig(name="piped", model="m", budget_s=60.0, tiers=("fast", "slow"), started=clock())
    run_campaign(cfg, ExperimentStore(tmp_path / "s.db"), BayesianSearch(SearchSpace([Fuse, Slow]), seed=0), ev,
                 progress=True, clock=clock, costs_source="a test")
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "campaign piped: " in err and " experiments" in err  # the closing line, with the count
