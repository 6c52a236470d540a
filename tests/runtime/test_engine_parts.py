"""The engine's parts without an engine: frames, journal, statistics, workloads on the wire, validation checks."""
from __future__ import annotations

import json
import socket
import statistics

import pytest
import torch

from tkcc.errors import EngineError
from tkcc.runtime import protocol
from tkcc.runtime.journal import Journal
from tkcc.runtime.measurement import BucketTiming, Measurement
from tkcc.runtime.validation import ValidationFailure, compare, greedy_tokens, weights_checksum
from tkcc.runtime.workloads import workload_from_json, workload_to_json
from tkcc.traffic.workload import Bucket, Workload


def test_frames_round_trip_and_limits():
    a, b = socket.socketpair()
    try:
        msg = {"token": "t", "method": "status", "params": {"x": [1, 2.5, "é"]}}
        protocol.send_frame(a, msg)
        assert protocol.recv_frame(b, 1 << 20) == msg
        protocol.send_frame(a, {"big": "x" * 1000})
        with pytest.raises(protocol.FrameTooLarge, match="exceeds the limit of 100 bytes"):
            protocol.recv_frame(b, 100)
        with pytest.raises(protocol.FrameTooLarge):
            protocol.send_frame(a, {"big": "x" * 1000}, limit=100)
    finally:
        a.close()
        b.close()
    a, b = socket.socketpair()
    try:
        a.sendall(b"\x00\x00\x00\x10{\"to")  # promises 16 bytes, sends 4, hangs up
        a.close()
        with pytest.raises(EngineError, match="connection closed after 4 of 16 bytes"):
            protocol.recv_frame(b, 1 << 20)
        with pytest.raises(protocol.ConnectionClosed):
            protocol.recv_frame(b, 1 << 20)
    finally:
        b.close()


def test_token_comparison():
    assert protocol.token_ok("abc", "abc")
    for bad in ("abd", "", None, 5, ["abc"], "abcd"):
        assert not protocol.token_ok(bad, "abc")


def test_loopback_detection():
    assert protocol.is_loopback("127.0.0.1") and protocol.is_loopback("::1") and protocol.is_loopback("localhost")
    assert not protocol.is_loopback("0.0.0.0") and not protocol.is_loopback("10.1.2.3")


def test_journal_survives_a_torn_line_and_reopens_with_the_next_sequence(tmp_path):
    path = str(tmp_path / "j.jsonl")
    j = Journal(path)
    r1 = j.append("experiment", request_id="a", ok=True)
    r2 = j.append("recovery", recovery_s=1.5)
    j.close()
    with open(path, "a") as f:
        f.write('{"seq": 3, "kind": "exper')  # a crash mid-write
    j2 = Journal(path)
    assert [r["seq"] for r in j2.records()] == [r1["seq"], r2["seq"]]
    r3 = j2.append("experiment", request_id="b")
    assert r3["seq"] == 3
    assert [r["request_id"] for r in j2.records(kind="experiment")] == ["a", "b"]
    assert j2.records(request_id="b")[0]["seq"] == 3 and j2.records(since=2)[0]["seq"] == 3


def test_bucket_statistics_against_the_definitions():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 30, 101):
        xs = (torch.rand(n, generator=g) * 1e-3).tolist()
        bt = BucketTiming.from_samples("k", "decode", 0.5, xs, False)
        assert bt.median_s == statistics.median(xs) and bt.reps == n and bt.min_s == min(xs)
        assert bt.mad_s == statistics.median(abs(x - bt.median_s) for x in xs)
        if n >= 2:
            q = statistics.quantiles(xs, n=4, method="inclusive")
            assert bt.iqr_s == pytest.approx(q[2] - q[0])
    m = Measurement("c", "fast", 1, [bt], "mean_latency_s", 1.0, "fp", {"ok": True}, {"device_name": "cpu"})
    assert Measurement.from_json(json.loads(json.dumps(m.to_json()))) == m


