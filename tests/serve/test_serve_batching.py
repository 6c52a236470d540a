"""Continuous batching: a forward compiled for B slots serves up to B streams in one decode step.

The invariant under test: every token a request gets is the token it gets served alone on the same forward
(``compiled.generate`` of its prompt: one prompt in slot 0, the other slots free), whatever else is decoding
beside it, whichever slot it lands in, and however requests come and go. Arrivals are staggered by tokens
delivered, not by wall-clock time, so the interleaving is the same on any machine.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from tkcc.errors import TkccError

MAX_CACHE_LEN = 128
_COMPILED: dict = {}


def compiled_for(name: str, batch: int):
    """The first forward `tkcc serve --http --batch B` builds (default plan, tkcc.compile), one per session."""
    if (name, batch) not in _COMPILED:
        from tkcc.frontend.models import build_model
        from tkcc.commands.http_forwards import ForwardBuilder

        # wider random weights: at the default scale the tiny models repeat one token whatever came before,
        # and a test of tokens would not see a wrong cache row or position
        builder = ForwardBuilder(build_model(name, initializer_range=0.5), max_cache_len=MAX_CACHE_LEN, batch=batch)
        _COMPILED[name, batch] = (builder, builder.first()[0])
    return _COMPILED[name, batch]


def _wait(cond, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def _alone(compiled, prompt, n):
    return compiled.generate(torch.tensor([prompt]), n)[0].tolist()


def _stop_char(tok, ids):
    """(an ASCII letter that ``ids`` decodes to for the first time at index m, m), or None."""
    seen = ""
    for m, t in enumerate(ids):
        ch = tok.decode([t])
        if m >= 2 and len(ch) == 1 and ch.isascii() and ch.isalnum() and ch not in seen:
            return ch, m
        seen += ch
    return None


@pytest.mark.parametrize("name,batch,late", [("llama-tiny", 2, False), ("llama-tiny", 4, True),
                                             ("olmoe-tiny", 2, True), ("olmoe-tiny", 4, False)])
def test_staggered_requests_get_the_tokens_they_get_alone(name, batch, late, tmp_path):
    """Seven requests of different lengths arrive while others decode; one disconnects after 3 tokens and one
    ends on a stop string; each freed slot is taken by the next. ``late`` reads each step's ids one step late
    (as on CUDA), so a finished request's extra step must be dropped, not delivered."""
    from tkcc.serve.recorder import RollingTrace
    from tkcc.serve.routing import ExpertCounter, is_moe
    from tkcc.serve.scheduler import Done, Job, Scheduler, Served, Token
    from tkcc.serve.stops import TextStop
    from tkcc.serve.tokenizer import ByteTokenizer

    _builder, compiled = compiled_for(name, batch)
    tok = ByteTokenizer(256)
    gen = torch.Generator().manual_seed(batch)
    lengths, max_tokens = [7, 1, 12, 3, 20, 5, 9], [14, 9, 11, 16, 24, 12, 10]
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    want = [_alone(compiled, p, n) for p, n in zip(prompts, max_tokens)]
    cancel_at, stopper = 2, 4
    stop = _stop_char(tok, want[stopper])
    assert stop is not None, "pick another seed: no ASCII letter to stop on"
    moe = ExpertCounter(compiled.program).header if is_moe(compiled.program) else None
    recorder = RollingTrace(tmp_path, model=name, moe=moe)
    sched = Scheduler(Served(compiled, "t"), max_queue=8, recorder=recorder, read_late=late)
    events = [[] for _ in prompts]
    concurrency = []

    def deliver(i):
        def on(ev):
            events[i].append(ev)
            concurrency.append(sched.num_running)
            got = sum(isinstance(e, Token) for e in events[i])
            if i == cancel_at and got == 3:
                jobs[i].cancel()  # the client went away
            if i + 1 < len(jobs) and jobs[i + 1].seq < 0 and (got == 2 or isinstance(ev, Done)):
                sched.submit([jobs[i + 1]])  # the next request arrives while this one decodes
        return on

    jobs = [Job(p, TextStop(tok, n, [stop[0]] if i == stopper else None, context=p), deliver(i), 60.0)
            for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    sched.start()
    try:
        sched.submit([jobs[0]])
        _wait(lambda: all(e and isinstance(e[-1], Done) for e in events))
        _wait(lambda: sched.served == len(jobs))
    finally:
        sched.stop()
    for i, (evs, job) in enumerate(zip(events, jobs)):
        ids = [e.id for e in evs if isinstance(e, Token)]
        if i == cancel_at:
            assert ids == want[i][:3] and evs[-1].finish == "cancelled"
        elif i == stopper:
            assert ids == want[i][:stop[1] + 1] and evs[-1].finish == "stop"
        else:
            assert ids == want[i] and evs[-1].finish == "length", f"request {i}"
    assert max(concurrency) == batch  # every slot was used at once
    from tkcc.traffic.loaders import load_trace

    files = sorted(tmp_path.glob("serve-*.jsonl"))
    assert len(load_trace(files[0])) == len(jobs)  # in arrival order, as the loaders require
    lines = [json.loads(x) for f in files for x in f.read_text().splitlines()]
    rows = [x for x in lines if "in" in x]
    assert [(r["in"], r["out"]) for r in rows] == [(len(p), len(j.tokens)) for p, j in zip(prompts, jobs)]
    if moe is not None:  # every request's own routing: one count per (token fed, expert slot) and layer
        for r, p, j in zip(rows, prompts, jobs):
            assert [sum(layer) for layer in r["moe"]] == [(len(p) + len(j.tokens) - 1) * moe["top_k"]] * \
                moe["num_layers"]


def test_the_queue_holds_what_the_slots_do_not_and_answers_429_past_it():
    from tkcc.serve.scheduler import Done, Job, QueueFull, Scheduler, Served, Token
    from tkcc.serve.stops import TextStop
    from tkcc.serve.tokenizer import ByteTokenizer

    _builder, compiled = compiled_for("llama-tiny", 2)
    tok = ByteTokenizer(256)
    sched = Scheduler(Served(compiled, "t"), max_queue=1).start()
    try:
        gate = threading.Event()
        sched.call(gate.wait)
        events = [[] for _ in range(3)]
        for ev in events:  # two slots and one place in the queue
            sched.submit([Job([1, 2, 3], TextStop(tok, 5), ev.append, 60.0)])
        with pytest.raises(QueueFull) as e:
            sched.submit([Job([1], TextStop(tok, 1), lambda ev: None, 60.0)])
        assert e.value.retry_after_s >= 1
        gate.set()
        _wait(lambda: all(ev and isinstance(ev[-1], Done) for ev in events))
        want = _alone(compiled, [1, 2, 3], 5)
        assert all([t.id for t in ev if isinstance(t, Token)] == want for ev in events)
    finally:
        sched.stop()


def test_swaps_while_slots_decode_lose_nothing():
    """A swap to a forward on another Program starts new requests there while the old ones finish on theirs
    (a step per forward); a swap onto the serving Program waits until its slots are drained."""
    from tkcc.serve.scheduler import Done, Job, Scheduler, Served, Token
    from tkcc.serve.stops import TextStop
    from tkcc.serve.tokenizer import ByteTokenizer

    builder, compiled = compiled_for("llama-tiny", 2)
    other, tag = builder.build({"baseline": True}, builder.capture())
    assert other.program is not compiled.program
    tok = ByteTokenizer(256)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (6, 4, 8, 5)]
    sched = Scheduler(Served(compiled, "first"), max_queue=8).start()
    events = [[] for _ in prompts]
    forwards, gate, held = [], threading.Event(), threading.Event()

    def hold():  # the scheduler stops here, between two steps, while the first two decode
        held.set()
        gate.wait(60)

    def first(ev):
        events[0].append(ev)
        if sum(isinstance(e, Token) for e in events[0]) == 3:
            sched.call(hold)

    try:
        sched.submit([Job(prompts[0], TextStop(tok, 100), first, 60.0)])
        sched.submit([Job(prompts[1], TextStop(tok, 100), events[1].append, 60.0)])
        assert held.wait(60)
        swapped = sched.swap(other, "second")  # applied right after the hold, before any admission
        for i in (2, 3):
            sched.submit([Job(prompts[i], TextStop(tok, 12), events[i].append, 60.0)])
        gate.set()
        assert swapped.result(60) == ("first", "second")
        _wait(lambda: all(ev and isinstance(ev[-1], Done) for ev in events[2:]))
        assert not any(ev and isinstance(ev[-1], Done) for ev in events[:2])  # the first two still decode
        forwards.append(sched.call(lambda: sorted(sched.programs_in_use())).result(30))
        # back onto the first Program (the first two still hold two of its slots): applied once they are done
        back = sched.swap(compiled, "first-again")
        _wait(lambda: all(ev and isinstance(ev[-1], Done) for ev in events[:2]))
        assert back.result(60) == ("second", "first-again")
    finally:
        gate.set()
        sched.stop()
    assert forwards[0] == sorted({id(compiled.program), id(other.program)})
    for i, (p, n, c) in enumerate(zip(prompts, (100, 100, 12, 12), (compiled, compiled, other, other))):
        assert [e.id for e in events[i] if isinstance(e, Token)] == _alone(c, p, n), f"request {i}"


