"""Workloads over the wire, the engine's default workload, and the check that a bucket fits the model.

A Workload crosses the RPC boundary as JSON (buckets, objective, source);
routing distributions stay on the traffic side (the engine measures the
routing the inputs produce).
"""
from __future__ import annotations

from dataclasses import asdict

from tkcc.errors import EngineError
from tkcc.traffic.workload import Bucket, Workload


def workload_to_json(w: Workload) -> dict:
    return {"buckets": [asdict(b) for b in w.buckets], "objective": w.objective, "source": w.source,
            "mix": [list(m) for m in w.mix], "representative": [list(r) for r in w.representative],
            "fingerprint": w.fingerprint()}


def workload_from_json(d) -> Workload:
    if isinstance(d, Workload):
        return d
    if not isinstance(d, dict) or not isinstance(d.get("buckets"), list) or not d["buckets"]:
        raise EngineError("workload: expected an object with a non-empty list 'buckets'")
    buckets = []
    fields = set(Bucket.__dataclass_fields__)
    for i, b in enumerate(d["buckets"]):
        if not isinstance(b, dict) or "phase" not in b:
            raise EngineError(f"workload.buckets[{i}]: expected an object with 'phase', got {b!r}")
        extra = set(b) - fields
        if extra:
            raise EngineError(f"workload.buckets[{i}]: unknown field(s) {sorted(extra)}; allowed: {sorted(fields)}")
        kw = dict(b)
        for name in ("batch", "context", "new_tokens"):
            if name in kw and (not isinstance(kw[name], int) or isinstance(kw[name], bool) or kw[name] < 0):
                raise EngineError(f"workload.buckets[{i}].{name}: expected a non-negative integer, got {kw[name]!r}")
        if "weight" in kw and (not isinstance(kw["weight"], (int, float)) or kw["weight"] < 0):
            raise EngineError(f"workload.buckets[{i}].weight: expected a non-negative number, got {kw['weight']!r}")
        if "shapes" in kw:
            try:
                kw["shapes"] = tuple((str(n), tuple(int(x) for x in s)) for n, s in kw["shapes"])
            except (TypeError, ValueError):
                raise EngineError(f"workload.buckets[{i}].shapes: expected [[name, [dims...]], ...]") from None
        buckets.append(Bucket(**kw))
    try:
        mix = [(int(i), int(o), float(x)) for i, o, x in d.get("mix") or []]
        rep = [(int(i), int(o)) for i, o in d.get("representative") or []]
    except (TypeError, ValueError):
        raise EngineError("workload.mix / workload.representative: expected [[input, output, share], ...] and "
                          "[[input, output], ...]") from None
    w = Workload(buckets=buckets, objective=str(d.get("objective", "p90_decode_tokens_per_s")),
                 source=str(d.get("source", "rpc")), mix=mix, representative=rep)
    want = d.get("fingerprint")
    if want is not None and want != w.fingerprint():
        raise EngineError(f"workload fingerprint {want} does not match its contents ({w.fingerprint()}); "
                          "it was changed in transit or built by a different tkcc version")
    return w


def default_workload(program) -> Workload:
    """A small workload for when the client gives none: short prefill plus decode at two contexts."""
    if "decode" in program.graphs:
        # one request class (prompt p, o new tokens); decode buckets bracket its contexts
        cap = int(program.meta.get("max_cache_len", 256))
        batch = int(program.meta.get("batch", 1))
        p = max(1, min(32, cap // 4))
        o = max(2, min(32, cap // 4))
        buckets = []
        if "prefill" in program.graphs:
            buckets.append(Bucket("prefill", batch, p, 0, 0.2))
        buckets.append(Bucket("decode", batch, p, o, 0.4))
        buckets.append(Bucket("decode", batch, p + o - 1, o, 0.4))
        return Workload(buckets=buckets, source="engine default", mix=[(p, o, 1.0)], representative=[(p, o)])
    phase = next(iter(program.graphs))
    return Workload(buckets=[Bucket(phase, weight=1.0)], objective="mean_latency_s", source="engine default")


def check_buckets(program, workload: Workload) -> None:
    """Every bucket must name a phase the model serves and fit its cache and batch; else a clear error."""
    cap = program.meta.get("max_cache_len")
    max_batch = program.meta.get("batch")
    for i, b in enumerate(workload.buckets):
        where = f"workload bucket {i} ({b.key()})"
        if b.phase not in program.graphs:
            raise EngineError(f"{where}: phase {b.phase!r} is not served by this model; it has {program.phases}")
        if cap is not None and b.phase in ("prefill", "decode"):
            # a decode step at context c writes cache position c; a prefill of c tokens fills 0..c-1
            need = b.context + 1 if b.phase == "decode" else b.context
            if need > int(cap):
                raise EngineError(f"{where}: needs {need} cache positions but the model was captured with "
                                  f"max_cache_len={cap}; restart the engine with a larger --max-cache-len")
            if b.phase == "prefill" and b.context < 1:
                raise EngineError(f"{where}: a prefill bucket needs a prompt of at least 1 token")
        if max_batch is not None and b.batch > int(max_batch):
            raise EngineError(f"{where}: batch {b.batch} exceeds the engine's batch {max_batch}")
