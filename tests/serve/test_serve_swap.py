"""The rules of a hot swap, with fake forwards (no model): where it runs, when, what it frees, what it costs.

- A ship runs on the scheduler thread, as a control: at batch 1 between two requests, so the build, its
  warm-up and every step of every request are made from that one thread and never overlap.
- The forward swapped out stays alive until the request running on it has its last token, and is freed
  then, on the scheduler thread (its CUDA graphs and memory go there, between two steps).
- A build that fails costs the swap only: the request in flight gets all its tokens, the server serves on
  with the forward it had, and the error names the stage, the cause and that forward.
- A forward whose decode step could not be captured as a CUDA graph on the GPU is refused.

Every wait is on an event the scheduler sets, never on wall-clock time.
"""
from __future__ import annotations

import threading
import time
import weakref
from types import SimpleNamespace

import pytest
import torch

from tkcc.errors import TkccError
from tkcc.serve.scheduler import Done, Job, Scheduler, Served, Token
from tkcc.serve.stops import TextStop
from tkcc.serve.swap import SwapError, Swapper
from tkcc.serve.tokenizer import ByteTokenizer

TOK = ByteTokenizer(256)
SCHED_THREAD = "tkcc-serve-scheduler"


class FakeProgram:
    def __init__(self, device: str = "cpu"):
        self.meta = {"device": device, "batch": 1}


class FakeForward:
    """Greedy tokens base, base+1, ...; a request (a prompt longer than the warm-up's 2 ids) waits for ``gate``
    before its third token. Each step is logged with the thread it ran on."""

    def __init__(self, base: int, log: list, program=None, gate=None, decode=None, boom=None):
        self.base, self.log, self.gate, self.boom = base, log, gate, boom
        self.program = program or FakeProgram()
        self.forwards = {"decode": decode} if decode is not None else {}

    def stream(self, prompt, n):
        if self.boom is not None:
            raise self.boom
        for i in range(n):
            if self.gate is not None and prompt.shape[1] > 2 and i == 2:
                assert self.gate.wait(60)
            if "decode" in self.forwards:
                self.forwards["decode"](torch.zeros(1))
            self.log.append(("step", self.base, threading.current_thread().name))
            yield torch.tensor([self.base + i])


class FakeBuilder:
    """Builds FakeForward(100) on the Program it is given; or raises ``fail``."""

    def __init__(self, log: list, fail: Exception | None = None, make=None):
        self.log, self.fail, self.make = log, fail, make

    def can_build_on(self, program) -> bool:
        return True

    def needs_program(self, spec) -> bool:
        return True

    def capture(self):
        return FakeProgram()

    def check(self, spec) -> None:
        if not isinstance(spec, dict) or "plan" not in spec:
            raise TkccError("a candidate is {\"plan\": [...]}")

    def build(self, spec, program):
        self.log.append(("build", None, threading.current_thread().name))
        if self.fail is not None:
            raise self.fail
        if self.make is not None:
            return self.make(program), "new"
        return FakeForward(100, self.log, program), "new"


