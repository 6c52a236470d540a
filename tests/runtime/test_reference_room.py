"""The device-memory cap leaves the model's own reference the room it needs at a workload's shapes
(``DeviceBudget.reference``), on a CPU with a fake device; and ``validate`` runs its reference through it."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_device  # noqa: E402
from fake_device import GiB, FakeDevice  # noqa: E402

from tkcc.runtime import device_memory as dm  # noqa: E402


def _started(total=80 * GiB, resident=3 * GiB, model_bytes=GiB):
    dev = FakeDevice(total=total)
    dev.others = total - 10 * GiB  # another process holds most of the device: the limit is the model's own rule
    keep = dev.alloc(resident)
    b = dm.DeviceBudget.start(dev, 0, model_bytes=model_bytes, device="cuda:0")
    return dev, keep, b


def test_a_reference_within_the_headroom_leaves_the_limit_as_it_was():
    dev, keep, b = _started()
    limit = b.limit  # 3 GiB resident + the 2 GiB floor

    def run():
        scratch = dev.alloc(GiB // 2)  # 2x of it fits in the headroom
        return scratch.nbytes

    assert b.reference(run) == GiB // 2
    assert b.limit == limit and "raised" not in b.how
    assert dev.fraction() == pytest.approx(limit / dev.total)


def test_a_reference_whose_transient_needs_more_raises_the_limit_to_twice_it():
    dev, keep, b = _started()
    assert b.limit == 5 * GiB

    def run():  # fits under the cap (1.5 GiB of the 2 left), but a candidate at twice it would not
        scratch = dev.alloc(3 * GiB // 2)
        return scratch.nbytes

    b.reference(run, what="bucket prefill/b1/c10000")
    assert b.limit == 3 * GiB + 3 * GiB
    assert "raised 5.00 -> 6.00 GiB for the reference at bucket prefill/b1/c10000" in b.how
    assert dev.fraction() == pytest.approx(6 / 80)
    ok = dev.alloc(3 * GiB - 1)  # a candidate now has the room: up to the new limit
    with pytest.raises(fake_device.OutOfMemoryError):
        dev.alloc(2)  # and the cap is still in force past it
    del ok


def test_a_reference_that_runs_out_under_the_cap_runs_again_with_room_and_its_state_put_back():
    dev, keep, b = _started()
    calls, resets = [], []

    def run():
        calls.append(1)
        scratch = dev.alloc(4 * GiB)  # more than the 2 GiB the cap leaves: the first run fails
        return scratch.nbytes

    assert b.reference(run, reset=lambda: resets.append(1), what="bucket x") == 4 * GiB
    assert len(calls) == 2 and len(resets) == 1
    assert b.limit == 3 * GiB + 8 * GiB and "raised" in b.how
    assert dev.fraction() == pytest.approx(11 / 80)


def test_the_room_never_passes_the_device_less_its_reserve_and_a_reference_too_big_for_it_fails():
    dev, keep, b = _started(total=8 * GiB, resident=3 * GiB)

    def run():
        scratch = dev.alloc(3 * GiB)
        return scratch.nbytes

    b.reference(run)
    assert b.limit == 8 * GiB - dm.reserve_of(8 * GiB)

    def too_big():
        return dev.alloc(6 * GiB)

    with pytest.raises(fake_device.OutOfMemoryError):
        b.reference(too_big)
    assert dev.fraction() == pytest.approx(b.limit / dev.total)  # the cap is back on after the failure


def test_a_limit_the_user_gave_is_not_raised():
    dev = FakeDevice(total=80 * GiB)
    keep = dev.alloc(3 * GiB)
    b = dm.DeviceBudget.start(dev, 4 * GiB, model_bytes=GiB)

    def run():
        return dev.alloc(2 * GiB)

    with pytest.raises(fake_device.OutOfMemoryError):
        b.reference(run)
    assert b.limit == 4 * GiB and b.how == "--device-max-mem"
    del keep


def test_validate_runs_each_first_reference_run_through_the_room():
    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model
    from tkcc.runtime.validation import validate
    from tkcc.runtime.workloads import default_workload

    model = build_model("llama-tiny", torch.float32, "cpu")
    prog = capture(model, phases=["decode"], max_cache_len=32)
    fwd = prog.graphs["decode"]
    seen = []

    held = []

    def room(run, reset, what, holds):
        seen.append(what)
        out = run()
        held.append((holds(out), sum(t.numel() * t.element_size() for t in out[0])))
        return out

    buckets = default_workload(prog).buckets[:2]
    res = validate(prog, {"decode": fwd}, {"decode": fwd}, buckets, True, 0.0, 0.0, seed=0, room=room)
    assert res["ok"], res["reason"]
    assert seen == [f"bucket {b.key()}" for b in buckets]
    from tkcc.runtime.validation import HELD_COPIES

    assert held and all(h == HELD_COPIES * n and n > 0 for h, n in held)  # the logits' copies validation keeps


def test_the_room_after_a_reference_counts_what_validation_holds_beside_a_candidate():
    """A served 16k-token prompt's logits are 4 GB: validation keeps the candidate's two runs and their clones
    beside the reference's, so a correct candidate ran out under a cap sized for the reference alone."""
    dev, keep, b = _started()
    assert b.limit == 5 * GiB

    def run():  # 1 GiB of output, 0.25 GiB more transient: within the cap on its own
        scratch = dev.alloc(GiB // 4)
        out = dev.alloc(GiB)
        del scratch
        return out

    out = b.reference(run, what="bucket prefill/b1/c16000", holds=lambda o: 4 * o.nbytes)
    # live 3 GiB + 2x its transient peak (1.25 GiB) + 4 GiB held beside a candidate
    assert b.limit == 3 * GiB + 2 * (5 * GiB // 4) + 4 * GiB
    assert "4.00 GiB held beside a candidate" in b.how
    held = [dev.alloc(GiB) for _ in range(4)]  # what validation keeps ...
    cand = dev.alloc(5 * GiB // 4)  # ... and a candidate as large as the reference fits beside them
    del held, cand, out


def test_a_long_context_decode_bucket_joins_the_validation_when_the_workload_stays_short():
    """An artifact serves every position of its cache: where the workload's decode buckets reach less than half
    of it, the engine's validation (on a GPU) also judges a decode step at the cache's last position."""
    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model
    from tkcc.runtime.validation import long_context_bucket, pick_buckets, validate
    from tkcc.runtime.workloads import default_workload
    from tkcc.traffic.workload import Bucket

    model = build_model("llama-tiny", torch.float32, "cpu")
    prog = capture(model, max_cache_len=96)
    short = [Bucket("prefill", 1, 8, 1, 1.0), Bucket("decode", 1, 20, 1, 1.0)]
    b = long_context_bucket(prog, short)
    assert (b.phase, b.batch, b.context, b.weight) == ("decode", 1, 95, 0.0)
    assert long_context_bucket(prog, short[:1] + [Bucket("decode", 1, 48, 1, 1.0)]) is None  # reaches half already
    assert long_context_bucket(prog, short[:1]) is None  # no decode bucket: nothing to extend
    # the step at that position is judged like any other (the captured graph against itself here)
    buckets = pick_buckets(default_workload(prog), 4) + [b]
    res = validate(prog, prog.graphs, prog.graphs, buckets, True, 0.0, 0.0, seed=1)
    assert res["ok"], res["reason"]
    assert any(sh["bucket"] == b.key() for sh in res["shapes"])

    def off_at_the_end(ids, pos):  # a step wrong only near the end of the cache is caught there
        out = prog.graphs["decode"](ids, pos)
        return out + (pos.max() > 64).to(out.dtype)

    bad = validate(prog, prog.graphs, {**prog.graphs, "decode": off_at_the_end}, buckets, True, 0.0, 0.0, seed=1)
    assert not bad["ok"] and b.key() in bad["reason"]
