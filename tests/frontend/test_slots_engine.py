"""The engine validates and times a slots Program's decode_slots step, and the objective prices decode at it."""
from __future__ import annotations

import pytest
import torch

from tkcc.errors import EngineError

S = 64  # KV cache positions
B = 2   # slots

# a candidate right in its batch-1 phases and wrong in one row of its slot step only
WRONG_SLOT_ROW = '''
def build(program):
    def slots(ids, pos):
        out = program.graphs["decode_slots"](ids, pos).clone()
        out[1] += 1.0
        return out
    return {"prefill": program.graphs["prefill"], "decode": program.graphs["decode"], "decode_slots": slots}
'''


@pytest.fixture(scope="module")
def slots_program():
    from tkcc.frontend.models import build_model
    from tkcc.frontend.slots import capture_slots

    return capture_slots(build_model("llama-tiny"), B, max_cache_len=S)


@pytest.fixture(scope="module")
def workload():
    from tkcc.compiler import resolve_trace
    from tkcc.traffic.buckets import workload_from_trace

    return workload_from_trace(resolve_trace("azure-conv"), max_context=S - 16, num_buckets=3)


@pytest.fixture(scope="module")
def client(slots_program, tmp_path_factory):
    from tkcc.runtime.local import LocalClient

    c = LocalClient(slots_program, "cpu", state_dir=str(tmp_path_factory.mktemp("engine")))
    yield c
    c.close()


def test_the_workload_gains_a_slot_step_twin_of_each_decode_bucket(slots_program, workload):
    from tkcc.runtime.workloads import check_buckets, default_workload, for_program

    w = for_program(slots_program, workload)
    dec = [(b.context, b.new_tokens, b.weight) for b in w.buckets if b.phase == "decode"]
    twins = [b for b in w.buckets if b.phase == "decode_slots"]
    assert dec and [(b.context, b.new_tokens, b.weight) for b in twins] == dec
    assert {b.batch for b in twins} == {B}
    assert for_program(slots_program, w) is w  # a workload that names the slot step is kept as it is
    check_buckets(slots_program, w)
    assert any(b.phase == "decode_slots" for b in default_workload(slots_program).buckets)
    from dataclasses import replace

    wrong = replace(w, buckets=[replace(twins[0], batch=B + 1)])
    with pytest.raises(EngineError, match=f"decodes {B} slots, not batch {B + 1}"):
        check_buckets(slots_program, wrong)
    far = replace(w, buckets=[replace(twins[0], context=S)])
    with pytest.raises(EngineError, match="max_cache_len"):
        check_buckets(slots_program, far)


def test_the_objective_prices_each_decode_step_at_the_slot_step(slots_program, workload):
    """Fake timings: the objective of a slots workload is the batch-1 one with every decode step costing the
    slot step's time at its context; slower slot steps give a lower P90 decode rate."""
    from dataclasses import replace

    from tkcc.runtime.timing import objective_of
    from tkcc.runtime.workloads import for_program
    from tkcc.traffic import metrics

    w = for_program(slots_program, workload)
    t = {b.key(): 1e-3 * (1 + b.context / 100) for b in w.buckets}
    slow = dict(t, **{b.key(): 5 * t[b.key()] for b in w.buckets if b.phase == "decode_slots"})
    as_decode = {b.key(): slow[replace(b, phase="decode_slots", batch=B).key()] if b.phase == "decode" else slow[b.key()]
                 for b in workload.buckets}
    _, got, why = objective_of(w, slow)
    assert why == "" and got == pytest.approx(metrics.objective(workload, as_decode))
    assert got < objective_of(w, t)[1]


def test_the_engine_validates_and_times_the_slot_step(client, workload):
    from tkcc.runtime.timing import objective_of
    from tkcc.runtime.workloads import for_program

    res = client.experiment({"baseline": True}, tiers="slow", workload=workload, reps=3)
    assert res["ok"], res
    slow = res["tiers"]["slow"]
    checked = [s["bucket"] for s in slow["validation"]["shapes"]]
    assert any(k.startswith(f"decode_slots/b{B}/") for k in checked)
    m = slow["measurement"]
    timed = {b["key"]: b for b in m["buckets"]}
    want = [b.key() for b in for_program(client.core.program, workload).buckets if b.phase == "decode_slots"]
    assert want and all(k in timed and timed[k]["reps"] == 3 and timed[k]["checked"] >= 1 for k in want)
    w = for_program(client.core.program, workload)
    assert m["objective"] == pytest.approx(objective_of(w, {k: b["median_s"] for k, b in timed.items()})[1])


def test_a_candidate_wrong_only_in_its_slot_step_fails_validation(client, workload, tmp_path):
    from tkcc.runtime.client import with_hash

    src = tmp_path / "candidate.py"
    src.write_text(WRONG_SLOT_ROW)
    res = client.experiment(with_hash({"source": str(src)}), tiers="slow", workload=workload, reps=3)
    assert not res["ok"] and "decode_slots" in res["reason"], res


def test_compile_for_a_batch_measures_the_slot_step():
    """tkcc.compile(batch=B) with no search (budget 0): the references are measured at B too."""
    import tkcc
    from tkcc.frontend.models import build_model

    compiled = tkcc.compile(build_model("llama-tiny"), batch=B, max_cache_len=S, budget=0, progress=False)
    rows = compiled.report(print_report=False).speed["buckets"]
    assert any(r["bucket"].startswith(f"decode_slots/b{B}/") for r in rows), [r["bucket"] for r in rows]
