"""Timing of one forward per workload bucket. Semantics: see ``tkcc.runtime.measurement``.

The clocks are bound when this module is imported, in the engine worker,
before any candidate code is loaded; candidates only ever receive inputs.
"""
from __future__ import annotations

import time

import torch

from tkcc.runtime.measurement import BucketTiming, ci_tight
from tkcc.runtime.validation import ValidationFailure, tensors_of
from tkcc.runtime.workloads import input_bucket, serving_view

_perf_counter_ns = time.perf_counter_ns
_Event = torch.cuda.Event if hasattr(torch, "cuda") else None


def bucket_inputs(program, bucket, gen, rotations: int) -> list[tuple]:
    return [program.inputs(bucket.phase, input_bucket(bucket), gen) for _ in range(rotations)]


class _Clock:
    """Timed calls of one forward on rotated input sets: eager (CPU or GPU), a CUDA-graph replay, or a call into
    a candidate's trial process (``tkcc.runtime.trial.RemoteBench``: the same callable interface, timed here).

    ``warm(n)`` runs unrecorded calls, ``take(n)`` returns n samples in seconds; the rotation over the
    input sets continues across calls, so chunks of an adaptive run see the same sequence as one run.
    A graph replay's input copies stay outside the timed region.

    ``refresh(args)``, when given, writes fresh values into an input set before each call (outside the timed
    region), so no call repeats the inputs of another and neither a cache keyed by address nor one keyed by
    content can serve it. ``check(args, outputs)`` is called after the recorded calls whose index is in
    ``sample``, and by ``finish()`` after the last one, with that call's inputs and outputs (untimed).
    """

    def __init__(self, fn, graph, input_sets: list[tuple], device: torch.device, refresh=None, check=None,
                 sample=(), clock=None):
        self.fn, self.graph, self.sets, self.device = fn, graph, input_sets, device
        self.now = clock or _perf_counter_ns  # ns; a test passes a fake clock
        self.refresh, self.check, self.sample = refresh, check, set(sample)
        self.i = 0
        self.recorded = 0
        self.last = None          # (args, outputs) of the last recorded call
        self.last_checked = True
        self.checked = 0

    def _next(self) -> tuple:
        args = self.sets[self.i % len(self.sets)]
        self.i += 1
        if self.refresh is not None:
            self.refresh(args)
        if self.check is not None:  # what the call was given, kept out of its reach for the check
            self.given = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        return args

    def _outputs(self, out):
        return self.graph.static_outputs if self.graph is not None else out

    def _after(self, args, out) -> None:
        idx = self.recorded
        self.recorded += 1
        self.last, self.last_checked = (args, getattr(self, "given", args), out), False
        if self.check is not None and idx in self.sample:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._check()

    def _check(self) -> None:
        args, given, out = self.last
        for j, (a, g) in enumerate(zip(args, given)):
            if isinstance(a, torch.Tensor) and not torch.equal(a, g):
                raise ValidationFailure(f"a timed call modified its input {j} (the reference is computed on the "
                                        "inputs it was given)")
        self.check(given, tensors_of(self._outputs(out)))
        self.checked += 1
        self.last_checked = True

    def finish(self) -> None:
        """Check the last recorded call too (its outputs are still in place): a forward that turns wrong after
        its first calls is caught however many calls the adaptive rule asked for."""
        if self.check is not None and self.last is not None and not self.last_checked:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._check()

    def warm(self, n: int) -> None:
        with torch.no_grad():
            for _ in range(n):
                args = self._next()
                if self.graph is not None:
                    self.graph.load(*args)
                    self.graph.replay()
                else:
                    self.fn(*args)

    def take(self, n: int) -> list[float]:
        if n <= 0:
            return []
        fn, graph = self.fn, self.graph
        with torch.no_grad():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                starts = [_Event(enable_timing=True) for _ in range(n)]
                ends = [_Event(enable_timing=True) for _ in range(n)]
                for i in range(n):
                    args = self._next()
                    out = None
                    if graph is not None:
                        graph.load(*args)
                        starts[i].record()
                        graph.replay()
                    else:
                        starts[i].record()
                        out = fn(*args)
                    ends[i].record()
                    self._after(args, out)
                torch.cuda.synchronize(self.device)
                return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
            samples, now = [], self.now
            for _ in range(n):
                args = self._next()
                t0 = now()
                out = fn(*args)
                samples.append((now() - t0) / 1e9)
                self._after(args, out)
            return samples


