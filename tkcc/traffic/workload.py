"""Workload: what a Trace means for one engine — weighted shape buckets to measure.

The traffic package builds it (``workload_from_trace``); the engine measures
each bucket; ``tkcc.traffic.metrics`` turns per-bucket timings back into the
objective. Non-LLM models (scientific, vision) use ``Bucket.shapes`` instead of
token counts, so there is one Workload for every kind of model.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Bucket:
    """One shape the engine measures, with the share of traffic it stands for.

    LLM buckets: ``phase`` is ``"prefill"`` or ``"decode"``; ``batch`` is the
    number of sequences; ``context`` the tokens in the KV cache (decode) or the
    prompt length (prefill); ``new_tokens`` the tokens generated per request in
    this bucket. Other models: ``phase="forward"`` and ``shapes`` maps each
    input name to its shape. ``weight`` is the fraction of the objective this
    bucket carries; a Workload's weights sum to 1.
    """

    phase: str
    batch: int = 1
    context: int = 0
    new_tokens: int = 0
    weight: float = 1.0
    shapes: tuple = ()  # ((name, (d0, d1, ...)), ...) for non-LLM models; hashable

    def key(self) -> str:
        shp = ",".join(f"{n}={'x'.join(map(str, s))}" for n, s in self.shapes)
        return f"{self.phase}/b{self.batch}/c{self.context}/n{self.new_tokens}" + (f"/{shp}" if shp else "")


@dataclass
class Workload:
    """Weighted buckets plus, for MoE models, a routing distribution.

    ``objective`` names the metric the campaign maximises (see
    ``tkcc.traffic.metrics``); ``representative`` holds a few (input, output)
    token counts drawn from the trace, used as concrete requests for
    validation. ``routing`` is a ``tkcc.traffic.routing.Routing`` or None
    (uniform).
    """

    buckets: list[Bucket]
    objective: str = "p90_decode_tokens_per_s"
    routing: object | None = None
    representative: list[tuple[int, int]] = field(default_factory=list)
    source: str = ""
    meta: dict = field(default_factory=dict)

    def fingerprint(self) -> str:
        """Stable hash of what determines a measurement: buckets, objective, routing."""
        payload = {
            "buckets": [asdict(b) for b in self.buckets],
            "objective": self.objective,
            "routing": getattr(self.routing, "fingerprint", lambda: None)(),
        }
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def phases(self) -> set[str]:
        return {b.phase for b in self.buckets}
