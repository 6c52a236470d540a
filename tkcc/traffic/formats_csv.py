"""CSV trace formats: Azure LLM inference (2023/2024), ShareGPT length tables, BurstGPT.

Columns are found by header name, not position, so a reordered or extended
file still loads; a missing column is an error naming it.
"""
from __future__ import annotations

import csv
import datetime as _dt
import itertools
import re
from typing import Iterator

import numpy as np

from tkcc.errors import TraceFormatError
from tkcc.traffic.rows import RowValidator
from tkcc.traffic.textio import open_text, physical_line
from tkcc.traffic.trace import Trace

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
SHAREGPT_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_TZ = re.compile(r"(Z|[+-]\d\d:?\d\d)$")


def _columns(header: list[str], wanted: tuple[str, ...], path: str) -> list[int]:
    norm = [h.strip().lower() for h in header]
    idx = []
    for w in wanted:
        if w.lower() not in norm:
            raise TraceFormatError(f"missing column {w!r} (header has {header})", path=path, line=1, field=w)
        idx.append(norm.index(w.lower()))
    return idx


def _csv_chunks(path: str, wanted: tuple[str, ...], chunk_rows: int, v: RowValidator):
    """Yield (line numbers, list of column lists) per chunk; short rows are bad rows.

    Fast path: a chunk of lines without quotes, each with exactly the header's
    number of fields, is split with ``str.split`` and sliced into columns (no
    per-row Python work). Anything else goes through the ``csv`` module.
    Line numbers assume one row per physical line.
    """
    with open_text(path) as f:
        it = iter(f)
        header_line = next(it, None)
        if header_line is None or not header_line.strip():
            raise TraceFormatError("file is empty", path=str(path), line=1)
        try:
            header = next(csv.reader([header_line]))
        except csv.Error as e:
            raise TraceFormatError(f"unreadable CSV header: {e}", path=str(path), line=1) from None
        idx = _columns(header, wanted, str(path))
        need, ncol = max(idx) + 1, len(header)
        any_rows, lineno = False, 1
        while True:
            raw = list(itertools.islice(it, chunk_rows))
            if not raw:
                break
            first, lineno = lineno + 1, lineno + len(raw)
            if not raw[-1].endswith("\n"):
                raw[-1] += "\n"
            text = "".join(raw)
            if '"' not in text:
                flat = text.replace("\r", "").replace("\n", ",").split(",")
                if len(flat) == len(raw) * ncol + 1:
                    any_rows = True
                    lines = [physical_line(path, k) for k in range(first, first + len(raw))] \
                        if not isinstance(path, str) else list(range(first, first + len(raw)))
                    yield lines, [flat[i:-1:ncol] for i in idx]
                    continue
            try:
                rows = list(csv.reader(raw))
            except csv.Error as e:
                raise TraceFormatError(f"unreadable CSV: {e}", path=str(path), line=physical_line(path, first)) from None
            keep_rows, keep_lines = [], []
            for k, row in enumerate(rows):
                ln = physical_line(path, first + k)
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                any_rows = True
                if len(row) < need:
                    missing = [wanted[j] for j, i in enumerate(idx) if i >= len(row)]
                    v.fail(ln, missing[0], f"row has {len(row)} fields, expected at least {need}")
                    continue
                if len(row) > ncol and any(x.strip() for x in row[ncol:]):
                    v.fail(ln, None, f"row has {len(row)} fields, the header has {ncol}: a value holds an unquoted "
                                     "comma (a decimal comma, such as 0,5?)")
                    continue
                keep_rows.append(row)
                keep_lines.append(ln)
            if keep_rows:
                cols = list(zip(*keep_rows))
                yield keep_lines, [[x.strip() for x in cols[i]] for i in idx]
        v.done(any_rows)
        if v.pending:  # bad rows after the last good one still get reported
            yield [], [[] for _ in idx]


