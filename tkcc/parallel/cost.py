"""Cost model: predicted decode ms/token of each legal (degree, strategy), explained term by term.

Decode at small batch is memory-bound: each rank reads its share of the
weights and of the KV cache once per token, then the ranks sum partial
results with all-reduces, and the host must issue every op of the graph.
The model adds those costs up, per rank, from the model's shapes and the
machine's measured numbers (``machine.py``):

  weights_ms    dense weight bytes on the rank (attention, dense MLP, router,
                lm_head) / measured stream bandwidth (a large copy; the
                matvec bandwidth when that was not measured);
  experts_ms    MoE expert bytes the rank moves: the captured graph gathers
                one expert copy per (token, expert) pair (``index``) and
                multiplies it (``bmm``), so each pair costs 3x its bytes (read
                the weight, write the copy, read the copy). ``tp``: every rank
                handles all B*k pairs at 1/degree of an expert; ``tp_ep``: the
                graph keeps static shapes, so every rank gathers all B*k pairs at
                full size and masks those whose expert it does not own (the
                busiest rank's share under the routing distribution, what a
                compacting kernel would move, is reported in the notes);
  kv_ms         attention over the KV cache: per layer the larger of the
                bytes it reads (2 * kv_heads/degree * head_dim * cache_len *
                batch * dtype bytes, n_rep times for GQA, whose K/V reach
                attention repeated) over the stream bandwidth and the measured
                per-call floor (``attn_floor_us``); for GQA, plus materialising
                the repeated K/V (HF passes expanded views; the attention
                backend copies them: read and write n_rep times the cache) at
                the measured ``expand_copy_gbs``. Without those two numbers:
                the cache bytes times (1 + 2*n_rep) at the stream bandwidth;
  weights_ms    also counts ``gemv_us`` - ``kernel_us`` per GEMV (a weight-
                streaming kernel's ramp and tail beyond the small-kernel floor);
  topk_ms       MoE router top-k calls x (``topk_us`` - ``kernel_us``);
  all_reduce_ms collectives per token x the measured all-reduce fit at that
                degree, t = lat + bytes * 2(d-1)/d / busbw;
  all_gather_ms the vocabulary-parallel logits gathered once per token;
  kernels_ms    kernels x the per-kernel floor (``kernel_us``);
  host_ms       graph ops x host dispatch cost (``dispatch_us``), eager only.

Device time is the sum of all but host_ms; eager execution overlaps host and
device, so the prediction is max(host_ms, device_ms) in eager mode and
device_ms under CUDA graphs. Every prediction carries the terms, the bytes
behind them, and which numbers were extrapolated (degrees above the devices
measured).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from tkcc.parallel.layout import DEGREES, ModelDims, check_layout, legal_layouts
from tkcc.parallel.machine import MachineProfile

# Graph ops per decoder layer and outside the layers, counted (``count_ops``)
# on bf16 decode graphs of the tiny models captured with 2 and 3 layers
# (tests/parallel checks them against a fresh capture):
# (host ops per layer, kernels per layer, fixed host ops, fixed kernels).
OPS_PER_FAMILY = {
    "llama": (60, 40, 49, 27),
    "olmoe": (96, 65, 49, 27),
    "mixtral": (88, 52, 49, 27),
    "qwen3_moe": (102, 65, 49, 27),
}
# ops views/aliases only: the host issues them, no kernel runs
NO_KERNEL = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "transpose", "permute", "t", "expand",
             "slice", "select", "alias", "detach", "getitem", "split", "chunk", "wait_tensor", "narrow",
             "sym_size"}
EXPERT_PAIR_TRAFFIC = 3.0


@dataclass
class Prediction:
    degree: int
    strategy: str
    ms_per_token: float
    terms: dict  # name -> ms
    bytes: dict  # name -> bytes per rank per token
    counts: dict  # collectives / ops per token
    notes: list = field(default_factory=list)
    batch: int = 1
    context: int = 0
    mode: str = "eager"

    def to_json(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        rows = [f"degree={self.degree} strategy={self.strategy} batch={self.batch} context={self.context} "
                f"mode={self.mode}: {self.ms_per_token:.3f} ms/token"]
        for k, v in self.terms.items():
            rows.append(f"  {k:<14} {v:9.4f} ms")
        rows += [f"  note: {n}" for n in self.notes]
        return "\n".join(rows)


GEMV_OPS = {"linear", "mm", "addmm"}  # weight GEMVs (the rotary matmul is tiny)


def count_ops(gm) -> dict:
    """Host ops, kernel-launching ops and GEMVs of a GraphModule (call_function nodes)."""
    host = kernels = gemv = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        host += 1
        gemv += name in GEMV_OPS
        if name in NO_KERNEL:
            continue
        if name in ("to", "_to_copy", "contiguous", "clone") and n.args:
            a = n.args[0]
            va, vn = getattr(a, "meta", {}).get("val"), n.meta.get("val")
            if va is not None and vn is not None and getattr(va, "dtype", None) == getattr(vn, "dtype", None) \
                    and name != "clone":
                continue
        kernels += 1
    return {"host_ops": host, "kernels": kernels, "gemv": gemv}


def estimate_gemv(dims: ModelDims) -> int:
    """GEMVs per decode step as HF's modules issue them: q, k, v, o (+ router, or gate, up, down), lm_head."""
    per_layer = 4 + (1 if dims.is_moe else 3)
    return per_layer * dims.layers + 1


