"""``Replays``: a forward captured once per input shape, replayed after; the warm-up's state writes undone.

CUDA graphs need a GPU; the graph here is a stand-in with the same contract as ``CapturedCall`` (static
inputs cloned at capture, warm-up calls, ``run`` copies the inputs in and recomputes the outputs), so what is
tested is the bookkeeping: one capture per signature, the state put back, the eager fallback, and an input
the replay changed refused. The GPU path is ``tests/runtime/test_engine_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch

from tkcc.kernels.graph_replay import GraphCaptureError
from tkcc.runtime.replays import Replays, signature
from tkcc.runtime.validation import ValidationFailure


class State(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(8))


class StandIn:
    made = 0

    def __init__(self, fn, inputs, warmup=1):
        StandIn.made += 1
        self.fn = fn
        self.static_inputs = tuple(x.clone() for x in inputs)
        for _ in range(warmup):
            fn(*self.static_inputs)
        self.static_outputs = None

    def run(self, *inputs):
        for s, x in zip(self.static_inputs, inputs):
            s.copy_(x)
        self.static_outputs = [self.fn(*self.static_inputs)]
        return self.static_outputs


def test_one_capture_per_shape_and_the_warm_up_leaves_no_state():
    state = State()

    def step(tok, pos):
        state.cache[int(pos)] = tok.float().sum()  # a decode step writes its position
        return tok * 2

    r = Replays(step, state, StandIn)
    StandIn.made = 0
    out = r(torch.tensor([3]), torch.tensor(2))
    assert torch.equal(out[0], torch.tensor([6])) and float(state.cache[2]) == 3.0
    state.cache.zero_()
    r(torch.tensor([5]), torch.tensor(4))  # another context, the same shapes: replayed, not captured
    assert StandIn.made == 1 and r.captures == 1 and float(state.cache[4]) == 5.0
    r(torch.tensor([5, 6]), torch.tensor(1))  # another shape: a second graph
    assert StandIn.made == 2 and len(r.graphs) == 2
    before = state.cache.clone()
    r2 = Replays(step, state, StandIn)
    r2.graph_for((torch.tensor([9]), torch.tensor(7)))  # capture only: its warm-up wrote position 7
    assert torch.equal(state.cache, before)  # ... and was put back
    assert signature((torch.zeros(2), 3)) == signature((torch.ones(2), 3)) != signature((torch.zeros(3), 3))


def test_a_forward_that_cannot_be_captured_runs_eagerly_and_says_why():
    def no_capture(fn, inputs, warmup=1):
        raise GraphCaptureError("host synchronisation")

    calls = []
    r = Replays(lambda x: calls.append(1) or x + 1, None, no_capture)
    assert torch.equal(r(torch.ones(2)), torch.full((2,), 2.0)) and r(torch.ones(2)) is not None
    assert len(calls) == 2 and "host synchronisation" in next(iter(r.notes.values()))


def test_a_replay_that_changes_its_inputs_is_refused():
    def rewrites(x):
        x.add_(1)
        return x * 1

    r = Replays(rewrites, None, StandIn, warmup=0)
    with pytest.raises(ValidationFailure, match="input 0 was modified"):
        r(torch.zeros(3))
