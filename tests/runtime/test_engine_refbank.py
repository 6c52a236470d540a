"""Validation with the reference bank: the reference runs once per draw, and nothing wrong gets through.

On a captured llama-tiny (CPU, fp32): the reference's calls are counted; a second candidate is validated on
kept draws without calling it; a candidate is never validated twice on one draw; an entry is replaced after
its uses; wrong outputs and wrong cache writes are still refused against kept results; and the kept results
equal what the reference computes again.
"""
from __future__ import annotations

import pytest
import torch

from tkcc.runtime.refbank import Entry, ReferenceBank, state_diff
from tkcc.runtime.validation import StateGuard, pick_buckets, tensors_of, validate
from tkcc.runtime.workloads import default_workload


@pytest.fixture(scope="module")
def program():
    from tkcc.frontend.capture import capture_model

    return capture_model("llama-tiny", max_cache_len=32)


class Counted:
    """The reference's forwards, counting their calls."""

    def __init__(self, graphs):
        self.calls = 0
        self.fns = {p: self._wrap(g) for p, g in graphs.items()}

    def _wrap(self, g):
        def fn(*a):
            self.calls += 1
            return g(*a)
        return fn


def _validate(program, ref, cand, bank, cid, seed):
    buckets = pick_buckets(default_workload(program), 4)
    return validate(program, ref.fns, cand, buckets, True, 1e-4, 1e-4, seed, bank=bank, tier="fast/exact",
                    candidate_id=cid)


def test_the_reference_runs_once_per_draw_and_each_candidate_sees_fresh_draws(program):
    ref = Counted(program.graphs)
    n = len(pick_buckets(default_workload(program), 4))
    bank = ReferenceBank(entries=2, uses=3)
    honest = dict(program.graphs)
    a = _validate(program, ref, honest, bank, "cand-a", 1)
    assert a["ok"], a["reason"]
    assert ref.calls == n  # one reference call per bucket, before any candidate code
    b = _validate(program, ref, honest, bank, "cand-b", 2)
    assert b["ok"] and ref.calls == n  # the second candidate: kept draws, no reference call
    assert all(sh.get("reference") == "kept from an earlier draw" for sh in b["shapes"])
    again = _validate(program, ref, honest, bank, "cand-a", 3)
    assert again["ok"] and ref.calls == 2 * n  # never twice on one draw: cand-a gets fresh ones
    for i, cid in enumerate(("cand-c", "cand-d", "cand-e")):  # two kept draws per bucket, 3 uses each: 6 in all
        assert _validate(program, ref, honest, bank, cid, 4 + i)["ok"]
    assert ref.calls == 2 * n
    f = _validate(program, ref, honest, bank, "cand-f", 9)  # every kept draw is used up: fresh ones
    assert f["ok"] and ref.calls == 3 * n
    assert bank.stats["hits"] >= 3 * n


def test_wrong_outputs_and_wrong_cache_writes_are_refused_against_kept_results(program):
    ref = Counted(program.graphs)
    bank = ReferenceBank()
    assert _validate(program, ref, dict(program.graphs), bank, "honest", 7)["ok"]
    calls = ref.calls

    def off_by_a_bit(g):
        def fn(*a):
            out = tensors_of(g(*a))
            return tuple(o + 1e-3 if o.is_floating_point() else o for o in out)
        return fn

    def forgets_cache(g):
        def fn(*a):
            before = [b.clone() for b in program.state.buffers()]
            out = g(*a)
            with torch.no_grad():
                for b, s in zip(program.state.buffers(), before):
                    b.copy_(s)
            return out
        return fn

    wrong = _validate(program, ref, {p: off_by_a_bit(g) for p, g in program.graphs.items()}, bank, "wrong", 8)
    assert not wrong["ok"] and "not bit-exact" in wrong["reason"]
    lazy = _validate(program, ref, {p: forgets_cache(g) for p, g in program.graphs.items()}, bank, "lazy", 9)
    assert not lazy["ok"] and "cache state" in lazy["reason"]
    assert ref.calls == calls  # both judged against kept results


def test_kept_results_equal_the_reference_run_again(program):
    bank = ReferenceBank()
    _validate(program, Counted(program.graphs), dict(program.graphs), bank, "a", 10)
    (tier_key, entries), *_ = [(k, v) for k, v in bank.banks.items() if "decode" in k[1]]
    b = next(x for x in pick_buckets(default_workload(program), 4) if x.key() == tier_key[1])
    from tkcc.runtime.validation import _draw_inputs

    for e in entries:
        inputs = _draw_inputs(program, b, e.seed)
        guard = StateGuard(program.state)
        with torch.no_grad():
            out = [t.clone() for t in tensors_of(program.graphs[b.phase](*inputs))]
        after = guard.current()
        guard.restore()
        assert all(torch.equal(x, y) for x, y in zip(out, e.outputs))
        assert all(torch.equal(x, y) for x, y in zip(after, e.state_after(guard.saved)))


def test_state_diff_round_trip_and_wipe():
    before = [torch.zeros(4, 5), torch.arange(6.0)]
    after = [before[0].clone(), before[1].clone()]
    after[0][2, 3] = 7.0
    after[1][0] = float("nan")
    e = Entry(1, [torch.ones(3)], state_diff(before, after))
    rebuilt = e.state_after(before)
    assert torch.equal(rebuilt[0], after[0]) and torch.isnan(rebuilt[1][0]) and torch.equal(rebuilt[1][1:],
                                                                                           after[1][1:])
    bank = ReferenceBank()
    assert bank.add("fast/exact", "decode/b1", "x", e)
    out = e.outputs[0]
    bank.wipe()
    assert not bank.banks and float(out.abs().sum()) == 0.0