def test_workload_round_trips_with_fingerprint_and_rejects_bad_fields():
    w = Workload([Bucket("prefill", 1, 32, 0, 0.3), Bucket("decode", 1, 40, 16, 0.7)], mix=[(32, 16, 1.0)],
                 representative=[(32, 16)])
    d = json.loads(json.dumps(workload_to_json(w)))
    back = workload_from_json(d)
    assert back.fingerprint() == w.fingerprint() and back.mix == w.mix
    d["buckets"][0]["context"] = 33
    with pytest.raises(EngineError, match="does not match its contents"):
        workload_from_json(d)
    for bad, words in (({"buckets": [{"phase": "decode", "colour": 1}]}, "unknown field"),
                       ({"buckets": [{"phase": "decode", "batch": "1"}]}, "non-negative integer"),
                       ({"buckets": [{"batch": 1}]}, "expected an object with 'phase'"),
                       ({"buckets": "decode"}, "non-empty list")):
        with pytest.raises(EngineError, match=words):
            workload_from_json(bad)
    shapes = Workload.from_shapes([({"x": (2, 8)}, 1.0)])
    assert workload_from_json(workload_to_json(shapes)).buckets == shapes.buckets


def test_compare_exact_and_tolerance_reference_by_hand():
    g = torch.Generator().manual_seed(1)
    for shape in ((3,), (2, 5), (1, 4, 7)):
        ref = torch.randn(*shape, generator=g)
        assert compare([ref], [ref.clone()], True, 0, 0, "x") == 0.0
        off = ref + 1e-6
        with pytest.raises(ValidationFailure, match="not bit-exact"):
            compare([ref], [off], True, 0, 0, "x")
        assert compare([ref], [off], False, 1e-4, 1e-4, "x") == pytest.approx((off - ref).abs().max().item())
        with pytest.raises(ValidationFailure, match="exceeds atol"):
            compare([ref], [ref + 1e-2], False, 1e-4, 1e-4, "x")
        nan = ref.clone()
        nan.view(-1)[0] = float("nan")
        with pytest.raises(ValidationFailure, match="NaN/Inf"):
            compare([ref], [nan], False, 1, 1, "x")
        with pytest.raises(ValidationFailure, match="all zeros"):
            compare([ref], [torch.zeros_like(ref)], False, 10, 10, "x")
    logits = torch.tensor([[[0.1, 0.9, 0.0], [0.5, 0.2, 0.3]]])
    assert greedy_tokens([logits]).tolist() == [0]


def test_weights_checksum_sees_any_single_change():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    base = weights_checksum(m)
    with torch.no_grad():
        for p in m.parameters():
            for idx in (0, p.numel() - 1):
                old = p.view(-1)[idx].clone()
                p.view(-1)[idx] = old + 1
                assert weights_checksum(m) != base
                p.view(-1)[idx] = old
    assert weights_checksum(m) == base


def test_objective_from_the_traffic_metrics_or_a_stated_reason():
    from tkcc.runtime.timing import objective_of
    from tkcc.traffic import metrics

    w = Workload([Bucket("prefill", 1, 32, 0, 0.2), Bucket("decode", 1, 32, 8, 0.4), Bucket("decode", 1, 39, 8, 0.4)],
                 mix=[(32, 8, 1.0)])
    med = {"prefill/b1/c32/n0": 0.01, "decode/b1/c32/n8": 0.002, "decode/b1/c39/n8": 0.003}
    name, value, note = objective_of(w, med)
    assert name == "p90_decode_tokens_per_s" and note == ""
    assert value == metrics.objective(w, med)
    # TPOT lies between the two decode step times, so tokens/s between their inverses
    assert 1 / 0.003 <= value <= 1 / 0.002
    name, value, note = objective_of(Workload(w.buckets), med)  # no request mix: stated, not raised
    assert value is None and "objective not computed" in note


def test_weights_checksum_names_reordered_rows_and_repointed_storage():
    from tkcc.runtime.validation import changed_weight

    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)).to(torch.bfloat16)
    base = weights_checksum(m)
    assert changed_weight(base, weights_checksum(m)) is None
    w = m[0].weight
    old = w.data
    with torch.no_grad():
        w.data = old[torch.tensor([1, 0, 2, 3, 4, 5])].contiguous()  # two rows swapped: same sums of all bits
    why = changed_weight(base, weights_checksum(m))
    assert why and "0.weight" in why and "re-pointed" in why
    with torch.no_grad():
        old.copy_(old[torch.tensor([1, 0, 2, 3, 4, 5])])  # swapped in place, same storage
        w.data = old
    why = changed_weight(base, weights_checksum(m))
    assert why == "0.weight has other values (rows reordered)"
