"""Turning raw rows into validated Trace chunks, shared by every format.

Each loader hands over one chunk of raw fields (strings or numbers) with their
file line numbers. Conversion is vectorised (a million rows in seconds); only
when a chunk fails does a per-row pass run, to name the exact line and field.
Bad rows either raise :class:`TraceFormatError` or, with ``skip_bad``, are
dropped and counted, with the first few kept in ``meta['skipped_lines']``.
"""
from __future__ import annotations

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
                out[i] = _to_int_one(v) if dtype is np.int64 else float(v)
            except (ValueError, TypeError, OverflowError):
                bad.setdefault(i, (field, f"not a number: {v!r}"))
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


def _to_int(raw: list) -> np.ndarray:
    """Integers from strings like '12' or '12.0' (some CSVs write floats); rejects 12.5."""
    try:
        return np.array(raw, dtype=np.int64)
    except (ValueError, TypeError):
        f = np.array(raw, dtype=np.float64)
        if not np.all(np.isfinite(f)) or np.any(f != np.round(f)):
            raise ValueError("non-integer")
        return f.astype(np.int64)


def _to_int_one(v) -> int:
    if isinstance(v, bool):
        raise TypeError("bool is not a token count")
    if isinstance(v, int):
        return v
    f = float(v)
    if not np.isfinite(f) or f != round(f):
        raise ValueError(f"not an integer: {v!r}")
    return int(f)
