"""JSON-lines trace formats: Mooncake, generic request logs (OpenAI/vLLM style), tkcc's own.

One JSON object per line. A line that is not valid JSON (a truncated last
line of a log being written, say) is a bad row with its line number.
"""
from __future__ import annotations

import datetime as _dt
import json
from typing import Iterator

import numpy as np

from tkcc.errors import TraceFormatError
from tkcc.traffic.rows import RawFloat, RowValidator
from tkcc.traffic.textio import open_text, physical_line
from tkcc.traffic.trace import Trace

# generic request logs: first field found wins (dotted = nested)
INPUT_FIELDS = ("usage.prompt_tokens", "prompt_tokens", "input_tokens", "input_len", "input_length",
                "num_prompt_tokens", "prompt_len", "usage.input_tokens", "request_tokens", "ContextTokens")
OUTPUT_FIELDS = ("usage.completion_tokens", "completion_tokens", "output_tokens", "output_len", "output_length",
                 "num_generated_tokens", "generated_tokens", "usage.output_tokens", "response_tokens",
                 "GeneratedTokens")
TIME_FIELDS = ("timestamp", "arrival_time", "arrival_s", "request_time", "start_time", "created", "time", "ts",
               "TIMESTAMP")


def _get(obj: dict, dotted: str):
    cur = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _json_lines(path: str, v: RowValidator, chunk_rows: int):
    """Yield (line numbers, objects) per chunk; undecodable lines become bad rows."""
    lines, objs, any_rows = [], [], False
    with open_text(path) as f:
        for k, line in enumerate(f, start=1):
            ln = physical_line(path, k)
            s = line.strip()
            if not s:
                continue
            any_rows = True
            try:
                obj = json.loads(s, parse_float=RawFloat)
            except json.JSONDecodeError as e:
                what = "truncated JSON line" if not line.endswith("\n") else "invalid JSON"
                v.fail(ln, None, f"{what}: {e.msg} at column {e.colno}")
                continue
            if not isinstance(obj, dict):
                v.fail(ln, None, f"expected a JSON object, got {type(obj).__name__}")
                continue
            lines.append(ln)
            objs.append(obj)
            if len(lines) >= chunk_rows:
                yield lines, objs
                lines, objs = [], []
    if lines:
        yield lines, objs
    v.done(any_rows)
    if v.pending:
        yield [], []


def _time_seconds(values: list, lines: list[int], field: str, bad: dict, unit: dict) -> np.ndarray:
    """Numbers (s, ms or us since an epoch, unit fixed by the file's first value) or ISO 8601 strings -> s."""
    out = np.zeros(len(values))
    for i, x in enumerate(values):
        try:
            if isinstance(x, str) and not _is_number(x):
                d = _dt.datetime.fromisoformat(x.replace("Z", "+00:00"))
                if d.tzinfo is None:
                    d = d.replace(tzinfo=_dt.timezone.utc)
                out[i] = d.timestamp()
            else:
                f = float(x)
                if "scale" not in unit:
                    unit["scale"] = 1e-6 if abs(f) > 1e14 else 1e-3 if abs(f) > 1e11 else 1.0
                out[i] = f * unit["scale"]
        except (ValueError, TypeError):
            bad.setdefault(i, (field, f"not a timestamp: {x!r}"))
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def iter_mooncake(path: str, skip_bad: bool = False, chunk_rows: int = 200_000,
                  check_order: bool = True) -> Iterator[Trace]:
    """Mooncake: timestamp (ms from trace start), input_length, output_length, hash_ids (prefix blocks)."""
    v = RowValidator(path, "mooncake", skip_bad, check_order)
    for lines, objs in _json_lines(path, v, chunk_rows):
        bad: dict = {}
        for i, o in enumerate(objs):
            for k in ("timestamp", "input_length", "output_length"):
                if k not in o:
                    bad.setdefault(i, (k, "missing field"))
        t = v.numbers([o.get("timestamp", 0) for o in objs], lines, "timestamp", np.float64, bad) / 1000.0
        inp = v.numbers([o.get("input_length", 0) for o in objs], lines, "input_length", np.int64, bad)
        out = v.numbers([o.get("output_length", 0) for o in objs], lines, "output_length", np.int64, bad)
        hashes = [list(o.get("hash_ids") or []) for o in objs]
        tr = v.finish(lines, t, inp, out, bad, extra={"prefix_hashes": hashes})
        if tr is not None:
            yield tr


def iter_request_log(path: str, skip_bad: bool = False, chunk_rows: int = 200_000,
                     check_order: bool = True, origin_epoch_s: float | None = None) -> Iterator[Trace]:
    """Generic JSONL request log: token counts and a timestamp under common OpenAI/vLLM field names."""
    v = RowValidator(path, "jsonl", skip_bad, check_order=check_order)
    fields: dict = {}
    unit: dict = {}
    t0 = origin_epoch_s
    for lines, objs in _json_lines(path, v, chunk_rows):
        if not fields:
            fields = _resolve_fields(objs[0], str(path), lines[0])
        bad: dict = {}
        cols = {}
        for role in ("time", "input", "output"):
            name = fields[role]
            vals = []
            for i, o in enumerate(objs):
                x = _get(o, name)
                if x is None:
                    bad.setdefault(i, (name, "missing field"))
                    x = 0
                vals.append(x)
            cols[role] = vals
        t = _time_seconds(cols["time"], lines, fields["time"], bad, unit)
        inp = v.numbers(cols["input"], lines, fields["input"], np.int64, bad)
        out = v.numbers(cols["output"], lines, fields["output"], np.int64, bad)
        good = [i for i in range(len(lines)) if i not in bad]
        if t0 is None and good:
            t0 = float(t[good[0]]) if check_order else float(np.min(t[good]))
        tr = v.finish(lines, t - (t0 or 0.0), inp, out, bad)
        if tr is not None:
            tr.meta["fields"] = dict(fields)
            tr.meta["origin_epoch_s"] = t0
            if t0 is not None and t0 > 1e8:  # an epoch time, not seconds from start
                tr.start_time = _dt.datetime.fromtimestamp(t0, _dt.timezone.utc).replace(tzinfo=None).isoformat()
            yield tr


def _resolve_fields(obj: dict, path: str, line: int) -> dict:
    found = {}
    for role, names in (("time", TIME_FIELDS), ("input", INPUT_FIELDS), ("output", OUTPUT_FIELDS)):
        for n in names:
            if _get(obj, n) is not None:
                found[role] = n
                break
        else:
            raise TraceFormatError(f"no {role} field; tried {list(names)}; line has keys {sorted(obj)}",
                                   path=path, line=line, field=role)
    return found


def looks_like_request_log(obj: dict) -> bool:
    try:
        _resolve_fields(obj, "", 0)
        return True
    except TraceFormatError:
        return False