def test_a_forward_for_another_batch_is_refused():
    from tkcc.serve.scheduler import Scheduler, Served

    _builder, two = compiled_for("llama-tiny", 2)
    _builder, four = compiled_for("llama-tiny", 4)
    sched = Scheduler(Served(two, "t"))
    with pytest.raises(TkccError, match="serves 2"):
        sched.swap(four, "x")
    from tkcc.frontend import capture_model

    with pytest.raises(TkccError, match="compile it for slots"):
        Scheduler(Served(type("C", (), {"program": capture_model("llama-tiny", max_cache_len=16, batch=2)})(), "t"))


def test_a_saved_batch_artifact_is_served_at_its_batch_only(tmp_path):
    from tkcc.frontend.models import build_model
    from tkcc.commands.http_forwards import ForwardBuilder, load_artifact

    _builder, compiled = compiled_for("llama-tiny", 2)
    compiled.save(tmp_path / "b2")
    with pytest.raises(TkccError, match="compiled for batch 2, but the server serves batch 1"):
        load_artifact(str(tmp_path / "b2"), build_model("llama-tiny", initializer_range=0.5), 1)
    loaded, tag = ForwardBuilder(build_model("llama-tiny", initializer_range=0.5), batch=2).first(
        artifact=str(tmp_path / "b2"))
    assert loaded.program.meta["slots"] == 2 and tag.endswith("@b2")
    prompts = torch.tensor([[4, 5, 6], [7, 8, 9]])
    assert torch.equal(loaded.generate(prompts, 5), compiled.generate(prompts, 5))
    from tkcc.serve.scheduler import Done, Job, Token
    from tkcc.serve.server import Server
    from tkcc.serve.stops import TextStop

    server = Server(loaded, model_name="m", tag=tag).start()  # a loaded forward has no graphs, only its phases
    events = [[], []]
    try:
        server.scheduler.submit([Job(p.tolist(), TextStop(server.tokenizer, 5), ev.append, 60.0)
                                 for p, ev in zip(prompts, events)])
        _wait(lambda: all(ev and isinstance(ev[-1], Done) for ev in events))
    finally:
        server.close()
    assert [[e.id for e in ev if isinstance(e, Token)] for ev in events] == compiled.generate(prompts, 5).tolist()


