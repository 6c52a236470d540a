"""Trace: requests as they arrived, stored column-wise so a million rows stay cheap."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


@dataclass
class Trace:
    """Requests in arrival order.

    Columns are numpy arrays of equal length: ``arrival_s`` (float64, seconds
    from the trace's origin: the first request, or the file's own t=0 where
    the format defines one, e.g. ServeGen's 00:00 of day 0), ``input_tokens``
    and ``output_tokens`` (int64, >= 0). ``prefix_hashes`` (one list of block
    hashes per request) is optional. ``routing`` is a
    :class:`tkcc.traffic.routing.Routing` aggregated from per-request MoE
    counts when the file carries them; ``moe_counts`` keeps the per-request
    counts (n, layers, experts) when asked. ``source`` names the file and
    ``format`` its format; ``skipped`` counts rows dropped under ``skip_bad``
    (never silently: ``meta['skipped_lines']`` lists the first few, with why).
    """

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    prefix_hashes: list[list[int]] | None = None
    routing: object | None = None
    source: str = ""
    format: str = ""
    start_time: str | None = None  # wall-clock time of arrival_s == 0, ISO 8601, when known
    skipped: int = 0
    meta: dict = field(default_factory=dict)
    moe_counts: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.arrival_s = np.asarray(self.arrival_s, dtype=np.float64)
        self.input_tokens = np.asarray(self.input_tokens, dtype=np.int64)
        self.output_tokens = np.asarray(self.output_tokens, dtype=np.int64)
        n = self.arrival_s.shape[0]
        if self.input_tokens.shape[0] != n or self.output_tokens.shape[0] != n:
            raise ValueError(
                f"Trace columns differ in length: arrival_s {n}, input_tokens {self.input_tokens.shape[0]}, "
                f"output_tokens {self.output_tokens.shape[0]}")

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    @property
    def has_timestamps(self) -> bool:
        """False for length-only datasets (ShareGPT): arrivals are then the row index, not time."""
        return bool(self.meta.get("timestamps", True))

    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    def select(self, index) -> "Trace":
        """A sub-trace (boolean mask, slice or index array); keeps source and format."""
        idx = np.arange(len(self))[index]
        ph = [self.prefix_hashes[i] for i in idx] if self.prefix_hashes is not None else None
        mc = self.moe_counts[idx] if self.moe_counts is not None else None
        return replace(self, arrival_s=self.arrival_s[idx], input_tokens=self.input_tokens[idx],
                       output_tokens=self.output_tokens[idx], prefix_hashes=ph, moe_counts=mc,
                       meta=dict(self.meta))

    def window(self, start_s: float, end_s: float) -> "Trace":
        """Requests with start_s <= arrival_s < end_s."""
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s], side="left")
        return self.select(slice(int(lo), int(hi)))

    @staticmethod
    def concat(parts: list["Trace"]) -> "Trace":
        """Join chunks of one file (as yielded by ``iter_trace``) back into one Trace."""
        if not parts:
            raise ValueError("Trace.concat needs at least one part")
        first = parts[0]
        ph = None
        if all(p.prefix_hashes is not None for p in parts):
            ph = [h for p in parts for h in p.prefix_hashes]
        mc = None
        if all(p.moe_counts is not None for p in parts):
            mc = np.concatenate([p.moe_counts for p in parts])
        meta = dict(parts[-1].meta)
        lines = [x for p in parts for x in p.meta.get("skipped_lines", [])]
        if lines:
            meta["skipped_lines"] = lines[:20]
        return Trace(
            arrival_s=np.concatenate([p.arrival_s for p in parts]),
            input_tokens=np.concatenate([p.input_tokens for p in parts]),
            output_tokens=np.concatenate([p.output_tokens for p in parts]),
            prefix_hashes=ph, routing=parts[-1].routing, source=first.source, format=first.format,
            start_time=first.start_time, skipped=sum(p.skipped for p in parts), meta=meta, moe_counts=mc)