def estimate_ops(dims: ModelDims) -> dict:
    per_host, per_k, fix_host, fix_k = OPS_PER_FAMILY.get(dims.family, OPS_PER_FAMILY["llama"])
    return {"host_ops": per_host * dims.layers + fix_host, "kernels": per_k * dims.layers + fix_k,
            "gemv": estimate_gemv(dims)}


def collectives_per_token(dims: ModelDims, degree: int, strategy: str) -> dict:
    """All-reduces and all-gathers the sharded decode graph runs per token.

    ``all_reduce``: hidden-state sums (after attention and after the MLP/MoE of
    each layer); ``all_reduce_small``: OLMoE's q/k RMSNorm sums of squares,
    merged into one per layer by the sharding pass; ``all_gather``: logits.
    """
    if degree == 1:
        return {"all_reduce": 0, "all_reduce_small": 0, "all_gather": 0}
    small = dims.layers if dims.family == "olmoe" else 0
    return {"all_reduce": 2 * dims.layers, "all_reduce_small": small, "all_gather": 1}


def extra_ops(dims: ModelDims, degree: int, strategy: str) -> dict:
    """Ops the sharding adds per token, as the pass writes them.

    all-reduce + wait per collective; the logits gather is permute, clone,
    gather, wait, permute; a merged q/k norm sum is stack, all-reduce, wait and
    two selects plus the two mean rescales; EP adds 5 id ops (sub, ge, lt,
    and, clamp) and a 3-op mask per MoE layer.
    """
    if degree == 1:
        return {"host_ops": 0, "kernels": 0}
    c = collectives_per_token(dims, degree, strategy)
    host = 2 * c["all_reduce"] + 5 * c["all_gather"] + 7 * c["all_reduce_small"]
    kernels = c["all_reduce"] + 2 * c["all_gather"] + 4 * c["all_reduce_small"]
    if dims.is_moe and strategy == "tp_ep":
        host += 8 * dims.layers
        kernels += 7 * dims.layers  # the view of the mask launches nothing
    return {"host_ops": host, "kernels": kernels}


def expected_busiest_pairs(experts: int, top_k: int, batch: int, degree: int, probs=None, trials: int = 4000,
                           seed: int = 0) -> float:
    """E[max over ranks of (token, expert) pairs routed to the rank's experts] (contiguous expert blocks)."""
    rng = np.random.default_rng(seed)
    p = np.full(experts, 1.0 / experts) if probs is None else np.asarray(probs, dtype=float) / np.sum(probs)
    per = experts // degree
    owner = np.arange(experts) // per
    # top-k without replacement per token, by Gumbel top-k on log p
    g = rng.gumbel(size=(trials, batch, experts)) + np.log(np.maximum(p, 1e-30))
    picks = np.argpartition(-g, top_k - 1, axis=-1)[..., :top_k]
    counts = np.zeros((trials, degree))
    for r in range(degree):
        counts[:, r] = (owner[picks] == r).sum(axis=(1, 2))
    return float(counts.max(axis=1).mean())


