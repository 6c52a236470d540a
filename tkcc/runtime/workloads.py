"""Workloads over the wire, the engine's default workload, and the check that a bucket fits the model.

A Workload crosses the RPC boundary as JSON (buckets, objective, source);
routing distributions stay on the traffic side (the engine measures the
routing the inputs produce).

A slots Program (``tkcc.frontend.slots``: ``tkcc.compile(model, batch=B)``)
serves B requests at once: each request's prefill runs alone (batch 1), and
every decode step of every live request is one ``decode_slots`` step of all B
rows. ``for_program`` gives each batch-1 decode bucket its ``decode_slots``
twin at batch B (same context, weight and tokens), so the engine validates and
times that step like any phase; ``serving_view`` is what the objective is
computed on: each decode step at a context costs what the ``decode_slots`` step
costs there (every slot live, the server under load), the prefill what the
batch-1 prefill costs. The batch-1 decode buckets are still validated and
timed (one-token prompts are admitted through that step) and reported.
"""
from __future__ import annotations

from dataclasses import asdict, replace

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


SLOTS_PHASE = "decode_slots"  # tkcc.frontend.slots.PHASE (the runtime reads Programs, it does not build them)
SIZED_PHASES = ("prefill", "decode", SLOTS_PHASE)  # phases whose inputs a bucket's context sets


def input_bucket(b: Bucket) -> Bucket | None:
    """What ``Program.inputs`` takes for bucket ``b``: the bucket where its shape or context sets the inputs."""
    return b if b.shapes or b.phase in SIZED_PHASES else None


def for_program(program, w: Workload) -> Workload:
    """``w`` as ``program`` serves it: prompts longer than its prefill chunk as that chunk's step
    (``chunked_prefill``), and on a slots Program each batch-1 decode bucket gains its ``decode_slots`` twin at
    batch B (see the module docstring); a workload that names the slot step itself gains no twins."""
    w = chunked_prefill(program, w)
    n = int(program.meta.get("slots") or 0)
    if n < 2 or SLOTS_PHASE not in program.graphs or any(b.phase == SLOTS_PHASE for b in w.buckets):
        return w
    twins = [Bucket(SLOTS_PHASE, n, b.context, b.new_tokens, b.weight) for b in w.buckets
             if b.phase == "decode" and b.batch == 1]
    if not twins:
        return w
    return replace(w, buckets=list(w.buckets) + twins, meta={**w.meta, "slots": n})


def chunked_prefill(program, w: Workload) -> Workload:
    """On a Program whose prompts go in chunks (``meta["prefill_chunk"]``: the built-in MoE models' ``batched_mm``
    experts gather every token's top-k expert weights, 64 MiB a token for OLMoE, so ``generate`` and the server
    prefill ``chunk`` tokens a step), a prefill bucket longer than the chunk is the step serving runs: a prefill
    of ``chunk`` tokens, with the bucket's share of requests (those of one context merge). A whole 4k-token
    prompt in one step asked for 256 GiB on an H200 when ``tkcc compile`` validated OLMoE at the trace's
    longest prefill bucket; that step never runs."""
    chunk = int(program.meta.get("prefill_chunk") or 0)
    if chunk < 1 or not any(b.phase == "prefill" and b.context > chunk for b in w.buckets):
        return w
    out: dict[tuple, Bucket] = {}
    for b in w.buckets:
        if b.phase == "prefill" and b.context > chunk:
            b = replace(b, context=chunk)
        k = (b.phase, b.batch, b.context, b.shapes)
        if k in out:  # one bucket a shape: the merged share, the new_tokens of the larger share
            a = out[k]
            out[k] = replace(a if a.weight >= b.weight else b, weight=a.weight + b.weight)
        else:
            out[k] = b
    return replace(w, buckets=list(out.values()), meta={**w.meta, "prefill_chunk": chunk})


def serving_view(w: Workload, medians: dict[str, float]) -> tuple[Workload, dict[str, float]]:
    """The workload and per-bucket seconds the objective is computed on: with ``decode_slots`` buckets, the
    decode step at each of their contexts costs the slot step's time there (the batch-1 decode buckets of those
    contexts take its timing), and the slot buckets leave the workload (its request mix stays)."""
    slot = {b.context: medians[b.key()] for b in w.buckets if b.phase == SLOTS_PHASE and b.key() in medians}
    if not slot:
        return w, medians
    t = dict(medians)
    for b in w.buckets:
        if b.phase == "decode" and b.batch == 1 and b.context in slot:
            t[b.key()] = slot[b.context]
    return replace(w, buckets=[b for b in w.buckets if b.phase != SLOTS_PHASE]), t


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
        return for_program(program, Workload(buckets=buckets, source="engine default", mix=[(p, o, 1.0)],
                                             representative=[(p, o)]))
    phase = next(iter(program.graphs))
    return Workload(buckets=[Bucket(phase, weight=1.0)], objective="mean_latency_s", source="engine default")


def check_buckets(program, workload: Workload) -> None:
    """Every bucket must name a phase the model serves and fit its cache and batch; else a clear error."""
    cap = program.meta.get("max_cache_len")
    max_batch = program.meta.get("batch")
    slots = int(program.meta.get("slots") or 0)
    for i, b in enumerate(workload.buckets):
        where = f"workload bucket {i} ({b.key()})"
        if b.phase not in program.graphs:
            raise EngineError(f"{where}: phase {b.phase!r} is not served by this model; it has {program.phases}")
        if b.phase == SLOTS_PHASE:
            if b.batch != slots:
                raise EngineError(f"{where}: the {SLOTS_PHASE} step of this model decodes {slots} slots, not "
                                  f"batch {b.batch}")
        if cap is not None and b.phase in SIZED_PHASES:
            # a decode step at context c writes cache position c; a prefill of c tokens fills 0..c-1
            need = b.context if b.phase == "prefill" else b.context + 1
            if need > int(cap):
                raise EngineError(f"{where}: needs {need} cache positions but the model was captured with "
                                  f"max_cache_len={cap}; restart the engine with a larger --max-cache-len")
            if b.phase == "prefill" and b.context < 1:
                raise EngineError(f"{where}: a prefill bucket needs a prompt of at least 1 token")
        if max_batch is not None and b.batch > int(max_batch) and b.phase != SLOTS_PHASE:
            raise EngineError(f"{where}: batch {b.batch} exceeds the engine's batch {max_batch}")
