"""Trace: requests as they arrived, stored column-wise so a million rows stay cheap."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Trace:
    """Requests in arrival order.

    Columns are numpy arrays of equal length: ``arrival_s`` (float64, seconds
    from the first request), ``input_tokens`` and ``output_tokens`` (int64).
    ``prefix_hashes`` (one list of block hashes per request) and
    ``moe_counts`` (a :class:`tkcc.traffic.routing.Routing`) are optional.
    ``source`` names the file and format it came from; ``skipped`` counts rows
    dropped under ``--skip-bad`` (never silently).
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

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])
