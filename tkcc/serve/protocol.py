"""The OpenAI request bodies tkcc accepts, and its errors in OpenAI's format.

Requests are parsed by pydantic models that forbid unknown fields and check
types strictly (``"max_tokens": "5"`` is a bad type, not 5). tkcc decodes
greedily, so sampling parameters are accepted only at the values that mean
greedy (``temperature`` 0 or absent, ``top_p`` 1, ``n`` 1, no penalties, no
logit bias); any other value, and OpenAI fields tkcc does not serve (tools,
logprobs, ...), are refused by name with a 400. ``seed`` is accepted: greedy
decoding gives the same tokens for every seed.

Every error is ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status OpenAI uses (400 bad request, 401 bad key, 404 unknown model,
413 body too large, 429 queue full, 503 shutting down, 504 timeout).
"""
from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tkcc.errors import TkccError

MAX_STOP = 4  # stop sequences per request, as OpenAI


class RequestError(TkccError):
    """A request tkcc refuses: the HTTP status, OpenAI's error type, and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(v)}")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None


# OpenAI fields tkcc does not serve: refused by name rather than as "unknown"
UNSUPPORTED = {
    "tools": "tool calling", "tool_choice": "tool calling", "parallel_tool_calls": "tool calling",
    "functions": "function calling", "function_call": "function calling", "response_format": "structured output",
    "audio": "audio output", "modalities": "audio output", "prediction": "predicted outputs",
    "reasoning_effort": "reasoning models", "web_search_options": "web search", "store": "stored completions",
    "metadata": "stored completions", "service_tier": "service tiers",
}

# (field, the values that mean greedy decoding, why anything else is refused)
_GREEDY = [
    ("temperature", (None, 0, 0.0), "tkcc decodes greedily; send temperature 0 or leave it out"),
    ("top_p", (None, 1, 1.0), "tkcc decodes greedily; nucleus sampling is not supported (top_p must be 1)"),
    ("n", (None, 1), "tkcc returns one choice per prompt (n must be 1)"),
    ("best_of", (None, 1), "tkcc returns one choice per prompt (best_of must be 1)"),
    ("presence_penalty", (None, 0, 0.0), "penalties are not supported (presence_penalty must be 0)"),
    ("frequency_penalty", (None, 0, 0.0), "penalties are not supported (frequency_penalty must be 0)"),
    ("logit_bias", (None, {}), "logit_bias is not supported"),
    ("logprobs", (None, 0, False), "logprobs are not returned by tkcc"),
    ("top_logprobs", (None, 0), "logprobs are not returned by tkcc"),
    ("echo", (None, False), "echo is not supported"),
    ("suffix", (None, ""), "suffix (insertion) is not supported"),
]


def _fields() -> set[str]:
    return {f for m in (CompletionRequest, ChatRequest, Message, TextPart, StreamOptions) for f in m.model_fields}


def _request_error(e: ValidationError) -> RequestError:
    """The first problem pydantic found, located by field path; a union names the shapes it accepts."""
    fields = _fields()
    errs = e.errors(include_url=False)

    def path(err):
        loc = list(err["loc"])
        own = [str(loc.pop())] if loc and err["type"] == "extra_forbidden" else []  # the unknown field's name
        return ".".join([str(p) for p in loc if isinstance(p, int) or p in fields] + own) or None

    where = path(errs[0])
    same = [x for x in errs if path(x) == where]
    if len(same) > 1 and all(x["type"] not in ("extra_forbidden", "missing") for x in same):
        shapes = [str(x["loc"][-1]) for x in same if x["loc"] and str(x["loc"][-1]) not in fields]
        what = "not of an accepted type" + (f" ({', '.join(dict.fromkeys(shapes))})" if shapes else "")
    else:
        what = {"extra_forbidden": "unknown field", "missing": "missing field"}.get(errs[0]["type"], errs[0]["msg"])
    return RequestError(f"{where}: {what}" if where else what, param=where)


def parse(kind: type[_Sampling], raw: bytes) -> _Sampling:
    """Parse and check one request body; RequestError (400) naming the field on anything wrong."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError(f"the body must be a JSON object, got {type(obj).__name__}")
    for k in obj:
        if k in UNSUPPORTED:
            raise RequestError(f"'{k}' is not supported by tkcc ({UNSUPPORTED[k]})", param=k)
    try:
        req = kind.model_validate(obj)
    except ValidationError as e:
        raise _request_error(e) from None
    for name, ok, why in _GREEDY:
        if name in type(req).model_fields:
            v = getattr(req, name)
            if v not in ok:
                raise RequestError(f"{name}={json.dumps(v)}: {why}", param=name)
    return req
