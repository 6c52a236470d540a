"""``--isolation inprocess`` (what a GPU engine runs): candidate code runs in the worker, which audits its global
state after each operation against a snapshot taken before any candidate was loaded.

What can be put back is, and the candidate is refused (it was timed or checked under the change); what
cannot (a dispatcher registration, a live thread, memory left where dropping the candidate's modules does
not free it) restarts the worker, charged to the candidate that did it. After each, an honest candidate
validates and measures as before. One engine on the small residual-MLP model serves the file.

"Measures as before" is checked on what does not depend on the machine's load: the honest candidate is
timed in full, on the same environment (thread count, dtype, device) and workload, with every sample above
zero (the worker's clock ticks) and all of them within the supervisor's own wall time of the measurement
(``timing_consistent``: the supervisor's clock is out of the candidate's reach), and nothing was restored
around it. How fast it ran is not compared: on a loaded machine the same forward times differently from one
run to the next, and speed belongs in benchmarks/.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine_helpers import BLOCKS_MODEL, start_engine, stop_engine  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("inprocess"), BLOCKS_MODEL, "--isolation", "inprocess", "--threads",
                       "1", "--timeout", "60")
    try:
        eng.honest = _honest(eng)
        yield eng
    finally:
        stop_engine(eng)


def _run(eng, name, body, **kw):
    with eng.client() as c:
        return c.experiment({"source": eng.forward_source(name, body)}, tiers="fast", reps=20, **kw)


def _honest(eng) -> dict:
    """An honest candidate validates and is measured soundly; returns what must be the same the next time."""
    res = _run(eng, "honest", "return base(x)")
    assert res["ok"], res
    fast = res["tiers"]["fast"]
    assert "failure" not in fast and fast["validation"]["ok"], fast
    m = fast["measurement"]
    assert "tampered" not in m and "audit" not in m, m  # the audit found nothing to put back around it
    assert m["checks"]["ok"] and m["timing_consistent"], m
    for b in m["buckets"]:
        assert b["reps"] == len(b["samples_s"]) and 0 < b["reps"] <= 20, b
        assert b["stop"] in ("ci", "max_reps") and all(s > 0 for s in b["samples_s"]), b  # the clock ticks
        assert b["min_s"] <= b["median_s"] and sum(b["samples_s"]) <= m["supervisor_wall_s"], (b, m)
        assert b["checked"] >= 1 and m["checks"]["calls_checked"][b["key"]] == b["checked"], (b, m)  # outputs held
    return {"env": m["env"], "workload": m["workload_fingerprint"], "objective": m["objective_name"],
            "validation": [(v["bucket"], v["mode"], v["max_abs_err"]) for v in fast["validation"]["shapes"]],
            "buckets": [(b["key"], b["warmup"], b["cuda_graph"]) for b in m["buckets"]]}


RESTORED = {  # changes the audit puts back: the candidate is refused, the worker goes on
    "patches_torch": ("import torch.nn.functional as F\n        torch.matmul = lambda a, b: a\n"
                      "        F.silu = lambda t, inplace=False: t\n        return base(x)", "torch.matmul"),
    "patches_the_timer": ("import tkcc.runtime.timing as t\n        t._perf_counter_ns = lambda: 0\n        return base(x)",
                          "_perf_counter_ns"),
    "flips_flags": ("torch.backends.mkldnn.enabled = False\n        torch.set_flush_denormal(True)\n"
                    "        torch.set_num_threads(2)\n        return base(x)", "mkldnn.enabled"),
    "default_dtype": ("torch.set_default_dtype(torch.float64)\n        return base(x)", "default_dtype"),
    "patches_code": ("import tkcc.runtime.validation as v\n        v.compare.__code__ = (lambda *a, **k: 0.0).__code__\n"
                     "        return base(x)", "compare"),
}
RESTARTED = {  # changes that cannot be proven undone: the worker is replaced
    "registers_a_kernel": ("global LIB\n        LIB = torch.library.Library('aten', 'IMPL')\n"
                           "        LIB.impl('silu', lambda t: t, 'CPU')\n        return base(x)", "dispatcher"),
    "leaks_a_thread": ("import threading, time\n        threading.Thread(target=lambda: time.sleep(3600), daemon=True)"
                       ".start()\n        return base(x)", "thread"),
    "hides_memory": ("import collections\n        collections._tkcc_keep = [torch.ones(1 << 26)]\n"
                     "        return base(x)", "MiB above"),  # outside its module: dropping its modules cannot free it
}


@pytest.mark.parametrize("name", sorted(RESTORED))
def test_a_change_the_audit_puts_back_refuses_the_candidate_and_the_worker_goes_on(engine, name):
    body, words = RESTORED[name]
    with engine.client() as c:
        before = c.status()["engine"]["restarts"]
    res = _run(engine, name, body)
    assert not res["ok"] and res["tiers"]["fast"]["failure"] == "tampered", res
    assert "global state" in res["reason"] and words in res["reason"], res["reason"]
    with engine.client() as c:
        assert c.status()["engine"]["restarts"] == before
    assert _honest(engine) == engine.honest  # validates and measures as before


@pytest.mark.parametrize("name", sorted(RESTARTED))
def test_a_change_that_cannot_be_undone_restarts_the_worker_charged_to_the_candidate(engine, name):
    body, words = RESTARTED[name]
    with engine.client() as c:
        before = c.status()["engine"]["restarts"]
    res = _run(engine, name, body)
    assert not res["ok"] and words in res["reason"], res
    with engine.client() as c:
        st = c.status()
    assert st["engine"]["restarts"] == before + 1
    assert st["engine"]["recoveries"][-1]["reason"].count(words) or words in res["reason"]
    assert _honest(engine) == engine.honest  # validates and measures as before


def test_memory_kept_in_its_module_is_charged_to_the_candidate_and_given_back_in_place(engine):
    with engine.client() as c:
        before = c.status()["engine"]["restarts"]
    res = _run(engine, "keeps_memory", "global KEEP\n        KEEP = [torch.ones(1 << 26)]\n        return base(x)")
    assert not res["ok"] and res["unload"]["failure"] == "memory", res
    assert "host memory is" in res["reason"] and "MiB above" in res["reason"], res["reason"]
    assert "dropping its modules" in res["reason"], res["reason"]
    with engine.client() as c:
        assert c.status()["engine"]["restarts"] == before
    assert _honest(engine) == engine.honest  # validates and measures as before


def test_honest_candidates_pass_the_audit(engine):
    """No false alarms: plans through the passes and codegen, and a source candidate, leave nothing behind."""
    from tkcc.compiler import default_plan

    with engine.client() as c:
        before = c.status()["engine"]["restarts"]
        for spec in ({"plan": [{"name": "dce"}, {"name": "cse"}]}, {"plan": default_plan().to_json()},
                     {"source": engine.forward_source("honest_again", "y = base(x)\n        return y")}):
            res = c.experiment(spec, tiers="both", reps=10)
            assert res["ok"], res
        assert c.status()["engine"]["restarts"] == before


def test_what_serves_already_is_not_charged_for_what_its_first_run_leaves(engine):
    """A candidate loaded with ``serving`` (a watcher's reference: it serves already) opens no memory account, so
    the host memory its first run leaves (on a GPU: kernels compiled and CUDA modules loaded once per process)
    stays the worker's: measured, unloaded, no restart. The same memory left by a candidate loaded without it
    restarts the worker (``hides_memory`` above)."""
    body = "import collections\n        collections._tkcc_warm = [torch.ones(1 << 25)]\n        return base(x)"
    spec = {"source": engine.forward_source("serving_warms", body)}
    with engine.client() as c:
        before = c.status()["engine"]["restarts"]
        c.load(spec, tiers="fast", serving=True)
        res = c.experiment(spec, tiers="fast", reps=10)
        st = c.status()
    assert res["ok"], res
    fast = res["tiers"]["fast"]
    assert fast["measurement"]["objective"] > 0 and "failure" not in fast, fast
    assert "unload" not in res, res["unload"]  # its unload charged nothing (else: failure "memory")
    assert st["engine"]["restarts"] == before
