"""Following live traffic: a growing trace file, the recent window of it, and drift against a reference.

``TraceFollower`` reads only complete new lines (a line being written
without its newline yet waits for the next poll), so it can run while the
engine's ``TraceRecorder`` or a server appends to the file.
``RollingWorkload`` keeps the last ``horizon`` of requests and answers what
a ``tkcc watch`` loop asks: what does traffic look like now, has it drifted
from what the shipped candidate was tuned for, and what workload to
re-optimise on.
"""
from __future__ import annotations

import os
from collections import deque

import numpy as np

from tkcc.errors import TkccError, TraceFormatError
from tkcc.traffic.drift import DriftWindow, compare_windows, parse_window
from tkcc.traffic.loaders import FORMATS, detect_format
from tkcc.traffic.textio import MAX_LINE_BYTES, LineSource, decode_line

MAX_POLL_BYTES = 64 << 20  # read per poll at most (what is left is read by the next polls)
from tkcc.traffic.trace import Trace

_HEADER_FORMATS = {"azure2023", "burstgpt", "tkcc"}  # first line is a header
_FOLLOWABLE = {"azure2023", "burstgpt", "tkcc", "mooncake", "jsonl"}


class TraceFollower:
    """Each ``poll()`` returns the requests appended since the last poll (a Trace), or None."""

    def __init__(self, path, format: str | None = None, skip_bad: bool = False):
        self.path = str(path)
        self.format = format
        self.skip_bad = skip_bad
        self.offset = 0
        self.lines_read = 0
        self.header: str | None = None
        self.origin: float | None = None
        self.last_t = -np.inf
        self.skipped = 0
        self.requests = 0

    def poll(self) -> Trace | None:
        if not os.path.exists(self.path):
            return None
        size = os.path.getsize(self.path)
        if size < self.offset:
            raise TraceFormatError(f"file shrank from {self.offset} to {size} bytes (rotated or truncated); "
                                   "start a new follower", path=self.path)
        if size == self.offset:
            return None
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(min(size - self.offset, MAX_POLL_BYTES))  # bounded: a huge append is read over polls
        cut = data.rfind(b"\n")
        if cut < 0:
            if len(data) > MAX_LINE_BYTES:
                raise TraceFormatError(f"no end of line in the {len(data)} bytes after byte {self.offset}: longer "
                                       f"than {MAX_LINE_BYTES} bytes (a binary file?)", path=self.path,
                                       line=self.lines_read + 1)
            return None  # no complete line yet
        chunk = data[: cut + 1].split(b"\n")[:-1]
        raw = [decode_line(b, self.path, self.lines_read + 1 + k, first=self.offset == 0 and k == 0).rstrip("\r")
               for k, b in enumerate(chunk)]
        self.offset += cut + 1
        numbers = list(range(self.lines_read + 1, self.lines_read + 1 + len(raw)))
        self.lines_read += len(raw)
        if self.format is None:
            self.format = detect_format(self.path)
        if self.format not in _FOLLOWABLE:
            raise TkccError(f"cannot follow a {self.format} trace (formats that can be appended to: "
                            f"{sorted(_FOLLOWABLE)})")
        if self.format in _HEADER_FORMATS and self.header is None:
            while raw and not raw[0].strip():
                raw.pop(0)
                numbers.pop(0)
            if not raw:
                return None
            self.header, self.header_line = raw.pop(0), numbers.pop(0)
        if not any(r.strip() for r in raw):
            return None
        if self.format in _HEADER_FORMATS:
            src = LineSource(self.path, [self.header] + raw, [self.header_line] + numbers)
        else:
            src = LineSource(self.path, raw, numbers)
        opts = {"origin_epoch_s": self.origin} if self.format in ("azure2023", "jsonl") else {}
        try:
            parts = list(FORMATS[self.format](src, skip_bad=self.skip_bad, **opts))
        except TraceFormatError as e:
            if self.skip_bad and "no valid requests" in str(e):
                self.skipped += len(raw)
                return None
            raise
        tr = Trace.concat(parts)
        if self.origin is None and "origin_epoch_s" in tr.meta:
            self.origin = tr.meta["origin_epoch_s"]
        late = tr.arrival_s < self.last_t
        if late.any():
            if not self.skip_bad:
                raise TraceFormatError(f"{int(late.sum())} request(s) appended after line {numbers[0] - 1} arrive "
                                       f"before the previous poll's last request ({self.last_t:.3f} s)",
                                       path=self.path, line=numbers[0], field="timestamp")
            tr = tr.select(~late)
            tr.skipped += int(late.sum())
        if len(tr):
            self.last_t = float(tr.arrival_s[-1])
        self.skipped += tr.skipped
        self.requests += len(tr)
        return tr


class RollingWorkload:
    """The last ``horizon`` of a growing trace, and its drift against a reference window."""

    def __init__(self, path, *, horizon="1h", format: str | None = None, skip_bad: bool = False,
                 alpha: float = 1e-3, ratio: float = 1.5, min_tokens: int = 32, min_reopt_requests: int = 500):
        self.follower = TraceFollower(path, format, skip_bad)
        self.horizon_s = parse_window(horizon)
        self.parts: deque[Trace] = deque()
        self.reference: Trace | None = None
        self.params = {"alpha": alpha, "ratio": ratio, "min_tokens": min_tokens,
                       "min_reopt_requests": min_reopt_requests}

    def update(self) -> int:
        """Read what was appended; drop requests older than the horizon. Returns how many arrived."""
        new = self.follower.poll()
        if new is None or len(new) == 0:
            return 0
        self.parts.append(new)
        latest = float(new.arrival_s[-1])
        while self.parts and float(self.parts[0].arrival_s[-1]) < latest - self.horizon_s:
            self.parts.popleft()
        return len(new)

    def current(self) -> Trace:
        """Requests of the last ``horizon`` seconds (by arrival time)."""
        if not self.parts:
            return Trace(np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64), source=self.follower.path,
                         format=self.follower.format or "")
        tr = Trace.concat(list(self.parts))
        return tr.window(float(tr.arrival_s[-1]) - self.horizon_s, np.inf)

    def set_reference(self, trace: Trace | None = None) -> None:
        """What the shipped candidate was tuned on (default: the current window)."""
        self.reference = trace if trace is not None else self.current()

    def check(self) -> DriftWindow:
        """Drift verdict of the current window against the reference (set one first)."""
        if self.reference is None:
            raise TkccError("RollingWorkload.check: no reference yet; call set_reference() after shipping")
        return compare_windows(self.reference, self.current(), **self.params)

    def workload(self, **kwargs):
        """Workload of the current window (``workload_from_trace`` keyword arguments)."""
        from tkcc.traffic.buckets import workload_from_trace

        return workload_from_trace(self.current(), **kwargs)
