"""Timing of one forward per workload bucket. Semantics: see ``tkcc.runtime.measurement``.

The clocks are bound when this module is imported, in the engine worker,
before any candidate code is loaded; candidates only ever receive inputs.
"""
from __future__ import annotations

import time

import torch

from tkcc.runtime.measurement import BucketTiming

_perf_counter_ns = time.perf_counter_ns
_Event = torch.cuda.Event if hasattr(torch, "cuda") else None


def bucket_inputs(program, bucket, gen, rotations: int) -> list[tuple]:
    b = bucket if bucket.shapes or bucket.phase in ("prefill", "decode") else None
    return [program.inputs(bucket.phase, b, gen) for _ in range(rotations)]


def time_eager(fn, input_sets: list[tuple], reps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds per call: perf_counter_ns on CPU, CUDA events on GPU (launch overhead included)."""
    n = len(input_sets)
    with torch.no_grad():
        for i in range(warmup):
            fn(*input_sets[i % n])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            starts = [_Event(enable_timing=True) for _ in range(reps)]
            ends = [_Event(enable_timing=True) for _ in range(reps)]
            for i in range(reps):
                starts[i].record()
                fn(*input_sets[i % n])
                ends[i].record()
            torch.cuda.synchronize(device)
            return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
        out = []
        for i in range(reps):
            args = input_sets[i % n]
            t0 = _perf_counter_ns()
            fn(*args)
            out.append((_perf_counter_ns() - t0) / 1e9)
        return out


def time_graph(graph, input_sets: list[tuple], reps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds per CUDA-graph replay, CUDA events around the replay only (input copies stay outside)."""
    n = len(input_sets)
    for i in range(warmup):
        graph.load(input_sets[i % n])
        graph.replay()
    torch.cuda.synchronize(device)
    starts = [_Event(enable_timing=True) for _ in range(reps)]
    ends = [_Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        graph.load(input_sets[i % n])
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


def time_bucket(fn, graph, program, bucket, gen, reps: int, warmup: int, rotations: int,
                device: torch.device, note: str = "") -> BucketTiming:
    sets = bucket_inputs(program, bucket, gen, rotations)
    if graph is not None:
        samples = time_graph(graph, sets, reps, warmup, device)
    else:
        samples = time_eager(fn, sets, reps, warmup, device)
    return BucketTiming.from_samples(bucket.key(), bucket.phase, bucket.weight, samples, graph is not None, note)


def objective_of(workload, medians: dict[str, float]) -> tuple[str, float | None, str]:
    """The workload-weighted objective from per-bucket median seconds (``tkcc.traffic.metrics``).

    Returns (name, value, note): value None with the reason when the objective
    does not apply (e.g. a hand-built workload without a request mix); the
    per-bucket timings still stand.
    """
    from tkcc.errors import TkccError
    from tkcc.traffic import metrics

    try:
        return workload.objective, float(metrics.objective(workload, medians)), ""
    except TkccError as e:
        return workload.objective, None, f"objective not computed: {e}"
