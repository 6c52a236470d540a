"""A Workload per scientific model: the input sizes it sees in use, with their shares of traffic.

Uses the traffic package's one Workload (``Workload.from_shapes``); the
buckets are ``phase="forward"`` with named input shapes.
"""
from __future__ import annotations

from tkcc.traffic.workload import Bucket, Workload


def science_workload(model: str, items) -> Workload:
    """``items``: [(((name, shape), ...), weight), ...] -> Workload (weights normalised)."""
    items = [(dict(shapes), float(w)) for shapes, w in items]
    if hasattr(Workload, "from_shapes"):
        return Workload.from_shapes(items, source=f"tkcc.science:{model}", meta={"model": model})
    total = sum(w for _, w in items)
    buckets = [Bucket(phase="forward", batch=int(next(iter(s.values()))[0]), weight=w / total,
                      shapes=tuple((n, tuple(int(d) for d in v)) for n, v in s.items())) for s, w in items]
    return Workload(buckets=buckets, objective="mean_latency_s", source=f"tkcc.science:{model}",
                    meta={"model": model})


def bucket_label(bucket: Bucket) -> str:
    """Short human label of a bucket's shapes, e.g. ``x=8x3x224x224``."""
    return ",".join(f"{n}={'x'.join(map(str, s))}" for n, s in bucket.shapes)
