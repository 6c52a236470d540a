"""Turning raw rows into validated Trace chunks, shared by every format.

Each loader hands over one chunk of raw fields (strings or numbers) with their
file line numbers. Conversion is vectorised (a million rows in seconds); only
when a chunk fails does a per-row pass run, to name the exact line and field.
Bad rows either raise :class:`TraceFormatError` or, with ``skip_bad``, are
dropped and counted, with the first few kept in ``meta['skipped_lines']``.
"""
from __future__ import annotations

import re

import numpy as np

from tkcc.errors import TraceFormatError
from tkcc.traffic.trace import Trace

MAX_REPORTED = 20


class RowValidator:
    """Converts and checks chunks of one file, carrying state (last timestamp) across chunks."""

    def __init__(self, path: str, fmt: str, skip_bad: bool, check_order: bool = True):
        self.path, self.fmt, self.skip_bad, self.check_order = str(path), fmt, skip_bad, check_order
        self.last_t = -np.inf
        self.skipped = 0
        self.skipped_lines: list[dict] = []
        self.rows_ok = 0
        self.pending: list[dict] = []  # rows skipped before conversion, not yet attached to a chunk

    # -- errors -------------------------------------------------------------
    def fail(self, line: int | None, field: str | None, message: str) -> None:
        """Raise, or (skip_bad) record a skipped row. Returns normally only when skipping."""
        if not self.skip_bad:
            raise TraceFormatError(message, path=self.path, line=line, field=field)
        self.skipped += 1
        rec = {"line": line, "field": field, "reason": message}
        if len(self.skipped_lines) < MAX_REPORTED:
            self.skipped_lines.append(rec)
        self.pending.append(rec)

    # -- conversion ---------------------------------------------------------
    def numbers(self, raw: list, lines: list[int], field: str, dtype, bad: dict) -> np.ndarray:
        """Convert one column; rows that do not convert go into ``bad`` (index -> (field, why))."""
        try:
            arr = np.array(raw, dtype=dtype) if dtype is not np.int64 else _to_int(raw)
            if arr.shape != (len(raw),):
                raise ValueError("ragged")
            return arr
        except (ValueError, TypeError, OverflowError):
            pass
        out = np.zeros(len(raw), dtype=dtype)
        for i, v in enumerate(raw):
            try:
                out[i] = _to_int_one(v) if dtype is np.int64 else _to_float_one(v)
            except (ValueError, TypeError, OverflowError):
                why = (f"not a number of tokens: {_show(v)} (token counts are whole numbers written as digits)"
                       if dtype is np.int64 else f"not a number: {_show(v)}")
                bad.setdefault(i, (field, why))
        return out

    def finish(self, lines: list[int], t: np.ndarray, inp: np.ndarray, out: np.ndarray, bad: dict,
               extra: dict | None = None) -> Trace | None:
        """Check non-negative lengths, finite times and arrival order; return the good rows."""
        n = len(lines)
        if n == 0:
            if not self.pending:
                return None
            tr = Trace(np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64), source=self.path, format=self.fmt,
                       skipped=len(self.pending))
            tr.meta["skipped_lines"] = self.pending[:MAX_REPORTED]
            self.pending = []
            return tr
        for name, col in (("input", inp), ("output", out)):
            for i in np.nonzero(col < 0)[0]:
                bad.setdefault(int(i), (name, f"negative length {int(col[i])}"))
        for i in np.nonzero(~np.isfinite(t))[0]:
            bad.setdefault(int(i), ("timestamp", f"not a finite time: {t[i]}"))
        keep = np.ones(n, dtype=bool)
        for i in bad:
            keep[i] = False
        if self.check_order:
            # a row is out of order if it is earlier than any good row before it
            tt = np.where(keep, t, -np.inf)
            prev_max = np.maximum.accumulate(np.concatenate([[self.last_t], tt]))[:-1]
            for i in np.nonzero(keep & (t < prev_max))[0]:
                bad.setdefault(int(i), ("timestamp", f"timestamp goes backwards ({t[i]:.6f} < earlier {prev_max[i]:.6f}); "
                                        "traces must be in arrival order (duplicates are fine)"))
                keep[i] = False
                # later rows compare against the running max of rows kept before them
                if not self.skip_bad:
                    break
            if keep.any():
                self.last_t = max(self.last_t, float(t[keep].max()))
        for i in sorted(bad):
            field, why = bad[i]
            self.fail(lines[i], field, why)
        self.rows_ok += int(keep.sum())
        tr = Trace(arrival_s=t[keep], input_tokens=inp[keep], output_tokens=out[keep], source=self.path,
                   format=self.fmt, skipped=len(self.pending))
        if self.pending:
            tr.meta["skipped_lines"] = sorted(self.pending, key=lambda r: r["line"] or 0)[:MAX_REPORTED]
            self.pending = []
        if extra:
            for k, v in extra.items():
                if k == "prefix_hashes" and v is not None:
                    tr.prefix_hashes = [h for h, ok in zip(v, keep) if ok]
                elif k == "moe_counts" and v is not None:
                    tr.moe_counts = v[keep]
        return tr

    def done(self, any_rows: bool, header_line: int = 1) -> None:
        """Empty files and files with no valid row are errors, even under skip_bad."""
        if not any_rows:
            raise TraceFormatError("file has no requests (empty, or a header only)", path=self.path, line=header_line)
        if self.rows_ok == 0:
            raise TraceFormatError(f"no valid requests: all {self.skipped} rows were bad; first: "
                                   f"{self.skipped_lines[:1]}", path=self.path)