def test_the_openai_server_streams_concurrent_requests_at_batch_2():
    """Through HTTP: concurrent streaming requests share the decode step; /health counts them; each gets its
    alone tokens; /admin/measure times the decode_slots step."""
    import asyncio

    import openai

    from tkcc.serve.runner import ServerThread
    from tkcc.serve.server import Server

    builder, compiled = compiled_for("olmoe-tiny", 2)
    server = Server(compiled, model_name="m", builder=builder, max_queue=4).start()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [2, 7]]
    want = [server.scheduler.call(lambda p=p: _alone(compiled, p, 20)).result(60) for p in prompts]
    running, gate = [], threading.Event()
    try:
        with ServerThread(server.app) as http:
            c = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="x", max_retries=0, timeout=120)

            async def one(p):
                ids = []
                async for ch in await c.completions.create(model="m", prompt=p, max_tokens=20, stream=True):
                    ids += ch.choices[0].token_ids if ch.choices else []
                    running.append(server.scheduler.num_running)
                return ids

            async def all_of():
                tasks = [asyncio.create_task(one(p)) for p in prompts]
                await asyncio.to_thread(_wait, lambda: server.scheduler.waiting == len(prompts))
                gate.set()  # all four wait: the first two are admitted together
                return await asyncio.gather(*tasks)

            gate = threading.Event()
            server.scheduler.call(gate.wait)
            got = asyncio.run(all_of())
            step = server.measure_step(8, reps=3, warmup=1)
    finally:
        gate.set()
        server.close()
    assert got == want and max(running) == 2
    assert step["phase"] == "decode_slots" and step["slots"] == 2 and step["median_ms"] > 0


def test_trace_lines_wait_for_earlier_arrivals():
    from tkcc.serve.recorder import ArrivalOrder

    out = []
    order = ArrivalOrder(lambda *a, **kw: out.append((a, kw)))
    order.add(2, "c")
    order.add(1, "b", moe=1)
    assert out == []
    order.add(0, "a")
    assert [a[0] for a, _ in out] == ["a", "b", "c"] and out[1][1] == {"moe": 1}
    order.add(5, "f")
    order.add(4, "e")
    order.flush()  # request 3 never finished (the server stopped): the rest is written past the gap, in order
    assert [a[0] for a, _ in out] == ["a", "b", "c", "e", "f"]
    order.add(6, "g")
    assert out[-1][0] == ("g",)