def _wait(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


class Request:
    """One job's events; ``tokens(k)`` is set once it has k tokens."""

    def __init__(self, n: int):
        self.events, self.n = [], n
        self._k = {}

    def job(self, prompt=(5, 6, 7)):
        return Job(list(prompt), TextStop(TOK, self.n), self.deliver, 60.0)

    def deliver(self, ev):
        self.events.append(ev)
        k = len(self.ids)
        if k in self._k:
            self._k[k].set()

    def tokens(self, k: int) -> threading.Event:
        return self._k.setdefault(k, threading.Event())

    @property
    def ids(self):
        return [e.id for e in self.events if isinstance(e, Token)]

    @property
    def done(self):
        return bool(self.events) and isinstance(self.events[-1], Done)


def _ship_while_held(sched, swapper, spec, gate, held: Request):
    """Start ``swapper.ship(spec)`` while ``held`` waits at its gate; once the ship is queued, let it go on."""
    assert held.tokens(2).wait(60)
    out = {}

    def ship():
        try:
            out["record"] = swapper.ship(spec)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e
    t = threading.Thread(target=ship)
    t.start()
    _wait(lambda: len(sched._controls) == 1)  # queued behind the request it must not pause
    gate.set()
    t.join(60)
    assert not t.is_alive()
    return out


def test_a_ship_runs_between_requests_on_the_scheduler_thread_and_frees_the_old_forward_after_its_last():
    log, gate = [], threading.Event()
    old = FakeForward(0, log, gate=gate)
    freed = []
    weakref.finalize(old, lambda: freed.append((len(log), threading.current_thread().name)))
    sched = Scheduler(Served(old, "old")).start()
    del old  # from here only the scheduler (and the request running on it) hold the old forward
    swapper = Swapper(SimpleNamespace(scheduler=sched), FakeBuilder(log))
    a, b = Request(6), Request(4)
    try:
        sched.submit([a.job()])
        out = _ship_while_held(sched, swapper, {"plan": []}, gate, a)
        assert "error" not in out, out.get("error")
        assert out["record"]["previous"] == "old" and out["record"]["current"] == "new"
        sched.submit([b.job()])
        _wait(lambda: b.done)
    finally:
        sched.stop()
    assert a.ids == [0, 1, 2, 3, 4, 5] and a.events[-1].finish == "length"  # all on the forward it started on
    assert b.ids == [100, 101, 102, 103]
    kinds = [(k, base) for k, base, _ in log]
    last_old = max(i for i, kb in enumerate(kinds) if kb == ("step", 0))
    build = kinds.index(("build", None))
    assert last_old < build  # the build waited for the request in flight
    assert kinds[build + 1] == ("step", 100)  # then the warm-up, on the new forward's own Program
    assert {thread for _, _, thread in log} == {SCHED_THREAD}  # every step, build and warm-up: one thread
    assert freed and freed[0][1] == SCHED_THREAD  # freed on the scheduler thread ...
    assert freed[0][0] > last_old  # ... after its request's last token, not before


@pytest.mark.parametrize("fail,status", [
    (RuntimeError("CUDA error: operation not permitted when stream is capturing"), 500),
    (TkccError("plan 1234 failed its golden check: max abs err 3.2"), 400),
])
def test_a_build_that_fails_costs_the_swap_never_a_request(fail, status):
    log, gate = [], threading.Event()
    sched = Scheduler(Served(FakeForward(0, log, gate=gate), "old")).start()
    swapper = Swapper(SimpleNamespace(scheduler=sched), FakeBuilder(log, fail=fail))
    a, b = Request(6), Request(3)
    try:
        sched.submit([a.job()])
        out = _ship_while_held(sched, swapper, {"plan": []}, gate, a)
        sched.submit([b.job()])
        _wait(lambda: a.done and b.done)
    finally:
        sched.stop()
    err = out.get("error")
    assert isinstance(err, SwapError) and err.status == status and err.serving == "old"
    text = str(err)
    assert f"building failed: {type(fail).__name__}: {fail}" in text and "still serving old" in text
    assert a.ids == [0, 1, 2, 3, 4, 5] and b.ids == [0, 1, 2]  # nothing lost, served on by the old forward
    assert sched.current.tag == "old" and sched.swaps == 0
    assert swapper.failures and swapper.failures[0]["stage"] == "building"


def test_a_candidate_that_fails_its_warm_up_is_freed_on_the_scheduler_thread():
    """Its CUDA graphs and memory must not outlive the swap in an exception's frames, to go later on whichever
    thread drops the error (the HTTP side's)."""
    log, freed = [], []

    def make(program):
        bad = FakeForward(100, log, program, boom=RuntimeError("CUDA error: an illegal instruction was encountered"))
        weakref.finalize(bad, lambda: freed.append(threading.current_thread().name))
        return bad
    sched = Scheduler(Served(FakeForward(0, log), "old")).start()
    swapper = Swapper(SimpleNamespace(scheduler=sched), FakeBuilder(log, make=make))
    try:
        with pytest.raises(SwapError) as e:
            swapper.ship({"plan": []})
        held = e.value  # the error, as the HTTP side holds it
        assert freed == [SCHED_THREAD], freed
        assert held.status == 500 and "warming up failed: RuntimeError: CUDA error" in str(held)
        assert sched.current.tag == "old"
    finally:
        sched.stop()


def test_a_bad_spec_is_refused_before_it_pauses_anything():
    log = []
    sched = Scheduler(Served(FakeForward(0, log), "old")).start()
    swapper = Swapper(SimpleNamespace(scheduler=sched), FakeBuilder(log))
    try:
        with pytest.raises(SwapError) as e:
            swapper.ship({"source": "agent.py"})
    finally:
        sched.stop()
    assert e.value.status == 400 and "still serving old" in str(e.value)
    assert not log  # no build, no step


def test_a_forward_whose_decode_step_cannot_be_captured_on_the_gpu_is_refused():
    """Its decode step would run eagerly, several times slower than the engine measured it: the swap is
    refused with the capture's own reason (a GraphCache refuses a call without CUDA tensors, as it refuses
    one that synchronises; the Program says it is on a GPU)."""
    from tkcc.kernels.graph_replay import GraphCache

    log = []
    sched = Scheduler(Served(FakeForward(0, log), "old")).start()
    builder = FakeBuilder(log, make=lambda program: FakeForward(100, log, program,
                                                                decode=GraphCache(lambda x: x + 1, name="decode")))
    builder.capture = lambda: FakeProgram("cuda")
    swapper = Swapper(SimpleNamespace(scheduler=sched), builder)
    try:
        with pytest.raises(SwapError) as e:
            swapper.ship({"plan": []})
        assert sched.current.tag == "old"
    finally:
        sched.stop()
    assert e.value.status == 400
    assert "could not be captured as a CUDA graph" in str(e.value) and "no CUDA tensor" in str(e.value)
    assert "warming up failed" in str(e.value)


def test_a_ship_the_server_refuses_does_not_end_the_campaign(capsys):
    """The engine shipped it; the server could not swap it in: recorded with its cause, and the campaign (and the
    watch loop around it) goes on, the server serving what it served."""
    from tkcc.serve.swap import ShippingEvaluator

    class Engine:
        shipped = []

        def ship(self, key):
            self.shipped.append(key)

        def spec_of(self, key):
            return {"plan": []}

    def ship_to(spec):
        raise SwapError("could not ship plan []: building failed: RuntimeError: boom; still serving old", 500, "old")
    ev = ShippingEvaluator(Engine(), ship_to)
    ev.ship("k1")
    assert Engine.shipped == ["k1"]
    assert ev.shipped == [{"error": "could not ship plan []: building failed: RuntimeError: boom; still serving old",
                           "spec": {"plan": []}, "candidate": "k1"}]
    assert "did not swap in k1" in capsys.readouterr().err
