"""Durable journal of everything the engine did: one JSON line per record, fsynced before it is acknowledged.

The supervisor appends a record (experiment result, failure, recovery, swap)
and only then answers the client, so a client that loses its connection, or
an engine killed right after, loses no result: ``records()`` reads them back,
and a torn last line (a crash mid-write) is skipped, never misread.
"""
from __future__ import annotations

import json
import os
import threading
import time


class Journal:
    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lock = threading.Lock()
        self._seq = 0
        for rec in self.records():
            self._seq = max(self._seq, int(rec.get("seq", 0)))
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if os.path.getsize(path) and not self._ends_with_newline(path):
            os.write(self._fd, b"\n")  # close a torn last line, so the next record starts clean
            os.fsync(self._fd)

    @staticmethod
    def _ends_with_newline(path: str) -> bool:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def append(self, kind: str, **fields) -> dict:
        """Write one record and fsync it; returns the record with its sequence number."""
        with self._lock:
            self._seq += 1
            rec = {"seq": self._seq, "time": time.time(), "kind": kind, **fields}
            line = json.dumps(rec, default=str, allow_nan=True) + "\n"
            os.write(self._fd, line.encode())
            os.fsync(self._fd)
            return rec

    def records(self, since: int = 0, kind: str | None = None, request_id: str | None = None) -> list[dict]:
        out = []
        try:
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a torn line from a crash mid-write
                    if rec.get("seq", 0) <= since:
                        continue
                    if kind is not None and rec.get("kind") != kind:
                        continue
                    if request_id is not None and rec.get("request_id") != request_id:
                        continue
                    out.append(rec)
        except FileNotFoundError:
            pass
        return out

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
