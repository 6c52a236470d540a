"""``--isolation inprocess`` (what a GPU engine runs): candidate code runs in the worker, which audits its global
state after each operation against a snapshot taken before any candidate was loaded.

What can be put back is, and the candidate is refused (it was timed or checked under the change); what
cannot (a dispatcher registration, a live thread, memory left where dropping the candidate's modules does
not free it) restarts the worker, charged to the candidate that did it. After each, an honest candidate
validates and measures as before. One engine on the small residual-MLP model serves the file.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine_helpers import BLOCKS_MODEL, start_engine, stop_engine  # noqa: E402

NOISE = 2.0
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


def _honest(eng) -> float:
    res = _run(eng, "honest", "return base(x)")
    assert res["ok"], res
    return res["tiers"]["fast"]["measurement"]["buckets"][0]["median_s"]


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
    assert engine.honest / NOISE <= _honest(engine) <= engine.honest * NOISE


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
    assert engine.honest / NOISE <= _honest(engine) <= engine.honest * NOISE


def test_memory_kept_in_its_module_is_charged_to_the_candidate_and_given_back_in_place(engine):
    with engine.client() as c:
        before = c.status()["engine"]["restarts"]
    res = _run(engine, "keeps_memory", "global KEEP\n        KEEP = [torch.ones(1 << 26)]\n        return base(x)")
    assert not res["ok"] and res["unload"]["failure"] == "memory", res
    assert "host memory is" in res["reason"] and "MiB above" in res["reason"], res["reason"]
    assert "dropping its modules" in res["reason"], res["reason"]
    with engine.client() as c:
        assert c.status()["engine"]["restarts"] == before
    assert engine.honest / NOISE <= _honest(engine) <= engine.honest * NOISE


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
