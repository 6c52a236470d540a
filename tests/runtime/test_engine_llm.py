"""The engine on a real captured HF model (olmoe-tiny, CPU): tiers, plans compiled per tier, measurement,
swap/revert, greedy generation, and bad input answered over RPC while the engine keeps serving."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tkcc.errors import EngineError
from tkcc.runtime.engine import MIN_REPS

pytestmark = pytest.mark.timeout(300)

PLAN = [{"name": "dce", "params": {}}, {"name": "cse", "params": {}}]


def test_status_reports_tiers_sharing_one_model(llm_engine):
    with llm_engine.client() as c:
        st = c.status()
    w = st["worker"]
    assert w["model"] == "olmoe-tiny" and w["num_blocks"] == 4 and set(w["phases"]) == {"prefill", "decode"}
    assert w["tiers"]["fast"]["blocks"] == 1 and w["tiers"]["slow"]["blocks"] == 4  # max(1, 4 // 5)
    assert w["tiers"]["fast"]["fingerprint"] != w["tiers"]["slow"]["fingerprint"]
    assert w["max_cache_len"] == 128 and w["memory"]["model_bytes"] > 0


def test_plan_is_compiled_for_each_tier_validated_and_measured(llm_engine):
    with llm_engine.client() as c:
        res = c.experiment({"plan": PLAN}, tiers="both", reps=30)
    assert res["ok"], res
    fast, slow = res["tiers"]["fast"], res["tiers"]["slow"]
    assert fast["load"]["info"]["plan_hash"] == slow["load"]["info"]["plan_hash"]
    assert fast["load"]["info"]["artifact_hash"] != slow["load"]["info"]["artifact_hash"]
    for rec in (fast, slow):
        v = rec["validation"]
        assert v["ok"] and v["mode"] == "exact" and len(v["shapes"]) >= 3
        assert {s["bucket"].split("/")[0] for s in v["shapes"]} == {"prefill", "decode"}
        m = rec["measurement"]
        assert m["objective_name"] == "p90_decode_tokens_per_s" and m["objective"] > 0
        for b in m["buckets"]:  # adaptive: up to 30, fewer where the median's interval was tight (the noise)
            assert (b["stop"] == "max_reps" and b["reps"] == 30) or (b["stop"] == "ci" and MIN_REPS <= b["reps"] <= 30), b
    fd = {b["key"]: b["median_s"] for b in fast["measurement"]["buckets"]}
    sd = {b["key"]: b["median_s"] for b in slow["measurement"]["buckets"]}
    decode = [k for k in fd if k.startswith("decode")]
    assert sum(fd[k] for k in decode) < sum(sd[k] for k in decode)  # 1 block vs 4


def test_swap_keeps_greedy_tokens_and_revert_restores_the_baseline(llm_engine):
    with llm_engine.client() as c:
        before = c.generate([3, 1, 4, 1, 5], n=6)
        res = c.experiment({"plan": PLAN}, tiers="slow", reps=5, keep=True)
        assert res["ok"], res
        after = c.generate([3, 1, 4, 1, 5], n=6)
        assert after["candidate"] == res["candidate"] and after["tokens"] == before["tokens"]
        rev = c.revert(tier="slow")
        assert rev["current"] == "baseline"
        assert c.generate([3, 1, 4, 1, 5], n=6)["candidate"] == "baseline"


def test_a_ship_validates_and_keeps_without_measuring_again(llm_engine):
    """The campaign's ship (keep, measure=False): validated on fresh inputs, swapped in and serving, no measurement
    (its confirmation measured it); measure=False without keep is refused, since it would do nothing."""
    from tkcc.errors import EngineError

    with llm_engine.client() as c:
        res = c.experiment({"plan": PLAN}, tiers="slow", keep=True, measure=False)
        assert res["ok"], res
        rec = res["tiers"]["slow"]
        assert rec["validation"]["ok"] and "measurement" not in rec and rec["swap"]
        assert c.generate([3, 1, 4], n=3)["candidate"] == res["candidate"]
        assert c.revert(tier="slow")["current"] == "baseline"
        with pytest.raises(EngineError, match="only ships"):
            c.experiment({"plan": PLAN}, tiers="slow", measure=False)


def _still_serving(c):
    assert c.ping()["pong"]
    assert c.experiment({"baseline": True}, tiers="fast", reps=3)["ok"]


@pytest.mark.parametrize("params,words", [
    ({"model": "no-such-model"}, "unknown model 'no-such-model'"),
    ({"model": "llama-tiny"}, "this engine serves model 'olmoe-tiny', not 'llama-tiny'"),
    ({"device": "cuda:7"}, "cuda:7"),
    ({"device": "tpu"}, "not a valid torch device"),
    ({"workload": {"buckets": [{"phase": "decode", "batch": 1, "context": 5000, "new_tokens": 8}]}},
     "max_cache_len=128"),
    ({"workload": {"buckets": [{"phase": "decode", "batch": 4, "context": 8, "new_tokens": 8}]}},
     "exceeds the engine's batch 1"),
    ({"workload": {"buckets": [{"phase": "train", "batch": 1}]}}, "phase 'train' is not served"),
    ({"workload": {"buckets": [{"phase": "decode", "context": -3}]}}, "non-negative integer"),
    ({"tiers": "medium"}, "unknown tier 'medium'"),
])
def test_bad_input_gets_a_clear_error_and_the_engine_keeps_serving(llm_engine, params, words):
    with llm_engine.client() as c:
        kw = {"candidate": {"baseline": True}, "tiers": "fast", "reps": 3, **params}
        try:
            res = c.call("experiment", **kw)
        except EngineError as e:
            msg = str(e)
        else:
            assert not res["ok"], res
            msg = res["reason"]
        assert words in msg, msg
        _still_serving(c)


def test_artifacts_for_another_tier_or_model_or_tampered_are_refused(llm_engine, tmp_path):
    from tkcc.codegen.artifact import MANIFEST, artifact_hash

    with llm_engine.client() as c:
        loaded = c.load({"plan": PLAN}, tiers="both")
        fast_art = loaded["fast"]["info"]["artifact"]
        slow_art = loaded["slow"]["info"]["artifact"]
        # the right artifact for the tier loads and validates
        ok = c.experiment({"artifact": slow_art}, tiers="slow", reps=3)
        assert ok["ok"], ok
        wrong_tier = c.experiment({"artifact": fast_art}, tiers="slow", reps=3)
        assert not wrong_tier["ok"] and "built for the fast tier" in wrong_tier["reason"]
        # another model: same files, a manifest (consistently re-hashed) naming another program
        other = tmp_path / "other-model"
        shutil.copytree(slow_art, other)
        man = json.loads((other / MANIFEST).read_text())
        man["fingerprint"] = "0123456789abcdef"
        man["artifact_hash"] = artifact_hash(man)
        (other / MANIFEST).write_text(json.dumps(man))
        res = c.experiment({"artifact": str(other)}, tiers="slow", reps=3)
        assert not res["ok"] and "built for another model" in res["reason"], res
        # tampered: a file changed after the manifest was written
        bad = tmp_path / "tampered"
        shutil.copytree(slow_art, bad)
        fwd = next(p for p in os.listdir(bad) if p.startswith("forward_"))
        with open(bad / fwd, "a") as f:
            f.write("\n# changed\n")
        res = c.experiment({"artifact": str(bad)}, tiers="slow", reps=3)
        assert not res["ok"] and res["tiers"]["slow"]["failure"] == "refused", res
        # an expected hash that does not match
        res = c.experiment({"artifact": slow_art, "hash": "f" * 32}, tiers="slow", reps=3)
        assert not res["ok"] and "is not the expected" in res["reason"]
        _still_serving(c)


SWAP_TOP2 = '''
def build(program):
    def wrap(f):
        def forward(ids, pos):
            out = f(ids, pos).clone()
            top2 = out.topk(2, dim=-1).indices
            first, second = out.gather(-1, top2[..., :1]), out.gather(-1, top2[..., 1:])
            out.scatter_(-1, top2[..., :1], second)
            out.scatter_(-1, top2[..., 1:], first)
            return out
        return forward
    return {p: wrap(program.graphs[p]) for p in ("prefill", "decode")}
'''

NUDGE = '''
def build(program):
    return {p: (lambda f: lambda ids, pos: f(ids, pos) + 1e-6)(program.graphs[p]) for p in ("prefill", "decode")}
'''


def test_tolerance_mode_requires_identical_greedy_tokens(llm_engine):
    nudge = {"source": llm_engine.source("nudge", NUDGE), "exact": False}
    swap = {"source": llm_engine.source("swap_top2", SWAP_TOP2), "exact": False, "atol": 100.0}
    with llm_engine.client() as c:
        ok = c.experiment(nudge, tiers="fast", reps=3)
        bad = c.experiment(swap, tiers="fast", reps=3)
    v = ok["tiers"]["fast"]["validation"]
    assert ok["ok"] and v["mode"] == "tolerance" and v["greedy"]["tokens"] >= 1, ok
    assert not bad["ok"] and "greedy tokens differ" in bad["reason"], bad
