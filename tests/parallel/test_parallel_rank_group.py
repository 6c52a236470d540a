"""RankGroup: ranks follow rank 0 op by op; a dead rank is a clear error and the group is torn down."""
from __future__ import annotations

import functools
import os
import signal
import time

import pytest

from tkcc.errors import TkccError
from tkcc.parallel.group import RankGroup
from tkcc.parallel.launch import RankError
from tkcc.parallel.worker import LayoutWorker


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_group_serves_sharded_tokens_and_survives_a_bad_request_then_a_dead_rank():
    make = functools.partial(LayoutWorker, model="llama-tiny", strategy="tp", max_cache_len=24,
                             overrides={"num_hidden_layers": 2})
    group = RankGroup(2, make, backend="gloo", timeout_s=60)
    try:
        ping = group.call("ping")
        assert ping["rank"] == 0 and ping["layout"]["degree"] == 2
        prompt = [3, 17, 42, 7, 99]
        got = group.call("generate", prompt=prompt, n=5)
        ref = group.call("reference_generate", prompt=prompt, n=5)
        assert got == ref and len(got) == 5
        with pytest.raises(TkccError, match="does not fit max_cache_len=24"):
            group.call("generate", prompt=prompt, n=40)  # every rank refuses; the group stays usable
        assert group.call("generate", prompt=prompt, n=5) == got
        follower = group.procs[0].pid
        os.kill(follower, signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(RankError, match=r"rank 1 of 2 died \(killed by SIGKILL\)"):
            group.call("generate", prompt=prompt, n=5)
        assert group.closed and not _alive(follower)
        with pytest.raises(RankError, match="closed"):
            group.call("ping")
    finally:
        group.close()
