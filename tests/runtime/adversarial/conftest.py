"""One engine (llama-tiny on CPU, the default process isolation) for the cheat and fault suites.

``honest`` is the reference candidate: it wraps the captured forwards and changes nothing. Each suite
measures it first, and every honest measurement after a cheat or a fault is held to it (the same engine,
the same run, side by side).
"""
from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine_helpers import start_engine, stop_engine  # noqa: E402

ARGS = ("--max-cache-len", "64", "--threads", "1", "--timeout", "60", "--trial-max-rss", "0.5")
NOISE = 2.0  # measured within noise: within this factor of the honest candidate, on a shared 2-core machine

# A source candidate: build(program) wraps each phase's captured graph ``f`` in forward(ids, pos) = BODY.
TEMPLATE = '''
import os, threading, time
import torch
STATE = {{}}
{setup}

def build(program):
    vocab = int(program.meta["vocab_size"])
    cache = list(program.state.buffers())

    def make(phase, f):
        def forward(ids, pos):
{body}
        return forward

    return {{p: make(p, program.graphs[p]) for p in ("prefill", "decode")}}
'''


class Adversary:
    def __init__(self, eng, workload):
        self.eng, self.workload = eng, workload
        self.honest_objective = None
        self.seen: list[float] = []  # every honest objective measured, in order

    def source(self, name: str, body: str, setup: str = "", folder: str | None = None) -> str:
        text = TEMPLATE.format(setup=textwrap.dedent(setup), body=textwrap.indent(textwrap.dedent(body), " " * 12))
        d = os.path.join(str(self.eng.tmp), folder or name)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "candidate.py")
        with open(path, "w") as f:
            f.write(text)
        return path

    def run(self, spec: dict, **kw) -> dict:
        with self.eng.client() as c:
            return c.experiment(spec, tiers="fast", workload=self.workload, reps=kw.pop("reps", 20), **kw)

    def honest(self) -> float:
        res = self.run({"source": self.source("honest", "return f(ids, pos)")})
        assert res["ok"], res
        obj = res["tiers"]["fast"]["measurement"]["objective"]
        self.seen.append(obj)
        return obj

    def measures_as_before(self) -> bool:
        """Whether the last honest measurement is within NOISE of the range of those before it in this run (a
        llama-tiny step on a shared 2-core machine measures anywhere in 1.7x of itself within a minute, so one
        sample is no baseline; a broken engine is off by far more)."""
        *before, last = self.seen
        return min(before) / NOISE <= last <= max(before) * NOISE


@pytest.fixture(scope="session")
def adversary(tmp_path_factory):
    from tkcc.traffic.buckets import workload_from_trace
    from tkcc.traffic.trace import Trace
    from tkcc.runtime.workloads import workload_to_json

    rng = np.random.default_rng(0)
    trace = Trace(np.arange(60) * 0.5, rng.integers(4, 40, 60), rng.integers(2, 20, 60))
    workload = workload_to_json(workload_from_trace(trace, max_context=64, batch_sizes=(1,), num_buckets=4))
    eng = start_engine(tmp_path_factory.mktemp("adversarial"), "llama-tiny", *ARGS)
    try:
        adv = Adversary(eng, workload)
        adv.honest_objective = max(adv.honest(), adv.honest())  # two: the range the later ones are held to
        yield adv
    finally:
        stop_engine(eng)