def time_eager(fn, input_sets: list[tuple], reps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds per call: perf_counter_ns on CPU, CUDA events on GPU (launch overhead included)."""
    clock = _Clock(fn, None, input_sets, device)
    clock.warm(warmup)
    return clock.take(reps)


def time_graph(graph, input_sets: list[tuple], reps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds per CUDA-graph replay, CUDA events around the replay only (input copies stay outside)."""
    clock = _Clock(None, graph, input_sets, device)
    clock.warm(warmup)
    return clock.take(reps)


# ------------------------------------------------------------------------ adaptive repetitions
def _alone(tight: bool) -> bool:
    return tight


def timed_samples(clock: _Clock, reps: int, warmup: int, min_reps: int | None = None,
                  ci_rel: float = 0.0, agree=_alone) -> tuple[list[float], str]:
    """Samples of one bucket and why timing stopped.

    ``warmup`` unrecorded calls, then at least ``min_reps`` and at most ``reps`` recorded ones: after
    ``min_reps``, in chunks of ``min_reps // 2`` (at least 2), timing stops as soon as the 95 %
    confidence interval of the median lies within +-``ci_rel`` of it (``"ci"``), else at ``reps``
    (``"max_reps"``). ``min_reps`` None or >= ``reps``, or ``ci_rel`` <= 0: exactly ``reps`` (``"fixed"``).
    ``agree(tight) -> bool`` makes the decision common to every rank of a tensor-parallel group (it is
    called at the same points on every rank, so their forwards, and collectives, stay paired).
    """
    clock.warm(warmup)
    if min_reps is None or min_reps >= reps or ci_rel <= 0:
        samples, stop = clock.take(reps), "fixed"
    else:
        min_reps = max(1, min_reps)
        samples = clock.take(min_reps)
        chunk = max(2, min_reps // 2)
        while True:
            if agree(ci_tight(samples, ci_rel)):
                stop = "ci"
                break
            if len(samples) >= reps:
                stop = "max_reps"
                break
            samples += clock.take(min(chunk, reps - len(samples)))
    clock.finish()
    return samples, stop


def time_bucket(fn, graph, program, bucket, gen, reps: int, warmup: int, rotations: int,
                device: torch.device, note: str = "", min_reps: int | None = None,
                ci_rel: float = 0.0, agree=_alone, sets: list[tuple] | None = None, refresh=None, check=None,
                sample=(), outputs: list | None = None) -> BucketTiming:
    """One bucket's timing: fresh rotated inputs (``sets``, or drawn here), warm-up, then fixed or adaptive
    repetitions; ``refresh``/``check``/``sample``: see ``_Clock``. A forward in a trial process
    (``fn.bench``) is timed across the process boundary, its outputs in slots shaped like ``outputs``."""
    sets = bucket_inputs(program, bucket, gen, rotations) if sets is None else sets
    session = fn.bench(sets, outputs) if hasattr(fn, "bench") else None
    try:
        clock = _Clock(session or fn, graph, session.sets if session is not None else sets, device, refresh, check,
                       sample)
        samples, stop = timed_samples(clock, reps, warmup, min_reps, ci_rel, agree)
    finally:
        if session is not None:
            session.close()
    bt = BucketTiming.from_samples(bucket.key(), bucket.phase, bucket.weight, samples, graph is not None, note,
                                   stop=stop, warmup=warmup)
    bt.checked = clock.checked
    return bt


def objective_of(workload, medians: dict[str, float]) -> tuple[str, float | None, str]:
    """The workload-weighted objective from per-bucket median seconds (``tkcc.traffic.metrics``).

    Returns (name, value, note): value None with the reason when the objective
    does not apply (e.g. a hand-built workload without a request mix); the
    per-bucket timings still stand.
    """
    from tkcc.errors import TkccError
    from tkcc.traffic import metrics

    try:
        return workload.objective, float(metrics.objective(*serving_view(workload, medians))), ""
    except TkccError as e:
        return workload.objective, None, f"objective not computed: {e}"
