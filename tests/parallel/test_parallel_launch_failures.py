"""A rank that dies or a collective that times out: clear error, group torn down, no process left."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tkcc.parallel.launch import RankError, launch


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _sum_ranks(rank, world):
    import torch.distributed as dist

    x = torch.tensor([float(rank + 1)])
    y = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(x, "sum", dist.group.WORLD.group_name))
    return (os.getpid(), y.item())


def _one_rank_killed(rank, world, pidfile):
    import torch.distributed as dist

    with open(f"{pidfile}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))  # rank 0 waits on a dead peer
    return "unreachable"


def _one_rank_stalls(rank, world, pidfile):
    import torch.distributed as dist

    with open(f"{pidfile}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(120)  # alive but never joins the collective
    dist.all_reduce(torch.ones(4))
    return "unreachable"


def _raises(rank, world):
    if rank == 1:
        raise ValueError("bad input on rank 1")
    return rank


def _pids(pidfile, world):
    out = []
    for r in range(world):
        try:
            with open(f"{pidfile}.{r}") as f:
                out.append(int(f.read()))
        except FileNotFoundError:
            pass
    return out


def test_collective_sums_over_ranks():
    res = launch(_sum_ranks, 3, timeout_s=60)
    assert [v for _, v in res] == [6.0, 6.0, 6.0]
    assert not any(_alive(pid) for pid, _ in res)


def test_killed_rank_tears_group_down(tmp_path):
    pidfile = str(tmp_path / "pid")
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        launch(_one_rank_killed, 2, (pidfile,), timeout_s=60, collective_timeout_s=10)
    assert time.monotonic() - t0 < 45
    msg = str(e.value)
    assert ("rank 1" in msg and "SIGKILL" in msg) or "rank 0" in msg, msg
    pids = _pids(pidfile, 2)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_collective_timeout_is_an_error(tmp_path):
    pidfile = str(tmp_path / "pid")
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        launch(_one_rank_stalls, 2, (pidfile,), timeout_s=60, collective_timeout_s=3)
    assert time.monotonic() - t0 < 40
    assert e.value.rank == 0 and e.value.kind == "error", str(e.value)
    pids = _pids(pidfile, 2)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)  # the stalled rank was killed too


def test_rank_exception_names_rank_and_cause():
    with pytest.raises(RankError, match=r"rank 1 of 2 failed: ValueError: bad input on rank 1"):
        launch(_raises, 2, timeout_s=60)


def test_whole_group_timeout(tmp_path):
    pidfile = str(tmp_path / "pid")
    with pytest.raises(RankError, match="did not finish within"):
        launch(_one_rank_stalls, 2, (pidfile,), timeout_s=4, collective_timeout_s=60)
    assert not any(_alive(p) for p in _pids(pidfile, 2))
