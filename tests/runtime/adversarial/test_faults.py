"""Candidates that fault: the engine survives each, and the next honest candidate validates and measures within
noise of its value before the faults (measured in the same engine, the same run).

What a fault damages is its own process (docs/engine.md, "Isolation"): it is killed with its process group,
orphans it leaves are killed, and the worker, which never runs candidate code, is never restarted.
"""
from __future__ import annotations

import os
import time

import pytest


pytestmark = [pytest.mark.serial, pytest.mark.timeout(300)]

FAULTS = {
    "raises": dict(body="raise RuntimeError('kernel exploded')", failure="raised", words="kernel exploded"),
    "hangs": dict(body="time.sleep(3600)", failure="timeout", words="did not finish within 3", timeout_s=3),
    "oom_at_once": dict(body="return f(ids, pos) + torch.empty(1 << 50)", failure="memory", words=""),
    "oom_by_growth": dict(body="""
        STATE.setdefault("keep", []).extend(torch.ones(1 << 25) for _ in range(64))   # 8 GiB, 128 MiB at a time
        return f(ids, pos)
    """, failure="memory", words="over the limit"),
    "kills_itself": dict(body="os.kill(os.getpid(), 9)", failure="crashed", words="SIGKILL"),
    "segfaults": dict(setup="import ctypes", body="ctypes.string_at(0)", failure="crashed", words="SIGSEGV"),
    "patches_torch": dict(setup="""
        import torch.nn.functional as F
        torch.matmul = lambda a, b: torch.zeros(())
        F.silu = lambda t, inplace=False: t
        torch.Tensor.__add__ = lambda a, b: torch.sub(a, b)
        LIB = torch.library.Library("aten", "IMPL")
        LIB.impl("linear", lambda x, w, b=None: torch.zeros(*x.shape[:-1], w.shape[0]), "CPU")
    """, body="return f(ids, pos)", failure="invalid", words="output"),
    "patches_the_timer": dict(setup="""
        import tkcc.runtime.timing as timing
        timing._perf_counter_ns = lambda: (_ for _ in ()).throw(RecursionError("patched clock"))
        time.perf_counter_ns = timing._perf_counter_ns
    """, body="return f(ids, pos)", failure=None, words=""),
    "leaks_in_a_thread": dict(setup="""
        def _leak():
            keep = []
            while True:                                  # grows, and burns a core, until its process is gone
                keep.append(torch.ones(1 << 20))
                time.sleep(0.001)
        threading.Thread(target=_leak, daemon=True).start()
    """, body="return f(ids, pos)", failure="any", words=""),
    "flips_global_flags": dict(setup="""
        torch.backends.mkldnn.enabled = False
        torch.set_flush_denormal(True)
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(2)
    """, body="return f(ids, pos)", failure="any", words=""),
    "holds_memory_after_memoryerror": dict(body="""
        STATE["held"] = torch.ones(1 << 26)              # 256 MiB it keeps
        raise MemoryError("pretend the next allocation failed")
    """, failure="memory", words="MemoryError"),
    "leaves_an_orphan": dict(setup="""
        _pid_file = "ORPHAN_PID_FILE"                   # the test puts its own path here
        if os.fork() == 0:                              # a double fork: the grandchild tries to outlive its parent
            if os.fork() == 0:
                with open(_pid_file + ".tmp", "w") as fh:
                    fh.write(str(os.getpid()))
                os.replace(_pid_file + ".tmp", _pid_file)
                while True:
                    pass
            os._exit(0)
        while not os.path.exists(_pid_file):            # the candidate fails only once its grandchild is known
            time.sleep(0.01)
    """, body="raise RuntimeError('leaving something behind')", failure="raised", words="leaving"),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_the_engine_survives_a_fault_and_the_next_honest_candidate_measures_as_before(adversary, name, tmp_path):
    fault = dict(FAULTS[name])
    failure, words, timeout = fault.pop("failure"), fault.pop("words"), fault.pop("timeout_s", None)
    pid_file = tmp_path / "orphan.pid"
    if name == "leaves_an_orphan":
        fault["setup"] = fault["setup"].replace('"ORPHAN_PID_FILE"', repr(str(pid_file)))
    with adversary.eng.client() as c:
        before = c.status()["engine"]
    res = adversary.run({"source": adversary.source(f"fault_{name}", **fault)},
                        **({"timeout_s": timeout} if timeout else {}))
    rec = res["tiers"]["fast"]
    if failure is None:
        assert res["ok"], rec
    elif failure != "any":
        assert not res["ok"] and rec["failure"] == failure and words in rec["reason"], rec
    honest = adversary.honest()
    assert adversary.measures_as_before(), (name, honest, adversary.seen)
    with adversary.eng.client() as c:
        st = c.status()
    assert st["engine"]["restarts"] == before["restarts"], st["engine"]["recoveries"]  # the worker was never at risk
    assert set(st["worker"]["isolation"]["trials"].values()) == {"baseline"}  # the fault's process is gone
    if name == "leaves_an_orphan":
        end = time.time() + 10
        while time.time() < end and not pid_file.exists():
            time.sleep(0.05)
        orphan = int(pid_file.read_text())
        while time.time() < end and _alive(orphan):
            time.sleep(0.05)
        assert not _alive(orphan), f"the candidate's grandchild {orphan} outlived it"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_kept_candidate_that_leaks_while_idle_is_killed_and_its_tier_falls_back(adversary):
    """The memory limit holds between requests too: the worker's watchdog kills a kept candidate whose thread
    grows past it while nothing is asked of the engine, the tier goes back to the baseline, and the journal says
    why. The leak is charged to that candidate; the next candidate measures as before."""
    setup = """
        def _later():
            time.sleep(2.0)                               # after its experiment, while it serves, idle
            keep = []
            while True:
                keep.append(torch.ones(1 << 24))          # 64 MiB every 20 ms
                time.sleep(0.02)
        threading.Thread(target=_later, daemon=True).start()
    """
    res = adversary.run({"source": adversary.source("idle_leak", setup=setup, body="return f(ids, pos)")}, keep=True)
    assert res["ok"], res
    cid = res["candidate"]
    with adversary.eng.client() as c:
        assert c.status()["serving"]["fast"]["current"] == cid
        end = time.time() + 30
        while time.time() < end:
            lost = [r for r in c.results(kind="trial_lost")["records"] if r.get("candidate") == cid]
            if lost:
                break
            time.sleep(0.5)
        assert lost and "over the limit" in lost[-1]["reason"], lost
        st = c.status()
    assert st["serving"]["fast"]["current"] == "baseline" and st["worker"]["tiers"]["fast"]["current"] == "baseline"
    assert cid not in st["worker"]["isolation"]["trials"].values()
    honest = adversary.honest()
    assert adversary.measures_as_before(), (honest, adversary.seen)
