"""Cost model terms on hand-computed cases, ranking, extrapolation, op counts, machine cache."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tkcc.parallel.cost import count_ops, estimate_ops, expected_busiest_pairs, predict, rank_layouts
from tkcc.parallel.layout import ModelDims
from tkcc.parallel.machine import CollectiveFit, MachineProfile, _fit, load_profiles, machine_profile, save_profile

DENSE = ModelDims(name="hand", family="llama", layers=2, hidden=4, heads=4, kv_heads=2, head_dim=1, vocab=8,
                  intermediate=6)
MOE = ModelDims(name="hand-moe", family="mixtral", layers=2, hidden=4, heads=4, kv_heads=4, head_dim=1, vocab=8,
                intermediate=0, experts=4, top_k=2, expert_intermediate=6)


def machine(lat_us=10.0, busbw=1.0, bw=1.0, dispatch=2.0, kernel=1.0, degrees=(2,)):
    return MachineProfile(device="hand", count=max(degrees), mem_bw_gbs=bw, dispatch_us=dispatch, kernel_us=kernel,
                          all_reduce={str(d): {"eager": {"lat_us": lat_us, "busbw_gbs": busbw, "mode": "eager"}}
                                      for d in degrees})


def test_dense_terms_by_hand():
    p = predict(DENSE, 2, "tp", machine(), batch=1, context=10, ops={"host_ops": 100, "kernels": 50})
    # weights: q 4x4 + k 4x2 + v 4x2 + o 4x4 = 48 params, x2 layers = 96; MLP 3x4x6 x2 = 144; lm_head 8x4 = 32
    # -> 272 params x 2 bytes / 2 ranks = 272 bytes at 1 GB/s
    assert p.bytes["weights"] == pytest.approx(272)
    assert p.terms["weights_ms"] == pytest.approx(272e-6)
    # KV: 2 (k,v) x 2 layers x 1 kv head per rank x 1 x 10 positions x 2 bytes = 80, x (1 + 2x2) GQA copy = 400
    assert p.bytes["kv"] == pytest.approx(400)
    assert p.terms["kv_ms"] == pytest.approx(400e-6)
    # 4 all-reduces of 8 bytes: 10 us + 8 * 2(1)/2 / 1e3 us each
    assert p.counts["all_reduce"] == 4
    assert p.terms["all_reduce_ms"] == pytest.approx(4 * (10 + 0.008) / 1e3)
    # logits gather: 10 us + 8 vocab x 2 bytes x 1/2 / 1e3
    assert p.terms["all_gather_ms"] == pytest.approx((10 + 0.008) / 1e3)
    # ops: 100 + (2x4 collective+wait, 5 gather glue) host; 50 + 4 + 2 kernels
    assert p.counts["host_ops"] == 113 and p.counts["kernels"] == 56
    assert p.terms["kernels_ms"] == pytest.approx(0.056)
    assert p.terms["host_ms"] == pytest.approx(0.226)
    device = sum(v for k, v in p.terms.items() if k != "host_ms")
    assert p.ms_per_token == pytest.approx(max(device, 0.226))
    g = predict(DENSE, 2, "tp", machine(), batch=1, context=10, ops={"host_ops": 100, "kernels": 50},
                mode="cuda_graph")
    assert g.ms_per_token == pytest.approx(device)


def test_degree_one_has_no_collectives_and_full_weights():
    p = predict(DENSE, 1, "tp", machine(), batch=1, context=10, ops={"host_ops": 100, "kernels": 50})
    assert p.bytes["weights"] == pytest.approx(544)
    assert p.terms["all_reduce_ms"] == 0 and p.terms["all_gather_ms"] == 0
    assert p.counts["host_ops"] == 100


def test_moe_expert_terms_tp_vs_ep():
    one_expert = 3 * 4 * 6 * 2  # gate, up, down: 144 params x 2 bytes
    tp = predict(MOE, 2, "tp", machine(), batch=1, context=10)
    # 2 layers x 2 pairs x expert/2 x 3 (read, copy, read of the gathered weights)
    assert tp.bytes["experts"] == pytest.approx(2 * 2 * one_expert / 2 * 3)
    ep = predict(MOE, 2, "tp_ep", machine(), batch=1, context=10)
    # 2 picks of 4 experts, 2 per rank: both on one rank with prob 2/6 -> E[max] = 4/3
    assert expected_busiest_pairs(4, 2, 1, 2, trials=20000) == pytest.approx(4 / 3, abs=0.02)
    # the masked EP graph gathers all 2 pairs per layer at full size on every rank
    assert ep.bytes["experts"] == pytest.approx(2 * 2 * one_expert * 3)
    assert ep.bytes["experts"] > tp.bytes["experts"]
    assert any("busiest rank" in n for n in ep.notes)
    # a skewed routing that keeps every pick on rank 0's experts: busiest rank takes all pairs
    assert expected_busiest_pairs(4, 2, 3, 2, probs=[1, 1, 1e-12, 1e-12]) == pytest.approx(6)


def test_extrapolated_degrees_say_so():
    m = machine(degrees=(2,))
    p4 = predict(dataclasses.replace(MOE, expert_intermediate=8), 4, "tp", m, batch=1, context=10)
    assert any("extrapolated from d=2" in n for n in p4.notes)
    fit, how = m.fit(4)
    assert fit.lat_us == pytest.approx(30.0) and how.startswith("extrapolated")
    fit2, how2 = m.fit(2)
    assert fit2.lat_us == 10.0 and how2 == "measured"


def test_ranking_follows_the_dominant_cost():
    big = ModelDims(name="big", family="llama", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64,
                    vocab=128256, intermediate=8192)
    ops = {"host_ops": 1000, "kernels": 600}
    slow_links = machine(lat_us=5000.0, busbw=1.0, bw=3000.0, kernel=0.0, degrees=(2, 4, 8))
    best = rank_layouts(big, slow_links, batch=1, context=2048, ops=ops, mode="cuda_graph")[0]
    assert best.degree == 1
    fast_links = machine(lat_us=1.0, busbw=500.0, bw=3000.0, kernel=0.0, degrees=(2, 4, 8))
    ranked = rank_layouts(big, fast_links, batch=1, context=2048, ops=ops, mode="cuda_graph")
    assert ranked[0].degree == 8
    assert [p.ms_per_token for p in ranked] == sorted(p.ms_per_token for p in ranked)
    # at 1 device only degree 1 is legal
    assert [(p.degree, p.strategy) for p in rank_layouts(big, fast_links, devices=1, ops=ops)] == [(1, "tp")]


def test_collective_fit_recovers_latency_and_bandwidth():
    true = CollectiveFit(lat_us=12.0, busbw_gbs=80.0)
    samples = [(n, true.time_us(n, 2)) for n in (4096, 65536, 1 << 20, 16 << 20)]
    lat, bw = _fit(samples, 2)
    assert lat == pytest.approx(12.0, rel=1e-6) and bw == pytest.approx(80.0, rel=1e-6)


def test_machine_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TKCC_CACHE_DIR", str(tmp_path))
    p = machine_profile(measure_collectives_too=False)
    assert p.mem_bw_gbs > 0 and p.dispatch_us > 0 and p.kernel_us > 0
    data = json.loads((tmp_path / "machine.json").read_text())
    assert list(data) == [p.key] and p.key == "cpu x1"
    again = machine_profile(measure_collectives_too=False)
    assert again.measured_at == p.measured_at and again.mem_bw_gbs == p.mem_bw_gbs  # from the cache
    other = MachineProfile(device="NVIDIA H200", count=2, mem_bw_gbs=4000, dispatch_us=5, kernel_us=2)
    save_profile(other)
    assert set(load_profiles()) == {"cpu x1", "NVIDIA H200 x2"}


def test_measured_gloo_all_reduce_fit():
    from tkcc.parallel.machine import measure_collectives

    fits = measure_collectives(2, timeout_s=120)
    f = fits["eager"]
    assert f["lat_us"] > 0 and f["busbw_gbs"] > 0 and len(f["samples"]) >= 2


def test_op_estimates_match_a_fresh_capture():
    from tkcc.frontend.hf import capture_hf
    from tkcc.frontend.models import build_model
    from tkcc.parallel.layout import dims_from_config

    model = build_model("llama-tiny", dtype=torch.bfloat16, num_hidden_layers=2)
    prog = capture_hf(model, max_cache_len=16, phases=["decode"])
    assert count_ops(prog.graphs["decode"]) == estimate_ops(dims_from_config(model.config, "llama-tiny"))


def test_workload_prediction_weights_decode_buckets():
    from tkcc.parallel.cost import predict_workload
    from tkcc.traffic.workload import Bucket, Workload

    wl = Workload(buckets=[Bucket("prefill", 1, 512, 0, 0.5), Bucket("decode", 1, 100, 16, 0.3),
                           Bucket("decode", 1, 1000, 16, 0.1)])
    m = machine()
    got = predict_workload(DENSE, 2, "tp", m, wl, ops={"host_ops": 100, "kernels": 50}, mode="cuda_graph")
    a = predict(DENSE, 2, "tp", m, batch=1, context=100, ops={"host_ops": 100, "kernels": 50}, mode="cuda_graph")
    b = predict(DENSE, 2, "tp", m, batch=1, context=1000, ops={"host_ops": 100, "kernels": 50}, mode="cuda_graph")
    assert got.ms_per_token == pytest.approx(0.75 * a.ms_per_token + 0.25 * b.ms_per_token)
    # 40 KV bytes per cached position on each rank (see test_dense_terms_by_hand), weights 0.3:0.1 -> 0.75:0.25
    assert got.bytes["kv"] == pytest.approx(0.75 * 4000 + 0.25 * 40000)


def test_per_op_terms_by_hand():
    """With the per-op numbers measured: GEMV fixed cost, attention floor, GQA K/V materialisation, top-k."""
    m = dataclasses.replace(machine(bw=1.0, kernel=1.0), stream_bw_gbs=2.0, gemv_us=4.0, attn_floor_us=3.0,
                            expand_copy_gbs=0.5, topk_us=5.0)
    ops = {"host_ops": 100, "kernels": 50, "gemv": 10}
    p = predict(DENSE, 1, "tp", m, batch=1, context=10, ops=ops, mode="cuda_graph")
    # weights 544 B at 2 GB/s = 272 ns, + 10 GEMVs x (4 - 1) us
    assert p.terms["weights_ms"] == pytest.approx(272e-6 + 30e-3)
    # cache: 2 x 2 layers x 2 kv heads x 1 x 10 x 2 B = 160 B; attention reads it x2 (n_rep) = 320 B: 80 ns per
    # layer at 2 GB/s, under the 3 us floor -> 2 x 3 us; the copy reads + writes 2 x 160 x 2 = 640 B at 0.5 GB/s
    assert p.terms["kv_ms"] == pytest.approx(6e-3 + 640 / 0.5e9 * 1e3)
    assert p.terms["topk_ms"] == 0  # dense: no router
    assert any("GQA" in n for n in p.notes)
    long = predict(DENSE, 1, "tp", m, batch=1, context=100_000, ops=ops, mode="cuda_graph")
    read = 2 * 2 * 2 * 100_000 * 2 * 2  # bandwidth-bound now: 1.6 MB per layer pair
    assert long.terms["kv_ms"] == pytest.approx(read / 2e9 * 1e3 + 2 * read / 0.5e9 * 1e3)
    moe = predict(MOE, 1, "tp", m, batch=1, context=10, ops=ops, mode="cuda_graph")
    assert moe.terms["topk_ms"] == pytest.approx(2 * (5.0 - 1.0) / 1e3)


def test_op_costs_need_a_gpu():
    from tkcc.parallel.machine import measure_op_costs

    assert measure_op_costs(torch.device("cpu")) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_op_costs_on_a_gpu_are_plausible():
    from tkcc.parallel.machine import measure_op_costs

    c = measure_op_costs(torch.device("cuda", 0))
    assert c["stream_bw_gbs"] > 100 and 0 < c["expand_copy_gbs"] < 2 * c["stream_bw_gbs"]
    assert c["gemv_us"] >= 0 and c["attn_floor_us"] > 0 and c["topk_us"] > 0
