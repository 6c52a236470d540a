"""A candidate that raises, hangs, crashes, exhausts memory or returns wrong outputs costs only itself.

One engine (a small residual-MLP model, CPU, process isolation: each candidate in its own process) serves
the whole module; each test submits a misbehaving source candidate and then checks the engine still
answers, still serves the baseline, and journaled the failure. What a candidate kills is its own process:
the worker is not restarted. The worker's own recovery is tested by killing the worker.
"""
from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.timeout(120)


def _cand(eng, name, body, **extra):
    return {"source": eng.forward_source(name, body), **extra}


def _ok_after(eng):
    """The engine answers and a good candidate still goes through."""
    with eng.client() as c:
        res = c.experiment({"baseline": True}, tiers="fast", reps=5)
        st = c.status()
    assert res["ok"], res
    assert st["serving"]["slow"]["current"] == "baseline" and st["serving"]["fast"]["current"] == "baseline"
    return st


def test_good_candidate_is_validated_swapped_and_measured_on_both_tiers(blocks_engine):
    cand = _cand(blocks_engine, "good", "return base(x.clone())")
    with blocks_engine.client() as c:
        res = c.experiment(cand, tiers="both", reps=30)
    assert res["ok"], res
    fast, slow = res["tiers"]["fast"], res["tiers"]["slow"]
    for rec, blocks in ((fast, 1), (slow, 5)):
        m = rec["measurement"]
        assert rec["validation"]["ok"] and rec["validation"]["mode"] == "exact"
        assert m["blocks"] == blocks and m["tier"] in ("fast", "slow")
        assert m["buckets"][0]["reps"] == 30 and len(m["buckets"][0]["samples_s"]) == 30
        assert m["objective"] is not None and m["objective"] > 0
        assert m["timing_consistent"] and m["supervisor_wall_s"] >= sum(m["buckets"][0]["samples_s"])
        assert m["env"]["device"] == "cpu" and m["env"]["torch"] and m["env"]["dtype"] == "float32"
        assert rec["seconds"] > 0
    # five blocks take longer than one
    assert slow["measurement"]["buckets"][0]["median_s"] > fast["measurement"]["buckets"][0]["median_s"]


def test_candidate_that_raises(blocks_engine):
    cand = _cand(blocks_engine, "raises", "raise RuntimeError('kernel exploded')")
    with blocks_engine.client() as c:
        before = c.status()["engine"]["restarts"]
        res = c.experiment(cand, tiers="fast", reps=5)
    assert not res["ok"]
    rec = res["tiers"]["fast"]
    assert rec["failure"] == "raised" and "kernel exploded" in rec["reason"]
    st = _ok_after(blocks_engine)
    assert st["engine"]["restarts"] == before  # an exception does not need a new worker


@pytest.mark.parametrize("name,body,kind,words,timeout", [
    ("hangs", "import time; time.sleep(3600)", "timeout", "did not finish within 3", 3),
    ("exits", "import os; os._exit(13)", "crashed", "exit code 13", 30),
    ("segfaults", "import ctypes; ctypes.string_at(0)", "crashed", "SIGSEGV", 30),
    ("creeps", "import torch; keep = [torch.ones(1 << 26) for _ in range(400)]", "memory", "over the limit", 60),
])
def test_candidate_that_kills_its_process_costs_only_itself(blocks_engine, name, body, kind, words, timeout):
    cand = _cand(blocks_engine, name, body)
    with blocks_engine.client() as c:
        before = c.status()["engine"]["restarts"]
        res = c.experiment(cand, tiers="fast", reps=5, timeout_s=timeout)
        journal = c.results(request_id=res["request_id"], kind="experiment")["records"]
    assert not res["ok"]
    rec = res["tiers"]["fast"]
    assert rec["failure"] == kind, rec
    assert words in rec["reason"], rec["reason"]
    assert "recovery" not in rec  # the worker was never at risk
    assert journal and journal[-1]["tiers"]["fast"]["failure"] == kind
    st = _ok_after(blocks_engine)
    assert st["engine"]["restarts"] == before
    pid = rec["trial"]["pid"]  # its process is gone, and reaped
    assert str(pid) not in st["worker"]["isolation"]["trials"] and not os.path.exists(f"/proc/{pid}")


def test_a_killed_worker_is_replaced_and_the_kept_candidate_restored(blocks_engine):
    """The worker itself dying (the OOM killer, a kill -9) is what still costs a restart: it is replaced
    between requests and what each tier served comes back."""
    import signal
    import time

    good = _cand(blocks_engine, "keeper_w", "return base(x * 1)")
    with blocks_engine.client() as c:
        res = c.experiment(good, tiers="slow", reps=5, keep=True)
        assert res["ok"], res
        cid = res["candidate"]
        st = c.status()
        before = st["engine"]["restarts"]
        os.kill(st["engine"]["worker_pid"], signal.SIGKILL)
        deadline = time.time() + 120
        while time.time() < deadline:
            st = c.status()
            if st["engine"]["restarts"] > before and "worker" in st and not st.get("busy"):
                break
            time.sleep(0.5)
        assert st["engine"]["restarts"] == before + 1
        assert st["engine"]["recoveries"][-1]["restored"] == {"slow": cid}
        assert st["worker"]["tiers"]["slow"]["current"] == cid
        assert c.revert(tier="slow")["current"] == "baseline"


def test_absurd_allocation_is_a_memory_failure(blocks_engine):
    cand = _cand(blocks_engine, "absurd", "return torch.empty(1 << 50) + base(x)")
    with blocks_engine.client() as c:
        res = c.experiment(cand, tiers="fast", reps=5)
    assert not res["ok"] and res["tiers"]["fast"]["failure"] == "memory", res
    _ok_after(blocks_engine)


