"""The ASGI app (Starlette): OpenAI's completions and chat completions, models, health, metrics, admin.

Handlers parse and check a request (``tkcc.serve.protocol``), tokenize it,
queue one scheduler Job per prompt and relay the Job's events: as
server-sent events (``data: {chunk}`` ... ``data: [DONE]``) when
``stream`` is true, as one JSON body otherwise. A client that goes away
cancels its jobs: a streaming response notices when a send fails or Starlette
sees the disconnect; a non-streaming one watches the connection while it
waits. Model work never runs on the event loop: it is all on the scheduler
thread, which hands events over with ``call_soon_threadsafe``.

``/v1/*`` needs ``Authorization: Bearer <api key>`` when the server has one
(compared in constant time); ``/admin/*`` always needs the admin token the
server wrote to its token file; ``/health`` and ``/metrics`` are open, as in
vLLM (bind to loopback, the default, to keep them local).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import traceback
import uuid
from dataclasses import dataclass
from functools import partial

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tkcc.errors import TkccError
from tkcc.serve.protocol import ChatRequest, CompletionRequest, RequestError, error_body, parse
from tkcc.serve.scheduler import Done, Failed, Job, QueueFull, Token
from tkcc.serve.stops import TextStop
from tkcc.serve.swap import SwapError
from tkcc.serve.tokenizer import chat_ids


@dataclass
class Limits:
    """What one request may ask for (``tkcc serve --http`` flags of the same names)."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # default: the KV cache length
    max_tokens: int = 4096
    max_prompts: int = 16
    request_timeout_s: float = 600.0


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None,
           headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Relay:
    """Events of one Job, from the scheduler thread into an asyncio queue on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.q = loop, asyncio.Queue()

    def __call__(self, ev) -> None:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, ev)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def build_app(server) -> Starlette:
    """The Starlette app of a ``tkcc.serve.server.Server``."""
    lim: Limits = server.limits

    def check_key(request: Request) -> None:
        if server.api_key is None:
            return
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, b"Bearer " + server.api_key):
            raise RequestError("incorrect API key provided", status=401, code="invalid_api_key")

    async def read_body(request: Request) -> bytes:
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > lim.max_body_bytes:
            raise RequestError(f"the body has {n} bytes; the limit is {lim.max_body_bytes}", status=413)
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > lim.max_body_bytes:
                raise RequestError(f"the body is over the limit of {lim.max_body_bytes} bytes", status=413)
            parts.append(chunk)
        return b"".join(parts)

    def check_model(name: str) -> None:
        if name != server.model_name:
            raise RequestError(f"the model '{name}' does not exist; this server serves '{server.model_name}'",
                               param="model", status=404, code="model_not_found")

    def check_ids(ids: list[int], where: str) -> list[int]:
        vocab = server.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise RequestError(f"{where}: token id {t} at position {i} is outside the vocabulary (0..{vocab - 1})",
                                   param="prompt")
        return ids

    def check_lengths(prompts: list[list[int]], max_tokens: int, what: str) -> None:
        cache = server.max_cache_len
        cap = lim.max_prompt_tokens or cache
        field = "prompt" if what == "prompt" else "messages"
        if max_tokens > lim.max_tokens:
            raise RequestError(f"max_tokens={max_tokens} is over this server's limit of {lim.max_tokens}",
                               param="max_tokens")
        for p in prompts:
            if not p:
                raise RequestError(f"the {what} is empty (0 tokens)", param=field)
            if len(p) > cap:
                raise RequestError(f"the {what} has {len(p)} tokens; this server's limit is {cap}", param=field,
                                   code="context_length_exceeded")
            if len(p) + max_tokens - 1 > cache:
                raise RequestError(f"this model's maximum context length is {cache} tokens; the request needs "
                                   f"{len(p) + max_tokens - 1} ({len(p)} in the {what}, {max_tokens} to generate, the "
                                   "last of which is never fed back)", param="max_tokens",
                                   code="context_length_exceeded")

    def queue(prompts: list[list[int]], max_tokens: int, stops: list[str]):
        loop = asyncio.get_running_loop()
        jobs = []
        for p in prompts:
            jobs.append(Job(p, TextStop(server.tokenizer, max_tokens, stops, context=p), _Relay(loop),
                            lim.request_timeout_s))
        try:
            server.scheduler.submit(jobs)
        except QueueFull as e:
            raise RequestError(str(e), status=429, kind="rate_limit_error", code="queue_full") from None
        except TkccError as e:
            raise RequestError(str(e), status=503, kind="server_error") from None
        return jobs

    def completion_prompts(req: CompletionRequest) -> tuple[list[list[int]], int]:
        prompts = _prompts(req.prompt, server.tokenizer, check_ids)
        if len(prompts) > lim.max_prompts:
            raise RequestError(f"{len(prompts)} prompts in one request; the limit is {lim.max_prompts}",
                               param="prompt")
        return prompts, req.max_tokens if req.max_tokens is not None else 16

    def chat_prompts(req: ChatRequest) -> tuple[list[list[int]], int]:
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompts = [check_ids(chat_ids(server.tokenizer, msgs), "messages")]
        room = server.max_cache_len - len(prompts[0]) + 1
        return prompts, req.max_completion_tokens or req.max_tokens or max(1, min(lim.max_tokens, room))

    # request body -> (id prefix, the field prompts come from, its prompts and max_tokens, chat or not)
    kinds = {CompletionRequest: ("cmpl-", "prompt", completion_prompts, False),
             ChatRequest: ("chatcmpl-", "messages", chat_prompts, True)}

    async def run_request(request: Request, kind: type):
        """/v1/completions and /v1/chat/completions: one path, the body's kind says where the prompts are."""
        t_arrival = time.time()
        prefix, field, prompts_of, chat = kinds[kind]
        try:
            check_key(request)
            req = parse(kind, await read_body(request))
            check_model(req.model)
            prompts, max_tokens = prompts_of(req)
            check_lengths(prompts, max_tokens, field)
            jobs = queue(prompts, max_tokens, req.stop_list())
        except RequestError as e:
            server.metrics.on_reject(e.status)
            headers = None
            if e.status == 429:
                headers = {"Retry-After": str(server.scheduler.retry_after())}
            return JSONResponse(e.body(), status_code=e.status, headers=headers)
        meta = {"id": prefix + uuid.uuid4().hex, "created": int(t_arrival), "model": server.model_name}
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(jobs, meta, chat, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, jobs, meta, chat)

    async def models(request: Request):
        try:
            check_key(request)
        except RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse({"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": int(server.created), "owned_by": "tkcc",
            "max_model_len": server.max_cache_len, "forward": server.scheduler.current.tag}]})

    async def health(request: Request):
        s = server.scheduler
        return JSONResponse({"status": "ok", "model": server.model_name, "forward": s.current.tag,
                             "waiting": s.waiting, "running": s.num_running, "swaps": s.swaps})

    async def metrics(request: Request):
        return Response(server.metrics.render(), media_type=server.metrics_content_type)

    def check_admin(request: Request) -> None:
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, b"Bearer " + server.admin_token.encode()):
            raise RequestError("incorrect admin token (see the server's --admin-token-file)", status=401,
                               code="invalid_admin_token")

    def json_body(data: bytes):
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the body is not valid JSON: {e}") from None

    def swap_call(data: bytes):
        spec = json_body(data)
        if server.swapper is None:
            raise RequestError("this server cannot build forwards (started without a model to build from)",
                               status=409)
        return server.swapper.ship, (spec,)

    def measure_call(data: bytes):
        spec = json_body(data)
        try:
            return server.measure_step, (int(spec["context"]), int(spec.get("reps", 30)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RequestError(f"the body must be {{\"context\": N, \"reps\": R}}: {e}") from None

    async def admin(request: Request, call=None):
        """Every /admin route: the admin token, then ``call(body) -> (fn, args)`` run off the event loop (the
        builds and timings take seconds); without ``call``, the server's status."""
        try:
            check_admin(request)
            if call is None:
                return JSONResponse(server.status())
            fn, args = call(await read_body(request))
            res = await asyncio.to_thread(fn, *args)
        except RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except SwapError as e:  # names the stage, the cause and the forward still serving
            return _error(e.status, str(e), "server_error" if e.status >= 500 else "invalid_request_error",
                          code="swap_failed")
        except TkccError as e:
            return _error(400, str(e))
        except Exception as e:  # noqa: BLE001 - never a bare 500: the client is told what failed
            traceback.print_exc()
            return _error(500, f"{request.url.path} failed: {type(e).__name__}: {e}", "server_error",
                          code="internal_error")
        return JSONResponse(res)

    return Starlette(routes=[
        Route("/v1/completions", partial(run_request, kind=CompletionRequest), methods=["POST"]),
        Route("/v1/chat/completions", partial(run_request, kind=ChatRequest), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/admin/swap", partial(admin, call=swap_call), methods=["POST"]),
        Route("/admin/status", admin, methods=["GET"]),
        Route("/admin/measure", partial(admin, call=measure_call), methods=["POST"]),
    ], exception_handlers={404: _not_found, 405: _not_allowed})


async def _not_found(request, exc):
    return _error(404, f"no route {request.url.path}", code="not_found")


async def _not_allowed(request, exc):
    return _error(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")


def _prompts(prompt, tokenizer, check_ids) -> list[list[int]]:
    """OpenAI's four prompt shapes -> token id lists: a string, strings, ids, lists of ids."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise RequestError("prompt is an empty list", param="prompt")
    if isinstance(prompt[0], str):
        return [tokenizer.encode(p) for p in prompt]
    if isinstance(prompt[0], int):
        return [check_ids(list(prompt), "prompt")]
    return [check_ids(list(p), f"prompt[{i}]") for i, p in enumerate(prompt)]


def _usage(jobs) -> dict:
    p = sum(len(j.prompt) for j in jobs)
    c = sum(len(j.tokens) for j in jobs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _fingerprint(jobs) -> str | None:
    tags = [j.forward for j in jobs if j.forward]
    return f"tkcc-{tags[0]}" if tags else None


def _choice_chunk(chat: bool, index: int, text: str | None, finish, ids: list[int], first: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": ids}
    return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish, "token_ids": ids}


async def _stream(jobs, meta: dict, chat: bool, include_usage: bool):
    obj = "chat.completion.chunk" if chat else "text_completion"
    finished = False

    def chunk(choice=None, usage=None, fp=None):
        c = {**meta, "object": obj, "system_fingerprint": fp, "choices": [choice] if choice else []}
        if include_usage:
            c["usage"] = usage
        return _sse(c)

    try:
        for i, job in enumerate(jobs):
            first = chat  # chat streams open with the assistant's role, once the forward serving it is known
            while True:
                ev = await job.deliver.q.get()
                fp = f"tkcc-{job.forward}" if job.forward else None
                if first and not isinstance(ev, Failed):
                    yield chunk(_choice_chunk(True, i, None, None, [], first=True), fp=fp)
                    first = False
                if isinstance(ev, Token):
                    yield chunk(_choice_chunk(chat, i, ev.text, None, [ev.id]), fp=fp)
                elif isinstance(ev, Done):
                    finish = ev.finish if ev.finish in ("stop", "length") else "length"
                    if ev.finish == "timeout":
                        yield _sse(error_body("the request timed out", "timeout"))
                        yield b"data: [DONE]\n\n"
                        finished = True
                        return
                    yield chunk(_choice_chunk(chat, i, ev.text, finish, []), fp=fp)
                    break
                elif isinstance(ev, Failed):
                    yield _sse(error_body(ev.message, ev.kind))
                    yield b"data: [DONE]\n\n"
                    finished = True
                    return
        if include_usage:
            yield chunk(usage=_usage(jobs), fp=_fingerprint(jobs))
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client went away (the send failed, or Starlette saw the disconnect)
            for j in jobs:
                j.cancel()


async def _whole(request: Request, jobs, meta: dict, chat: bool):
    gone = asyncio.ensure_future(_disconnected(request))
    ends = []
    try:
        for job in jobs:
            while True:
                get = asyncio.ensure_future(job.deliver.q.get())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    for j in jobs:
                        j.cancel()
                    return Response(status_code=499)  # nobody reads it; uvicorn drops it
                ev = get.result()
                if isinstance(ev, (Done, Failed)):
                    ends.append(ev)
                    break
    finally:
        gone.cancel()
    for ev in ends:
        if isinstance(ev, Failed):
            return _error(ev.status, ev.message, ev.kind)
        if ev.finish == "timeout":
            return _error(504, "the request timed out", "timeout")
        if ev.finish == "cancelled":  # not by this client (it is still here): the server is stopping
            return _error(503, "the server is shutting down", "server_error")
    choices = []
    for i, (job, ev) in enumerate(zip(jobs, ends)):
        text = job.stop.text
        c = {"index": i, "logprobs": None, "finish_reason": ev.finish, "token_ids": list(job.tokens)}
        if chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        choices.append(c)
    body = {**meta, "object": "chat.completion" if chat else "text_completion",
            "system_fingerprint": _fingerprint(jobs), "choices": choices, "usage": _usage(jobs)}
    return JSONResponse(body)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
