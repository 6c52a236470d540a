"""The server's own traffic, recorded as a rolling tkcc trace (``tkcc.traffic.tkcc_format``).

One line per request, written when the request has been answered, in arrival
order (a batch-1 scheduler serves first-in first-out; with slots, requests end
out of arrival order and ``ArrivalOrder`` holds a line back until every request
that arrived before it has been written): arrival time
(seconds since the server started, the header's ``start_time``), prompt and
generated token counts, the prompt's prefix-block hashes, and the request's
per-layer MoE expert counts when they were taken. Each line is flushed whole,
so ``tkcc watch --trace-stream`` and ``tkcc.traffic.follow`` can follow the
file while it grows, and ``tkcc.traffic.load_trace`` reads it back.

Rolling: ``out`` names a folder; the current file is
``serve-<start>-<n>.jsonl`` and a new one starts after ``rotate_requests``
requests; only the newest ``keep`` files stay. Every file of one server
counts ``t`` from the same ``start_time``, so files concatenate.

Prefix-block hashes follow vLLM's prefix cache: the prompt in blocks of
``BLOCK`` tokens (full blocks only), each hash chained on the previous one, so
two prompts share a hash exactly while they share every token before it.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import struct
import threading
from pathlib import Path

from tkcc.errors import TkccError
from tkcc.traffic.tkcc_format import TraceRecorder

BLOCK = 16


def prefix_hashes(ids, block: int = BLOCK) -> list[int]:
    """Chained 63-bit hashes of each full ``block``-token prefix block of ``ids``."""
    out, prev = [], b""
    for lo in range(0, len(ids) - block + 1, block):
        h = hashlib.blake2b(prev + struct.pack(f"<{block}q", *ids[lo:lo + block]), digest_size=8).digest()
        out.append(int.from_bytes(h, "little") >> 1)
        prev = h
    return out


class RollingTrace:
    """Appends served requests to the newest file of a folder, rotating by request count."""

    def __init__(self, out, model: str, moe: dict | None = None, rotate_requests: int = 100_000, keep: int = 10,
                 start_time: str | None = None):
        if rotate_requests < 1 or keep < 1:
            raise TkccError(f"trace rotation needs rotate_requests >= 1 and keep >= 1, got {rotate_requests}, {keep}")
        self.dir = Path(out)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TkccError(f"trace folder {out}: {e}") from None
        if not os.access(self.dir, os.W_OK):
            raise TkccError(f"trace folder {out} is not writable")
        self.model, self.moe = model, moe
        self.rotate, self.keep = int(rotate_requests), int(keep)
        self.start_time = start_time or datetime.datetime.now().isoformat(timespec="milliseconds")
        self._stamp = self.start_time.replace(":", "").replace("-", "").replace(".", "")[:15]
        self._n = 0
        self._rec: TraceRecorder | None = None
        self._in_file = 0
        self.recorded = 0
        self._lock = threading.Lock()
        self.path = self._open()

    def _open(self) -> Path:
        self._n += 1
        path = self.dir / f"serve-{self._stamp}-{self._n:04d}.jsonl"
        self._rec = TraceRecorder(path, start_time=self.start_time, model=self.model, moe=self.moe)
        self._in_file = 0
        mine = sorted(self.dir.glob(f"serve-{self._stamp}-*.jsonl"))
        for old in mine[:-self.keep]:
            old.unlink(missing_ok=True)
        return path

    def record(self, t: float, input_ids, output_tokens: int, moe=None) -> None:
        with self._lock:
            if self._in_file >= self.rotate:
                self._rec.close()
                self.path = self._open()
            self._rec.record(t, len(input_ids), output_tokens, prefix=prefix_hashes(input_ids), moe=moe)
            self._in_file += 1
            self.recorded += 1

    def close(self) -> None:
        with self._lock:
            if self._rec is not None:
                self._rec.close()
                self._rec = None


class ArrivalOrder:
    """Hands records to ``write`` in arrival order (``seq``: 0, 1, 2, ...) when requests finish out of it.

    The trace format wants lines in arrival order (its readers check it), and with continuous batching a short
    request that arrived later finishes before a long one: its line waits for the long one's. ``flush`` writes
    whatever is held, in order, past any gap (a request that never finished: the server stopped)."""

    def __init__(self, write):
        self.write = write
        self.next = 0
        self.held: dict[int, tuple] = {}

    def add(self, seq: int, *args, **kwargs) -> None:
        self.held[seq] = (args, kwargs)
        while self.next in self.held:
            a, kw = self.held.pop(self.next)
            self.write(*a, **kw)
            self.next += 1

    def flush(self) -> None:
        for seq in sorted(self.held):
            a, kw = self.held.pop(seq)
            self.write(*a, **kw)
            self.next = seq + 1
