"""A forward run as CUDA-graph replays: captured once per input shape, kept, replayed for validation and swap.

On a GPU a candidate is validated, captured and measured; each used to run the
forward its own way (eager calls in validation, a fresh capture with a warm-up
at swap, replays when measured). ``Replays`` wraps a forward so that the first
call at an input signature (the shapes and dtypes of its inputs: decode at
every context is one signature, since the cache is read in place) captures a
``CapturedCall`` (one warm-up call, on a state put back afterwards, so the
capture does not leave its writes in the KV cache), and every call after that
copies the inputs in and replays it. Validation then runs the candidate the
way it is measured, the reference (also as replays) the way the candidate is
compared with it in the timed calls, and swap reuses the graphs validation
captured instead of capturing again: capture is warmed once per shape.

A forward that cannot be captured at a signature (host synchronisation,
data-dependent shapes) runs eagerly there, and ``notes`` says why. A replay
that changed its inputs is reported as validation reports an eager call that
did (``ValidationFailure``). ``capture`` is the graph factory (the engine's
``CapturedCall``; a test passes one of its own on a CPU).
"""
from __future__ import annotations

import torch

from tkcc.runtime.validation import StateGuard, ValidationFailure, _equal_nan


def signature(inputs: tuple) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype), str(x.device)) if isinstance(x, torch.Tensor) else repr(x)
                 for x in inputs)


class Replays:
    def __init__(self, fn, state, capture, warmup: int = 1):
        self.fn, self.state, self.capture, self.warmup = fn, state, capture, warmup
        self.graphs: dict[tuple, object] = {}  # signature -> captured graph
        self.notes: dict[tuple, str] = {}      # signature -> why it runs eagerly
        self.captures = 0

    def graph_for(self, inputs: tuple):
        """The graph for these inputs' signature (captured now if new), or None where capture failed."""
        from tkcc.kernels.graph_replay import GraphCaptureError

        sig = signature(inputs)
        if sig in self.graphs:
            return self.graphs[sig]
        if sig in self.notes:
            return None
        guard = StateGuard(self.state)
        try:
            g = self.capture(self.fn, inputs, warmup=self.warmup)
        except GraphCaptureError as e:
            self.notes[sig] = f"CUDA graph capture failed ({e}); run eagerly"
            return None
        finally:
            guard.restore()  # the warm-up call's cache writes are not this call's
        self.captures += 1
        self.graphs[sig] = g
        return g

    def __call__(self, *inputs):
        g = self.graph_for(inputs)
        if g is None:
            return self.fn(*inputs)
        outs = g.run(*inputs)
        for j, (s, x) in enumerate(zip(g.static_inputs, inputs)):
            if isinstance(s, torch.Tensor) and not (torch.equal(s, x) or _equal_nan(s, x)):
                raise ValidationFailure(f"input {j} was modified by the forward (its CUDA graph replay)")
        return outs


def replays_of(forwards: dict, state, capture, warmup: int = 1) -> dict:
    """{phase: Replays} over a candidate's (or the reference's) forwards."""
    return {p: Replays(f, state, capture, warmup) for p, f in forwards.items()}