_INTEGER = re.compile(r"\s*-?[0-9]+(\.0*)?\s*$")  # '12', or '12.0' (some CSVs write floats); not 1e3, 12.5, 0,0


class RawFloat(float):
    """A JSON number with a fraction or exponent, keeping its text (``json.loads(parse_float=RawFloat)``), so
    ``1e3`` can be told from ``1000.0`` where a count of tokens is expected."""

    def __new__(cls, text: str):
        self = super().__new__(cls, text)
        self.text = text
        return self

    def __repr__(self) -> str:
        return self.text


def _show(v) -> str:
    return json_text(v) if isinstance(v, (bool, RawFloat)) or v is None else repr(v)


def json_text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    return v.text if isinstance(v, RawFloat) else repr(v)


def _to_int(raw: list) -> np.ndarray:
    """Token counts: plain integers, or decimal strings like '12' and '12.0'; anything else raises ValueError
    (``1e3``, ``12.5``, ``true``, ``0,0``), and the caller names the row."""
    if not raw:
        return np.zeros(0, dtype=np.int64)
    if all(type(v) is int for v in raw):
        return np.array(raw, dtype=np.int64)
    if all(isinstance(v, str) for v in raw):
        s = np.char.strip(np.array(raw, dtype=str))
        if bool(np.char.isdecimal(s).all()):
            return s.astype(np.int64)
    return np.array([_to_int_one(v) for v in raw], dtype=np.int64)


def _to_int_one(v) -> int:
    if isinstance(v, bool) or v is None:
        raise TypeError("not a token count")
    if isinstance(v, int):
        return v
    if isinstance(v, RawFloat):
        if "e" in v.text.lower() or v != round(v) or not np.isfinite(v):
            raise ValueError(f"not an integer: {v.text}")
        return int(v)
    if isinstance(v, float):
        if not np.isfinite(v) or v != round(v):
            raise ValueError(f"not an integer: {v!r}")
        return int(v)
    if isinstance(v, str) and _INTEGER.match(v):
        return int(float(v))
    raise ValueError(f"not an integer: {v!r}")


def _to_float_one(v) -> float:
    if isinstance(v, bool) or v is None:
        raise TypeError("not a number")
    return float(v)