@pytest.mark.parametrize("name,body,words", [
    ("nan", "return base(x) * float('nan')", "NaN/Inf"),
    ("zeros", "return torch.zeros_like(base(x))", "all zeros"),
    ("off", "return base(x) + 1e-3", "not bit-exact"),
    ("shape", "return base(x)[:, :-1]", "shape/dtype"),
    ("mutates", "y = base(x); x.add_(1); return y", "input 0 was modified"),
    ("stale", "global CACHE\n        if 'CACHE' not in globals(): CACHE = base(x)\n        return CACHE", "NaN/Inf"),
    ("noisy", "return base(x) + torch.randn_like(base(x)) * 1e-6", "not bit-exact"),
])
def test_wrong_outputs_are_rejected_and_never_swapped_in(blocks_engine, name, body, words):
    cand = _cand(blocks_engine, name, body)
    with blocks_engine.client() as c:
        res = c.experiment(cand, tiers="slow", reps=5)
        journal = c.results(request_id=res["request_id"], kind="experiment")["records"]
    rec = res["tiers"]["slow"]
    assert not res["ok"] and rec["failure"] == "invalid", rec
    assert words in rec["reason"], rec["reason"]
    assert "swap" not in rec and "measurement" not in rec
    assert journal and journal[-1]["ok"] is False and words in journal[-1]["reason"]
    _ok_after(blocks_engine)


def test_tolerance_mode_accepts_small_error_but_not_large(blocks_engine):
    small = _cand(blocks_engine, "tol_small", "return base(x) + 1e-6", exact=False)
    large = _cand(blocks_engine, "tol_large", "return base(x) + 1e-2", exact=False)
    with blocks_engine.client() as c:
        ok = c.experiment(small, tiers="fast", reps=5)
        bad = c.experiment(large, tiers="fast", reps=5)
    assert ok["ok"] and ok["tiers"]["fast"]["validation"]["mode"] == "tolerance", ok
    assert not bad["ok"] and "exceeds the tolerance" in bad["tiers"]["fast"]["reason"]


def test_candidate_that_changes_weights_changes_only_its_own_copy(blocks_engine):
    """Its process holds a copy-on-write copy of the weights: its change is its own (and makes it wrong)."""
    body = "with torch.no_grad():\n            program.model.head.weight.add_(1.0)\n        return base(x)"
    cand = _cand(blocks_engine, "weights", body)
    with blocks_engine.client() as c:
        before = c.status()["engine"]["restarts"]
        res = c.experiment(cand, tiers="slow", reps=5)
    assert not res["ok"], res
    assert res["tiers"]["slow"]["failure"] == "invalid" and "not bit-exact" in res["tiers"]["slow"]["reason"]
    st = _ok_after(blocks_engine)
    assert st["engine"]["restarts"] == before


def test_keep_swap_revert_and_recovery_restores_the_served_candidate(blocks_engine):
    good = _cand(blocks_engine, "keeper", "return base(x + 0)")
    with blocks_engine.client() as c:
        res = c.experiment(good, tiers="slow", reps=5, keep=True)
        assert res["ok"], res
        cid = res["candidate"]
        assert c.status()["worker"]["tiers"]["slow"]["current"] == cid
        # measuring what already serves leaves it serving
        assert c.experiment(good, tiers="slow", reps=5)["ok"]
        assert c.status()["worker"]["tiers"]["slow"]["current"] == cid
        # a crashing candidate now: only its own process goes; the kept candidate never stopped serving
        crash = c.experiment(_cand(blocks_engine, "crash2", "import os; os._exit(9)"), tiers="slow", reps=5)
        assert not crash["ok"] and crash["tiers"]["slow"]["failure"] == "crashed"
        st = c.status()
        assert st["worker"]["tiers"]["slow"]["current"] == cid and st["serving"]["slow"]["current"] == cid
        rev = c.revert(tier="slow")
        assert rev["reverted"] == cid and rev["current"] == "baseline"
        assert c.status()["worker"]["tiers"]["slow"]["current"] == "baseline"


def test_results_are_journaled_before_they_are_acknowledged(blocks_engine):
    with blocks_engine.client() as c:
        res = c.experiment({"baseline": True}, tiers="fast", reps=5, request_id="req-journal-1")
        st = c.status()
    with open(st["engine"]["journal"]) as f:
        lines = [json.loads(line) for line in f]
    mine = [r for r in lines if r.get("request_id") == "req-journal-1"]
    assert [r["kind"] for r in mine] == ["accepted", "experiment"]
    assert mine[-1]["seq"] == res["seq"] and mine[-1]["tiers"]["fast"]["measurement"]["buckets"]


def test_candidate_that_patches_torch_to_fool_the_reference_is_caught(blocks_engine):
    # wrong outputs *and* a patched torch function the reference uses too: the reference runs in another
    # process, which the patch never reaches
    body = ("import torch.nn.functional as F\n        if not hasattr(F, '_orig_silu'):\n"
            "            F._orig_silu = F.silu\n            F.silu = lambda t, inplace=False: F._orig_silu(t) * 1.5\n"
            "        return base(x)")
    cand = _cand(blocks_engine, "patcher", body)
    with blocks_engine.client() as c:
        before = c.status()["engine"]["restarts"]
        res = c.experiment(cand, tiers="slow", reps=5)
    assert not res["ok"] and "not bit-exact" in res["reason"], res
    st = _ok_after(blocks_engine)
    assert st["engine"]["restarts"] == before