def _busiest(dims: ModelDims, batch: int, degree: int, routing) -> float:
    """Busiest rank's expected pairs; ``routing`` is None (uniform), per-expert probs, or a traffic Routing
    (per-layer probs: the mean over layers)."""
    probs = getattr(routing, "probs", routing)
    if probs is None:
        return expected_busiest_pairs(dims.experts, dims.top_k, batch, degree)
    p = np.asarray(probs, dtype=float)
    if p.ndim == 1:
        return expected_busiest_pairs(dims.experts, dims.top_k, batch, degree, p)
    return float(np.mean([expected_busiest_pairs(dims.experts, dims.top_k, batch, degree, row, trials=1000)
                          for row in p]))


def predict(dims: ModelDims, degree: int, strategy: str, machine: MachineProfile, *, batch: int = 1,
            context: int = 2048, cache_len: int | None = None, dtype_bytes: int = 2, mode: str = "eager",
            ops: dict | None = None, routing=None, check: bool = True) -> Prediction:
    """Predicted decode ms/token for one layout at one (batch, context)."""
    if check:
        check_layout(dims, degree, strategy, None, "cost model")
    d = degree
    L, Hd, hd = dims.layers, dims.hidden, dims.head_dim
    cache_len = cache_len or context
    notes = []
    attn = L * Hd * hd * (2 * dims.heads + 2 * dims.kv_heads) * dtype_bytes / d
    mlp = L * 3 * Hd * dims.intermediate * dtype_bytes / d
    router = L * dims.experts * Hd * dtype_bytes
    head = dims.vocab * Hd * dtype_bytes / d
    dense = attn + mlp + router + head
    experts = 0.0
    if dims.is_moe:
        one = 3 * Hd * dims.expert_intermediate * dtype_bytes
        pairs_total = batch * dims.top_k
        if strategy == "tp_ep" and d > 1:
            # the EP graph masks pairs it does not own instead of compacting them (static shapes for CUDA
            # graphs), so every rank still gathers and multiplies all B*k pairs at full expert size
            experts = L * pairs_total * one * EXPERT_PAIR_TRAFFIC
            busiest = _busiest(dims, batch, d, routing)
            notes.append(f"EP: every rank gathers all {pairs_total} (token, expert) pairs at full size and masks "
                         f"the ones it does not own; a compacting kernel would move {busiest:.2f} on the busiest "
                         f"rank (mean {pairs_total / d:.2f})")
        else:
            experts = L * pairs_total * one / d * EXPERT_PAIR_TRAFFIC
    n_rep = max(1, dims.heads // dims.kv_heads)
    cache = 2 * L * (dims.kv_heads / d) * hd * cache_len * batch * dtype_bytes  # K and V of every layer
    bw = (machine.stream_bw_gbs or machine.mem_bw_gbs) * 1e9
    base = dict(ops) if ops else estimate_ops(dims)
    n_gemv = base.get("gemv") or estimate_gemv(dims)
    gemv_extra_us = max(0.0, (machine.gemv_us or 0.0) - machine.kernel_us) if machine.gemv_us else 0.0
    weights_ms = dense / bw * 1e3 + n_gemv * gemv_extra_us / 1e3
    if machine.expand_copy_gbs and machine.attn_floor_us is not None:
        read = cache * n_rep
        per_layer_us = max(read / L / bw * 1e6, machine.attn_floor_us)
        kv_ms = L * per_layer_us / 1e3
        kv = read
        if n_rep > 1:
            copy = 2 * cache * n_rep
            kv_ms += copy / (machine.expand_copy_gbs * 1e9) * 1e3
            kv += copy
            notes.append(f"GQA: K/V reach attention repeated {n_rep}x and are materialised first "
                         f"({copy / 1e6:.1f} MB copied per token at {machine.expand_copy_gbs:.0f} GB/s)")
    else:
        kv = cache * (1 + 2 * n_rep if n_rep > 1 else 1)
        kv_ms = kv / bw * 1e3
    topk_ms = 0.0
    if dims.is_moe and machine.topk_us:
        topk_ms = L * max(0.0, machine.topk_us - machine.kernel_us) / 1e3
    terms = {"weights_ms": weights_ms, "experts_ms": experts / bw * 1e3, "kv_ms": kv_ms, "topk_ms": topk_ms}

    coll = collectives_per_token(dims, d, strategy)
    ar_ms = ag_ms = 0.0
    if d > 1:
        fmode = "cuda_graph" if mode == "cuda_graph" else "eager"
        fit, how = machine.fit(d, fmode)
        if how != "measured":
            notes.append(f"all-reduce at d={d} {how}")
        ar_ms = coll["all_reduce"] * fit.time_us(batch * Hd * dtype_bytes, d) / 1e3
        ar_ms += coll["all_reduce_small"] * fit.time_us(batch * 4, d) / 1e3
        # all-gather of logits: (d-1)/d of the vocab per rank; same latency model as all-reduce
        ag_ms = coll["all_gather"] * (fit.lat_us + batch * dims.vocab * dtype_bytes * (d - 1) / d
                                      / (fit.busbw_gbs * 1e3)) / 1e3
    terms["all_reduce_ms"] = ar_ms
    terms["all_gather_ms"] = ag_ms
    if not ops:
        notes.append("op counts estimated from the family's per-layer counts")
    extra = extra_ops(dims, d, strategy) if not (ops and ops.get("sharded")) else {"host_ops": 0, "kernels": 0}
    host_ops = base["host_ops"] + extra["host_ops"]
    kernels = base["kernels"] + extra["kernels"]
    terms["kernels_ms"] = kernels * machine.kernel_us / 1e3
    device_ms = sum(terms.values())
    host_ms = host_ops * machine.dispatch_us / 1e3 if mode == "eager" else 0.0
    terms["host_ms"] = host_ms
    total = max(device_ms, host_ms) if mode == "eager" else device_ms
    if mode == "eager":
        notes.append(f"{'host' if host_ms > device_ms else 'device'}-bound: host {host_ms:.3f} ms vs device "
                     f"{device_ms:.3f} ms")
    return Prediction(degree=d, strategy=strategy, ms_per_token=total, terms=terms,
                      bytes={"weights": dense, "experts": experts, "kv": kv},
                      counts={**coll, "host_ops": host_ops, "kernels": kernels}, notes=notes,
                      batch=batch, context=context, mode=mode)


def decode_buckets(workload) -> list[tuple[int, int, float]]:
    """(batch, context, weight) of a Workload's decode buckets, weights renormalised."""
    bs = [b for b in workload.buckets if b.phase == "decode"]
    if not bs:
        from tkcc.errors import TkccError

        raise TkccError(f"workload {workload.source or workload.fingerprint()}: no decode buckets to predict")
    total = sum(b.weight for b in bs) or 1.0
    return [(b.batch, b.context, b.weight / total) for b in bs]


def predict_workload(dims: ModelDims, degree: int, strategy: str, machine: MachineProfile, workload,
                     **kw) -> Prediction:
    """Weighted mean over the workload's decode buckets (the context distribution sets the KV bytes)."""
    parts = [(w, predict(dims, degree, strategy, machine, batch=b, context=c, routing=workload.routing, **kw))
             for b, c, w in decode_buckets(workload)]
    terms = {k: sum(w * p.terms[k] for w, p in parts) for k in parts[0][1].terms}
    byts = {k: sum(w * p.bytes[k] for w, p in parts) for k in parts[0][1].bytes}
    notes = [f"weighted over {len(parts)} decode buckets"] + parts[0][1].notes
    return Prediction(degree=degree, strategy=strategy, ms_per_token=sum(w * p.ms_per_token for w, p in parts),
                      terms=terms, bytes=byts, counts=parts[0][1].counts, notes=notes, batch=-1, context=-1,
                      mode=parts[0][1].mode)


def rank_layouts(dims: ModelDims, machine: MachineProfile, *, workload=None, batch: int = 1, context: int = 2048,
                 devices: int | None = None, degrees=DEGREES, **kw) -> list[Prediction]:
    """Every legal layout's prediction, fastest first (what the campaign measures first)."""
    out = []
    for d, s in legal_layouts(dims, devices, degrees):
        if workload is not None:
            out.append(predict_workload(dims, d, s, machine, workload, **kw))
        else:
            out.append(predict(dims, d, s, machine, batch=batch, context=context, **kw))
    return sorted(out, key=lambda p: p.ms_per_token)