def _fixed_width_timestamps(s: list[str]) -> np.ndarray | None:
    """Digit arithmetic on 'YYYY-MM-DD HH:MM:SS[.f+]' of one fixed width; None if the chunk is not like that."""
    if not s:
        return None
    w = len(s[0])
    if w < 19 or (w > 19 and w < 21):
        return None
    try:
        b = np.array(s, dtype=f"S{w}")
    except (UnicodeEncodeError, ValueError):
        return None
    if b.dtype.itemsize != w:
        return None
    u = b.view(np.uint8).reshape(len(s), w)
    if (u[:, -1] == 0).any():  # a shorter string was padded: widths differ
        return None
    seps = {4: b"-", 7: b"-", 13: b":", 16: b":"}
    for pos, ch in seps.items():
        if (u[:, pos] != ord(ch)).any():
            return None
    if ((u[:, 10] != ord(" ")) & (u[:, 10] != ord("T"))).any() or (w > 19 and (u[:, 19] != ord(".")).any()):
        return None
    dig = u.astype(np.int64) - 48
    cols = [c for c in range(w) if c not in (4, 7, 10, 13, 16, 19)]
    if ((dig[:, cols] < 0) | (dig[:, cols] > 9)).any():
        return None

    def num(a, z):
        out = np.zeros(len(s), dtype=np.int64)
        for c in range(a, z):
            out = out * 10 + dig[:, c]
        return out

    y, mo, d = num(0, 4), num(5, 7), num(8, 10)
    hh, mm, ss = num(11, 13), num(14, 16), num(17, 19)
    if ((mo < 1) | (mo > 12) | (d < 1) | (d > 31) | (hh > 23) | (mm > 59) | (ss > 60)).any():
        return None
    # days from civil (H. Hinnant), vectorised
    y2 = y - (mo <= 2)
    era = np.floor_divide(y2, 400)
    yoe = y2 - era * 400
    doy = (153 * (mo + np.where(mo > 2, -3, 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    days = era * 146097 + doe - 719468
    sec = days * 86400 + hh * 3600 + mm * 60 + ss
    frac = np.zeros(len(s))
    if w > 20:
        frac = num(20, w) / 10.0 ** (w - 20)
    return sec.astype(np.float64) + frac


def parse_azure_timestamps(raw: list[str], lines: list[int], bad: dict) -> np.ndarray:
    """'YYYY-MM-DD HH:MM:SS.fffffff[+00:00]' -> seconds since the epoch (float64), vectorised."""
    s = raw
    if raw and _TZ.search(raw[0]):
        s = [_TZ.sub("", x) for x in raw]  # Azure 2024 writes +00:00; times are all UTC
    fast = _fixed_width_timestamps(s)
    if fast is not None:
        return fast
    try:
        ns = np.array(s, dtype="datetime64[ns]")
        return ns.astype(np.int64) / 1e9
    except (ValueError, TypeError):
        pass
    out = np.zeros(len(s))
    for i, x in enumerate(s):
        try:
            out[i] = np.datetime64(x.strip(), "ns").astype(np.int64) / 1e9
        except (ValueError, TypeError):
            bad.setdefault(i, ("TIMESTAMP", f"not a timestamp: {raw[i]!r}"))
    return out


def iter_azure(path: str, skip_bad: bool = False, chunk_rows: int = 200_000,
               check_order: bool = True, origin_epoch_s: float | None = None) -> Iterator[Trace]:
    """Azure LLM inference trace: TIMESTAMP, ContextTokens, GeneratedTokens.

    Arrivals count from the first row (or from ``origin_epoch_s``, seconds
    since the epoch, UTC, when given: a follower keeps one origin).
    """
    v = RowValidator(path, "azure2023", skip_bad, check_order)
    t0 = origin_epoch_s
    start = None if t0 is None else _dt.datetime.fromtimestamp(t0, _dt.timezone.utc).replace(tzinfo=None).isoformat()
    for lines, (ts, ctx, gen) in _csv_chunks(path, AZURE_COLUMNS, chunk_rows, v):
        bad: dict = {}
        t = parse_azure_timestamps(ts, lines, bad)
        inp = v.numbers(ctx, lines, "ContextTokens", np.int64, bad)
        out = v.numbers(gen, lines, "GeneratedTokens", np.int64, bad)
        good = [i for i in range(len(lines)) if i not in bad]
        if t0 is None and good:
            t0 = float(t[good[0]])
            start = _dt.datetime.fromtimestamp(t0, _dt.timezone.utc).replace(tzinfo=None).isoformat()
        tr = v.finish(lines, t - (t0 if t0 is not None else 0.0), inp, out, bad)
        if tr is not None:
            tr.start_time = start if t0 is not None else None
            tr.meta["origin_epoch_s"] = t0
            yield tr


def iter_sharegpt(path: str, skip_bad: bool = False, chunk_rows: int = 200_000,
                  check_order: bool = False) -> Iterator[Trace]:
    """ShareGPT length table: no timestamps; arrival_s is the row index and meta['timestamps'] is False."""
    v = RowValidator(path, "sharegpt", skip_bad, check_order=False)
    row = 0
    for lines, (pre, dec) in _csv_chunks(path, SHAREGPT_COLUMNS, chunk_rows, v):
        bad: dict = {}
        inp = v.numbers(pre, lines, "num_prefill_tokens", np.int64, bad)
        out = v.numbers(dec, lines, "num_decode_tokens", np.int64, bad)
        t = np.arange(row, row + len(lines), dtype=np.float64)
        row += len(lines)
        tr = v.finish(lines, t, inp, out, bad)
        if tr is not None:
            tr.meta["timestamps"] = False
            yield tr


def iter_burstgpt(path: str, skip_bad: bool = False, chunk_rows: int = 200_000,
                  check_order: bool = True) -> Iterator[Trace]:
    """BurstGPT: Timestamp (s), Request tokens, Response tokens. Failed requests (0 response tokens) are kept."""
    v = RowValidator(path, "burstgpt", skip_bad, check_order)
    for lines, (ts, req, resp) in _csv_chunks(path, BURSTGPT_COLUMNS, chunk_rows, v):
        bad: dict = {}
        t = v.numbers(ts, lines, "Timestamp", np.float64, bad)
        inp = v.numbers(req, lines, "Request tokens", np.int64, bad)
        out = v.numbers(resp, lines, "Response tokens", np.int64, bad)
        tr = v.finish(lines, t, inp, out, bad)
        if tr is not None:
            yield tr


CSV_FORMATS = {"azure2023": AZURE_COLUMNS, "sharegpt": SHAREGPT_COLUMNS, "burstgpt": BURSTGPT_COLUMNS}


def closest_csv_format(first_line: str) -> tuple[str, list[str]] | None:
    """(format, its missing columns) for a header that has some but not all of a CSV format's columns."""
    try:
        names = {h.strip().lower() for h in next(csv.reader([first_line]), [])}
    except csv.Error:
        return None
    best = None
    for fmt, cols in CSV_FORMATS.items():
        have = [c for c in cols if c.lower() in names]
        if have and (best is None or len(have) > best[0]):
            best = (len(have), fmt, [c for c in cols if c.lower() not in names])
    return (best[1], best[2]) if best else None


def sniff_csv_header(first_line: str) -> str | None:
    """Which CSV format a header line belongs to, or None."""
    names = {h.strip().lower() for h in next(csv.reader([first_line]), [])}
    if {c.lower() for c in AZURE_COLUMNS} <= names:
        return "azure2023"
    if {c.lower() for c in SHAREGPT_COLUMNS} <= names:
        return "sharegpt"
    if {c.lower() for c in BURSTGPT_COLUMNS} <= names:
        return "burstgpt"
    return None
