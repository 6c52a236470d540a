"""The OpenAI server end to end: the official openai client (sync and async) against uvicorn on loopback.

One server per module (olmoe-tiny, so MoE counts are recorded), on a free port, always stopped. Every
expected token comes from the compiled model's own greedy loop, run on the scheduler thread (the server's
KV cache is only ever touched from there).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from tkcc.errors import TkccError

MODEL = "olmoe-tiny"


@pytest.fixture(scope="module")
def served(compiled, builder, tmp_path_factory):
    from tkcc.serve.app import Limits
    from tkcc.serve.runner import ServerThread
    from tkcc.serve.server import Server

    server = Server(compiled, model_name=MODEL, trace_dir=tmp_path_factory.mktemp("serve-trace"), builder=builder,
                    max_queue=4, limits=Limits(max_body_bytes=1 << 16, max_tokens=1000, request_timeout_s=120))
    server.start()
    http = ServerThread(server.app).start()
    try:
        yield SimpleNamespace(server=server, url=http.url, compiled=compiled, tag=server.scheduler.current.tag)
    finally:
        http.close()
        server.close()


def client(s, key="unused"):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=120)


def reference(s, ids, n, compiled=None):
    """Greedy tokens of the forward serving now (or ``compiled``), computed on the scheduler thread."""
    c = compiled or s.server.scheduler.current.compiled
    return s.server.scheduler.call(lambda: c.generate(torch.tensor([ids]), n)[0].tolist()).result(60)


def idle(s):
    """Wait until every request queued so far has been served and recorded (swaps and calls go first)."""
    sched = s.server.scheduler
    _wait(lambda: not sched.queued() and sched.running is None)


def post(s, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(s.url + path, content=data, headers={"content-type": "application/json", **kw.pop("headers", {})},
                      timeout=kw.pop("timeout", 60), **kw)


def stream_tokens(chunks):
    return [t for ch in chunks for c in ch.choices for t in c.token_ids]


def test_completions_text_and_ids_stream_and_not(served):
    c, tok = client(served), served.server.tokenizer
    ids = tok.encode("The quick brown fox")
    want = reference(served, ids, 24)
    r = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0, seed=7)
    ch = r.choices[0]
    assert ch.token_ids == want and ch.finish_reason == "length" and ch.text == tok.decode(want)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 24)
    assert r.system_fingerprint == f"tkcc-{served.tag}" and r.object == "text_completion"
    assert c.completions.create(model=MODEL, prompt=ids, max_tokens=24, seed=1).choices[0].token_ids == want
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=24, stream=True,
                                       stream_options={"include_usage": True}))
    assert stream_tokens(chunks) == want
    assert "".join(x.text for ch in chunks for x in ch.choices) == ch.text
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-2].choices[0].finish_reason == "length"
    other = tok.encode("Lorem ipsum")
    r2 = c.completions.create(model=MODEL, prompt=[ids, other], max_tokens=6)
    assert [x.index for x in r2.choices] == [0, 1]
    assert r2.choices[0].token_ids == want[:6] and r2.choices[1].token_ids == reference(served, other, 6)


def test_chat_stream_and_not(served):
    from tkcc.serve.tokenizer import chat_ids

    c, tok = client(served), served.server.tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ids = chat_ids(tok, msgs)
    want = reference(served, ids, 12)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.token_ids == want and ch.message.content == tok.decode(want)
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids)
    parts = [msgs[0], {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    chunks = list(c.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=12, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert stream_tokens(chunks) == want
    assert "".join(x.delta.content or "" for ch in chunks for x in ch.choices) == ch.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_concurrent_requests_and_a_same_program_swap(served):
    """Requests queued behind each other, and a swap to another plan over the same Program (the same KV
    cache) in the middle: every request gets exactly its greedy tokens."""
    import tkcc
    from tkcc.passes.plan import PassPlan

    tok = served.server.tokenizer
    prompts = [tok.encode(f"request number {i} " * (i + 1)) for i in range(4)]
    wants = [reference(served, p, 40) for p in prompts]
    base = tkcc.compile(served.compiled.program.model, "azure-conv", plan=PassPlan(), measure=False, check=False,
                        program=served.compiled.program)
    assert base.program is served.compiled.program

    async def main():
        ac = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(i):
            if i % 2:
                r = await ac.completions.create(model=MODEL, prompt=prompts[i], max_tokens=40)
                return r.choices[0].token_ids
            out = []
            async for ch in await ac.completions.create(model=MODEL, prompt=prompts[i], max_tokens=40, stream=True):
                out += [t for c in ch.choices for t in c.token_ids]
                if len(out) == 5 and i == 0:
                    served.server.scheduler.swap(base, "baseline-same-program", warm=True)
            return out

        try:
            return await asyncio.gather(*(one(i) for i in range(4)))
        finally:
            await ac.close()

    try:
        assert asyncio.run(main()) == wants
        assert served.server.scheduler.current.tag == "baseline-same-program"
    finally:
        served.server.swap(served.compiled, served.tag)


def test_stop_strings_cut_the_text_streamed_or_not(served):
    c, tok = client(served), served.server.tokenizer
    ids = tok.encode("Once upon a time")
    text = tok.decode(reference(served, ids, 60))
    k = len(text) // 2
    stop = text[k:k + 2]
    expected = text[:text.find(stop)]
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=60, stop=[stop, "\x00never"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 60
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=60, stop=stop, stream=True))
    assert "".join(x.text for ch in chunks for x in ch.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_swap_during_a_stream_loses_nothing(served):
    """The in-flight stream finishes on the forward it started with; the next request is served by the new one."""
    from tkcc.frontend.models import build_model
    from tkcc.commands.http_forwards import ForwardBuilder

    other = ForwardBuilder(build_model(MODEL, seed=1), max_cache_len=1024).first()[0]
    tok = served.server.tokenizer
    ids = tok.encode("swap me in the middle")
    old = reference(served, ids, 200)
    new = other.generate(torch.tensor([ids]), 200)[0].tolist()  # not served yet: its own cache is free
    assert old != new
    c = client(served)
    try:
        it = iter(c.completions.create(model=MODEL, prompt=ids, max_tokens=200, stream=True))
        got = [t for _ in range(3) for x in next(it).choices for t in x.token_ids]
        fut = served.server.scheduler.swap(other, "seed-1", warm=True)
        got += stream_tokens(it)
        assert got == old
        assert fut.result(60) == (served.tag, "seed-1")
        r = c.completions.create(model=MODEL, prompt=ids, max_tokens=200)
        assert r.choices[0].token_ids == new and r.system_fingerprint == "tkcc-seed-1"
    finally:
        served.server.swap(served.compiled, served.tag)


def test_admin_swap_builds_ships_and_refuses(served):
    from tkcc.compiler import default_plan
    from tkcc.passes.plan import PassPlan
    from tkcc.serve.swap import AdminClient, ShippingEvaluator

    assert post(served, "/admin/swap", {"baseline": True}).status_code == 401
    admin = AdminClient(served.url, token=served.server.admin_token)
    ids = served.server.tokenizer.encode("ship it")
    want = reference(served, ids, 16)
    try:
        res = admin.ship({"baseline": True})  # compiled on the spare Program, golden-checked, warmed, swapped
        assert (res["previous"], res["current"]) == (served.tag, PassPlan().hash())
        r = client(served).completions.create(model=MODEL, prompt=ids, max_tokens=16)
        assert r.choices[0].token_ids == want and r.system_fingerprint == f"tkcc-{PassPlan().hash()}"

        class Engine:  # what the engine's evaluator hands over: it already re-validated the candidate
            shipped = []

            def ship(self, key):
                self.shipped.append(key)

            def spec_of(self, key):
                return {"plan": default_plan().to_json()}

        ev = ShippingEvaluator(Engine(), admin.ship)
        ev.ship("k1")
        assert Engine.shipped == ["k1"] and admin.status()["forward"] == default_plan().hash()
        bad = post(served, "/admin/swap", {"source": "agent.py"},
                   headers={"Authorization": f"Bearer {served.server.admin_token}"})
        assert bad.status_code == 400 and "artifact" in bad.json()["error"]["message"]
    finally:
        served.server.swap(served.compiled, served.tag)


def test_a_failed_swap_answers_with_its_cause_and_the_server_serves_on(served, monkeypatch):
    """A build that raises something other than a TkccError (on the H200: a CUDA error) was a bare
    'HTTP 500: Internal Server Error'; now the answer is OpenAI's error format naming the stage, the cause
    and the forward still serving, and the next request is served as before."""
    from tkcc.serve.swap import AdminClient

    builder = served.server.swapper.builder

    def broken(spec, program):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    monkeypatch.setattr(builder, "build", broken)
    token = {"Authorization": f"Bearer {served.server.admin_token}"}
    ids = served.server.tokenizer.encode("still here")
    want = reference(served, ids, 8)
    r = post(served, "/admin/swap", {"baseline": True}, headers=token)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "swap_failed"
    assert "building failed: RuntimeError: CUDA error: operation not permitted" in err["message"]
    assert f"still serving {served.tag}" in err["message"]
    with pytest.raises(TkccError, match=r"HTTP 500: could not ship the baseline .*RuntimeError"):
        AdminClient(served.url, token=served.server.admin_token).ship({"baseline": True})
    status = httpx.get(served.url + "/admin/status", headers=token, timeout=60).json()
    assert status["forward"] == served.tag and status["swap_failures"][-1]["stage"] == "building"
    assert client(served).completions.create(model=MODEL, prompt=ids, max_tokens=8).choices[0].token_ids == want
    bad = post(served, "/admin/swap", {"plan": [{"params": {}}]}, headers=token)  # refused before any pause
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "swap_failed"
    assert "plan step 1" in bad.json()["error"]["message"]


def test_trace_is_followed_and_read_back_by_the_loaders(served):
    from tkcc.serve.recorder import prefix_hashes
    from tkcc.traffic.follow import TraceFollower
    from tkcc.traffic.loaders import load_trace

    idle(served)
    path = served.server.recorder.path
    follower = TraceFollower(path)
    follower.poll()
    tok = served.server.tokenizer
    asked = [(tok.encode("a" * 40), 5), (tok.encode("b" * 17), 9), (tok.encode("a" * 40 + "c"), 3)]
    c = client(served)
    for ids, n in asked:
        c.completions.create(model=MODEL, prompt=ids, max_tokens=n)
    idle(served)
    new = follower.poll()
    assert len(new) == 3 and new.format == "tkcc"
    assert new.input_tokens.tolist() == [len(i) for i, _ in asked]
    assert new.output_tokens.tolist() == [n for _, n in asked]
    assert new.prefix_hashes == [prefix_hashes(i) for i, _ in asked]
    assert new.prefix_hashes[0][:2] == new.prefix_hashes[2][:2] and len(new.prefix_hashes[1]) == 1
    assert (new.arrival_s[1:] >= new.arrival_s[:-1]).all()
    top_k = served.server.scheduler._counter(served.compiled.program).top_k
    for (ids, n), counts in zip(asked, new.moe_counts):  # every fed token's top-k assignments, per layer
        assert counts.shape == (4, 8) and (counts.sum(axis=1) == top_k * (len(ids) + n - 1)).all()
    whole = load_trace(path)
    assert whole.format == "tkcc" and whole.routing is not None and whole.routing.num_layers == 4
    assert whole.output_tokens[-3:].tolist() == [n for _, n in asked]


def _wait(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_full_queue_answers_429_with_retry_after(served):
    sched = served.server.scheduler
    gate = threading.Event()
    sched.call(gate.wait)  # the scheduler thread holds: nothing is served until the gate opens
    results = []
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}
    threads = [threading.Thread(target=lambda: results.append(post(served, "/v1/completions", body)))
               for _ in range(5)]  # max_queue 4, plus the one that would start at once
    try:
        for t in threads:
            t.start()
        _wait(lambda: sched.waiting == 5)
        r = post(served, "/v1/completions", body)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            client(served).completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
    finally:
        gate.set()
        for t in threads:
            t.join(60)
    want = reference(served, [1, 2, 3], 4)
    assert [r.status_code for r in results] == [200] * 5
    assert all(r.json()["choices"][0]["token_ids"] == want for r in results)


def _metric(served, name, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    # metrics are book-kept after the answer went out, on the scheduler thread: a control call runs after it
    served.server.scheduler.call(lambda: None).result(60)
    text = httpx.get(served.url + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_a_disconnect_cancels_the_request(served):
    from tkcc.traffic.follow import TraceFollower

    idle(served)
    follower = TraceFollower(served.server.recorder.path)
    follower.poll()
    before = _metric(served, "tkcc_request_success_total", finished_reason="cancelled")
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data:")) == 3
    # a waiting request whose client gives up is dropped before it runs
    gate = threading.Event()
    served.server.scheduler.call(gate.wait)
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(served, "/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 50}, timeout=0.5)
        _wait(lambda: (q := served.server.scheduler.queued()) and all(j.cancelled for j in q))
    finally:
        gate.set()
    idle(served)
    rows = follower.poll()
    assert rows.output_tokens.tolist()[-1] == 0 and 0 < rows.output_tokens.tolist()[-2] < 1000
    assert _metric(served, "tkcc_request_success_total", finished_reason="cancelled") == before + 2


def test_api_key_is_required_when_set(served):
    served.server.api_key = b"sekrit"
    try:
        with pytest.raises(openai.AuthenticationError):
            client(served, key="wrong").completions.create(model=MODEL, prompt=[1], max_tokens=1)
        r = post(served, "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(served.url + "/v1/models").status_code == 401
        ok = client(served, key="sekrit").completions.create(model=MODEL, prompt=[1], max_tokens=1)
        assert len(ok.choices[0].token_ids) == 1
        assert httpx.get(served.url + "/health").status_code == 200
    finally:
        served.server.api_key = None


_OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
MALFORMED = [
    ("/v1/completions", b'{"model": "olmoe-tiny", "prompt": ', None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", b"\xff\xfe", None),
    ("/v1/completions", {**_OK, "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {**_OK, "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {**_OK, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**_OK, "max_tokens": 1001}, "max_tokens"),
    ("/v1/completions", {**_OK, "stream": "yes"}, "stream"),
    ("/v1/completions", {**_OK, "prompt": 5}, "prompt"),
    ("/v1/completions", {**_OK, "prompt": ""}, "prompt"),
    ("/v1/completions", {**_OK, "prompt": []}, "prompt"),
    ("/v1/completions", {**_OK, "prompt": [1, 256]}, "prompt"),
    ("/v1/completions", {**_OK, "prompt": [-1]}, "prompt"),
    ("/v1/completions", {**_OK, "prompt": [1] * 1000, "max_tokens": 100}, "max_tokens"),
    ("/v1/completions", {**_OK, "prompt": [[1]] * 17}, "prompt"),
    ("/v1/completions", {**_OK, "bogus": 1}, "bogus"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {**_OK, "temperature": 0.7}, "temperature"),
    ("/v1/completions", {**_OK, "temperature": "0"}, "temperature"),
    ("/v1/completions", {**_OK, "top_p": 0.9}, "top_p"),
    ("/v1/completions", {**_OK, "n": 2}, "n"),
    ("/v1/completions", {**_OK, "logprobs": 2}, "logprobs"),
    ("/v1/completions", {**_OK, "echo": True}, "echo"),
    ("/v1/completions", {**_OK, "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {**_OK, "logit_bias": {"1": 5}}, "logit_bias"),
    ("/v1/completions", {**_OK, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {**_OK, "stop": 3}, "stop"),
    ("/v1/completions", {**_OK, "seed": "1"}, "seed"),
    ("/v1/completions", {**_OK, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {**_CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {**_CHAT, "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {**_CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,param", MALFORMED, ids=[f"{i}-{m[2]}" for i, m in enumerate(MALFORMED)])
def test_every_malformed_request_is_a_400_in_openai_format(served, path, body, param):
    r = post(served, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]


def test_other_refusals_in_openai_format(served):
    r = post(served, "/v1/completions", {**_OK, "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client(served).completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    r = post(served, "/v1/completions", json.dumps({**_OK, "prompt": "x" * (1 << 17)}))
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert httpx.get(served.url + "/v1/completions").status_code == 405
    assert httpx.get(served.url + "/v1/nothing").json()["error"]["code"] == "not_found"


def test_models_health_and_metrics(served):
    models = client(served).models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = httpx.get(served.url + "/health").json()
    assert h["status"] == "ok" and h["forward"] == served.tag
    client(served).completions.create(model=MODEL, prompt=[1, 2], max_tokens=3)
    assert _metric(served, "tkcc_generation_tokens_total") >= 3
    assert _metric(served, "tkcc_time_to_first_token_seconds_count") >= 1
    assert _metric(served, "tkcc_moe_count_seconds_count") >= 1
    assert _metric(served, "tkcc_request_rejected_total", status="400") >= 0


def test_admin_measures_the_serving_decode_step(served):
    from tkcc.serve.swap import AdminClient

    admin = AdminClient(served.url, token=served.server.admin_token)
    m = admin.measure_step(300, reps=5)
    assert m["forward"] == served.tag and m["samples"] == 5 and 0 < m["p10_ms"] <= m["median_ms"] <= m["p90_ms"]
    with pytest.raises(Exception, match="context must be"):
        admin.measure_step(10 ** 6)
    r = client(served).completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)  # the cache is clean again
    assert r.choices[0].token_ids == reference(served, [1, 2, 3], 4)


def test_the_server_serves_what_a_watch_campaign_left_shipped(served, tmp_path):
    """A campaign that keeps the baseline records the ship without calling the evaluator: --watch follows
    the store and swaps it in (one in-process build, as a ship from the engine would be)."""
    from tkcc.agents.store import ExperimentStore
    from tkcc.agents.watch import WatchEvent
    from tkcc.passes.plan import PassPlan
    from tkcc.serve.watching import ServeWatch

    watcher = ServeWatch(served.server, SimpleNamespace())  # not started: no engine, only its ship logic
    watcher.store = ExperimentStore(str(tmp_path / "store.db"))
    cid = watcher.store.open_campaign("serve-test-0", MODEL, {}, resume=False)
    watcher.store.record_ship(cid, PassPlan().hash(), [], 1.0, "ship", "baseline")
    # each campaign starts from what serves (the server's own plan, before any ship): its key is the server's tag
    assert watcher._serving_plan().hash() == served.server.scheduler.current.tag
    try:
        watcher.events.append(WatchEvent(time.time(), "campaign", {"shipped": (PassPlan().hash(), 1.0)}))
        assert served.server.scheduler.current.tag == PassPlan().hash() and len(watcher.shipped) == 1
        watcher.events.append(WatchEvent(time.time(), "campaign", {"shipped": (PassPlan().hash(), 1.0)}))
        assert len(watcher.shipped) == 1  # already serving it: nothing to swap
        kept = watcher._ship({"baseline": True})  # a campaign that kept what serves: known by plan, not by tag
        assert kept.get("kept") == PassPlan().hash() and len(watcher.shipped) == 1
        assert watcher.status()["events"][0]["kind"] == "campaign"
    finally:
        watcher.store.close()
        served.server.swap(served.compiled, served.tag)
