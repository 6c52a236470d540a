"""tkcc's own recorded trace format (JSON lines), written by the engine and read back by tkcc.

Line 1 is a header object, every further line one request::

    {"tkcc_trace": 1, "start_time": "2026-11-29T19:00:00", "model": "olmoe-16l",
     "moe": {"num_layers": 16, "num_experts": 64, "top_k": 8}}
    {"t": 0.0, "in": 812, "out": 64}
    {"t": 0.41, "in": 95, "out": 210, "prefix": [17, 4, 99], "moe": [[3, 0, ...], ...]}

``t`` is seconds since ``start_time``; ``in``/``out`` token counts; ``prefix``
optional prefix-block hashes; ``moe`` optional per-layer expert counts of this
request's tokens (num_layers lists of num_experts ints: how many (token, slot)
assignments each expert got). Recorded MoE counts aggregate into the trace's
``routing``, so measured routing skew travels with the trace.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np

from tkcc.errors import TraceFormatError
from tkcc.traffic.rows import RawFloat, RowValidator
from tkcc.traffic.textio import open_text, physical_line
from tkcc.traffic.trace import Trace

VERSION = 1


def iter_tkcc(path: str, skip_bad: bool = False, chunk_rows: int = 200_000,
              check_order: bool = True) -> Iterator[Trace]:
    v = RowValidator(path, "tkcc", skip_bad, check_order)
    header = None
    lines, objs, any_rows = [], [], False
    totals = None

    def flush():
        nonlocal totals
        bad: dict = {}
        for i, o in enumerate(objs):
            for k in ("t", "in", "out"):
                if k not in o:
                    bad.setdefault(i, (k, "missing field"))
        t = v.numbers([o.get("t", 0) for o in objs], lines, "t", np.float64, bad)
        inp = v.numbers([o.get("in", 0) for o in objs], lines, "in", np.int64, bad)
        out = v.numbers([o.get("out", 0) for o in objs], lines, "out", np.int64, bad)
        prefix = [list(o.get("prefix") or []) for o in objs] if any("prefix" in o for o in objs) else None
        counts = None
        moe = (header or {}).get("moe")
        if moe:
            shape = (int(moe["num_layers"]), int(moe["num_experts"]))
            counts = np.zeros((len(objs),) + shape, dtype=np.int64)
            for i, o in enumerate(objs):
                if "moe" not in o:
                    continue
                try:
                    c = np.asarray(o["moe"], dtype=np.int64)
                    if c.shape != shape or (c < 0).any():
                        raise ValueError(f"shape {c.shape}, expected {shape}, non-negative")
                    counts[i] = c
                except (ValueError, TypeError) as e:
                    bad.setdefault(i, ("moe", f"bad expert counts: {e}"))
        tr = v.finish(lines, t, inp, out, bad, extra={"prefix_hashes": prefix, "moe_counts": counts})
        if tr is not None:
            tr.start_time = (header or {}).get("start_time")
            tr.meta["model"] = (header or {}).get("model")
            if counts is not None and tr.moe_counts is not None:
                s = tr.moe_counts.sum(axis=0)
                totals = s if totals is None else totals + s
                tr.routing = _routing(totals, moe)
        return tr

    with open_text(path) as f:
        for k, line in enumerate(f, start=1):
            ln = physical_line(path, k)
            s = line.strip()
            if not s:
                continue
            try:
                obj = json.loads(s, parse_float=RawFloat)
            except json.JSONDecodeError as e:
                if header is None:
                    raise TraceFormatError(f"header is not JSON: {e.msg}", path=str(path), line=ln) from None
                what = "truncated JSON line" if not line.endswith("\n") else "invalid JSON"
                v.fail(ln, None, f"{what}: {e.msg} at column {e.colno}")
                continue
            if header is None:
                if not isinstance(obj, dict) or obj.get("tkcc_trace") != VERSION:
                    raise TraceFormatError(f"first line must be a header with \"tkcc_trace\": {VERSION}",
                                           path=str(path), line=ln, field="tkcc_trace")
                header = obj
                continue
            any_rows = True
            if not isinstance(obj, dict):
                v.fail(ln, None, "expected a JSON object")
                continue
            lines.append(ln)
            objs.append(obj)
            if len(lines) >= chunk_rows:
                tr = flush()
                lines, objs = [], []
                if tr is not None:
                    yield tr
    if header is None:
        raise TraceFormatError("file is empty", path=str(path), line=1)
    if lines:
        tr = flush()
        lines, objs = [], []
        if tr is not None:
            yield tr
    v.done(any_rows, header_line=2)
    if v.pending:
        tr = flush()
        if tr is not None:
            yield tr


def _routing(totals: np.ndarray, moe: dict):
    from tkcc.traffic.routing import Routing

    return Routing.from_counts(totals, top_k=int(moe["top_k"]), source="tkcc trace")


def write_trace(trace: Trace, path, model: str | None = None) -> None:
    """Write any Trace in tkcc format (per-request MoE counts included when the trace has them)."""
    moe = None
    if trace.moe_counts is not None:
        _, nl, ne = trace.moe_counts.shape
        top_k = getattr(trace.routing, "top_k", None) or 1
        moe = {"num_layers": nl, "num_experts": ne, "top_k": int(top_k)}
    with TraceRecorder(path, start_time=trace.start_time, model=model or trace.meta.get("model"), moe=moe) as rec:
        for i in range(len(trace)):
            rec.record(float(trace.arrival_s[i]), int(trace.input_tokens[i]), int(trace.output_tokens[i]),
                       prefix=trace.prefix_hashes[i] if trace.prefix_hashes is not None else None,
                       moe=trace.moe_counts[i] if trace.moe_counts is not None else None)


class TraceRecorder:
    """Appends requests to a tkcc trace as they are served; each line is flushed whole.

    A reader following the file (``tkcc.traffic.follow``) only ever sees
    complete lines, so recording and watching can run at the same time.
    """

    def __init__(self, path, start_time: str | None = None, model: str | None = None, moe: dict | None = None):
        self.path = str(path)
        exists = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        self._f = open(self.path, "a", encoding="utf-8")
        if not exists:
            hdr = {"tkcc_trace": VERSION, "start_time": start_time, "model": model, "moe": moe}
            self._f.write(json.dumps(hdr) + "\n")
            self._f.flush()

    def record(self, t: float, input_tokens: int, output_tokens: int, prefix=None, moe=None) -> None:
        obj = {"t": round(float(t), 6), "in": int(input_tokens), "out": int(output_tokens)}
        if prefix is not None:
            obj["prefix"] = [int(h) for h in prefix]
        if moe is not None:
            obj["moe"] = np.asarray(moe, dtype=np.int64).tolist()
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
