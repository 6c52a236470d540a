"""Serving metrics from step timings: the numbers the engine and the campaign optimise.

What is modelled: each request is served on its own at one batch size (the
batch is the operating point being measured, filled by other requests like
it); no queueing. TTFT = prefill(batch, input); the first output token comes
from prefill; each later token is one decode step whose KV length is input +
tokens so far (``buckets.decode_contexts``). TPOT = mean decode step of the
request (requests with one output token have none); ITL = every decode
step, token-weighted; E2E = TTFT + all decode steps.

Headline numbers, all "P90 of the user experience":
  * ``p90_decode_tokens_per_s`` = 1 / P90(TPOT_i): 90% of requests decode at least this fast.
  * ``interactivity_p90`` = 1 / P90(E2E_i / output_tokens_i): InferenceX's E2E-normalised interactivity.
Percentiles are nearest rank (weighted for a Workload's request classes).

A timing model is any object with ``prefill(batch, contexts)`` and
``decode_step(batch, contexts)`` returning seconds for numpy arrays of
contexts: :class:`BucketTimingModel` interpolates measured per-bucket
timings, :class:`FunctionTimingModel` wraps two callables.
"""
from __future__ import annotations

import numpy as np

from tkcc.errors import TkccError
from tkcc.traffic.requests import clip_requests
from tkcc.traffic.stats import weighted_quantiles
from tkcc.traffic.trace import Trace
from tkcc.traffic.workload import Bucket, Workload

# objective name -> (key in serving_metrics, higher is better)
OBJECTIVES = {
    "p90_decode_tokens_per_s": ("p90_decode_tokens_per_s", True),
    "interactivity_p90": ("interactivity_p90", True),
    "p50_decode_tokens_per_s": ("p50_decode_tokens_per_s", True),
    "p90_ttft_s": ("ttft_s.p90", False),
    "p90_tpot_s": ("tpot_s.p90", False),
    "p90_e2e_s": ("e2e_s.p90", False),
    "mean_latency_s": ("mean_latency_s", False),  # forward-only workloads: weighted mean bucket time
}


def higher_is_better(objective_name: str) -> bool:
    if objective_name not in OBJECTIVES:
        raise TkccError(f"unknown objective {objective_name!r}; known: {sorted(OBJECTIVES)}")
    return OBJECTIVES[objective_name][1]


class FunctionTimingModel:
    """Timing model from two callables f(batch, contexts ndarray) -> seconds ndarray."""

    def __init__(self, prefill, decode_step, forward=None):
        self._p, self._d, self._f = prefill, decode_step, forward

    def prefill(self, batch, contexts):
        return np.asarray(self._p(batch, np.asarray(contexts, dtype=np.float64)), dtype=np.float64)

    def decode_step(self, batch, contexts):
        return np.asarray(self._d(batch, np.asarray(contexts, dtype=np.float64)), dtype=np.float64)


class BucketTimingModel:
    """Measured per-bucket seconds, linearly interpolated in context (extrapolated from the end segments).

    ``bucket_timings`` maps a Bucket or its ``key()`` to seconds (prefill: the
    whole prefill at batch b; decode: one step at batch b). Every bucket of
    the workload must have a timing; a missing one is an error naming it.
    """

    def __init__(self, workload: Workload, bucket_timings: dict):
        t = {(k.key() if isinstance(k, Bucket) else str(k)): float(v) for k, v in bucket_timings.items()}
        self.grids: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        missing = [b.key() for b in workload.buckets if b.key() not in t]
        if missing:
            raise TkccError(f"no timing for {len(missing)} bucket(s) of workload {workload.fingerprint()}: "
                            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
        bad = [k for k, v in t.items() if not np.isfinite(v) or v < 0]
        if bad:
            raise TkccError(f"bucket timings must be finite and >= 0: {bad[:5]}")
        self.forward = {b.key(): (b.weight, t[b.key()]) for b in workload.buckets if b.phase == "forward"}
        self.has_prefill = "prefill" in workload.phases()
        for phase in ("prefill", "decode"):
            for b in workload.batch_sizes():
                bs = sorted(workload.buckets_for(phase, b), key=lambda x: x.context)
                if bs:
                    self.grids[(phase, b)] = (np.array([x.context for x in bs], dtype=np.float64),
                                              np.array([t[x.key()] for x in bs]))

    def _interp(self, phase, batch, contexts):
        if phase == "prefill" and (phase, batch) not in self.grids and not self.has_prefill:
            # a decode-only workload (Workload.only("decode")): prefill is not measured, so every
            # TTFT-based figure comes out None while the decode figures stay exact
            return np.full(np.shape(contexts), np.nan)
        if (phase, batch) not in self.grids:
            raise TkccError(f"no {phase} timings at batch {batch}; have {sorted(self.grids)}")
        g, v = self.grids[(phase, batch)]
        x = np.asarray(contexts, dtype=np.float64)
        y = np.interp(x, g, v)
        if g.size >= 2:
            lo, hi = x < g[0], x > g[-1]
            y[lo] = v[0] + (x[lo] - g[0]) * (v[1] - v[0]) / (g[1] - g[0])
            y[hi] = v[-1] + (x[hi] - g[-1]) * (v[-1] - v[-2]) / (g[-1] - g[-2])
        return np.maximum(y, 0.0)

    def prefill(self, batch, contexts):
        return self._interp("prefill", batch, contexts)

    def decode_step(self, batch, contexts):
        return self._interp("decode", batch, contexts)


def _as_timing_model(workload, timing_model):
    if isinstance(timing_model, dict):
        if not isinstance(workload, Workload):
            raise TkccError("per-bucket timings need the Workload they were measured on")
        return BucketTimingModel(workload, timing_model)
    if not (hasattr(timing_model, "prefill") and hasattr(timing_model, "decode_step")):
        raise TkccError("timing_model needs prefill(batch, contexts) and decode_step(batch, contexts) "
                        "(or pass a dict of per-bucket timings)")
    return timing_model


def _pct(values, weights) -> dict:
    keep = np.isfinite(values)  # NaN: not measured (decode-only workloads have no TTFT)
    values, weights = values[keep], np.asarray(weights)[keep]
    if values.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = weighted_quantiles(values, weights, (0.5, 0.9, 0.99))
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float((values * weights).sum() / weights.sum())}


def _per_request(tm, batch: int, L: np.ndarray, O: np.ndarray, W: np.ndarray):
    """TTFT, sum of decode steps per request, and the ITL distribution (values, token weights); exact.

    Decode step time depends on the KV length only, so the model is
    evaluated once per integer context c < max(L+O): prefix sums F give each
    request's decode time F[L+O] - F[L+1] (steps at L+1..L+O-1), and a
    difference array gives how many steps (weighted) run at each context.
    O(requests + max context), no per-token loop.
    """
    ttft = tm.prefill(batch, L.astype(np.float64))
    has = O >= 2
    if not has.any():  # nothing decodes: no decode timings needed
        return ttft, np.zeros(L.size), np.empty(0), np.empty(0)
    top = int((L + O).max()) + 1
    ctx = np.arange(top, dtype=np.float64)
    f = tm.decode_step(batch, ctx)
    F = np.concatenate([[0.0], np.cumsum(f)])
    dsum = np.where(has, F[np.minimum(L + O, top)] - F[np.minimum(L + 1, top)], 0.0)
    diff = np.zeros(top + 1)
    np.add.at(diff, (L + 1)[has], W[has])
    np.add.at(diff, (L + O)[has], -W[has])
    steps_at = np.cumsum(diff)[:top]
    nz = steps_at > 1e-15
    return ttft, dsum, f[nz], steps_at[nz]


def serving_metrics(workload_or_trace, timing_model, *, max_context: int | None = None,
                    batch_sizes=None) -> dict:
    """TTFT/TPOT/ITL/E2E percentiles, P90 per-user decode tokens/s and E2E-normalised interactivity.

    ``workload_or_trace``: a Trace (request by request, exact) or a Workload
    (its request classes ``mix``, weighted; or, for forward-only workloads,
    the weighted mean bucket time). ``timing_model``: see module doc, or a
    dict of per-bucket timings (with a Workload). ``batch_sizes`` default to
    the workload's, or (1,) for a trace; several batch sizes are pooled with
    equal weight and also reported one by one under ``per_batch``.
    ``max_context`` clips a trace's requests as ``workload_from_trace`` does
    (a Workload was clipped when built).
    """
    x = workload_or_trace
    if isinstance(x, Workload) and x.phases() == {"forward"}:
        return _forward_metrics(x, timing_model)
    tm = _as_timing_model(x, timing_model)
    if isinstance(x, Workload):
        if not x.mix:
            raise TkccError("workload has no request mix (built by hand?); build it with workload_from_trace")
        arr = np.array(x.mix, dtype=np.float64)
        L, O, W = arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64), arr[:, 2]
        bs = tuple(batch_sizes or x.batch_sizes() or (1,))
        what = {"workload": x.fingerprint(), "classes": len(x.mix), "requests": x.meta.get("requests")}
    elif isinstance(x, Trace):
        if len(x) == 0:
            raise TkccError(f"{x.source or 'trace'}: no requests")
        req = clip_requests(x.input_tokens, x.output_tokens, max_context, "clip", x.source)
        L, O, W = req.input_tokens, req.output_tokens, np.ones(len(x))
        bs = tuple(batch_sizes or (1,))
        what = {"trace": x.source, "requests": len(x), "clipped": req.clipped}
    else:
        raise TkccError(f"serving_metrics takes a Workload or a Trace, got {type(x).__name__}")
    per_batch, pooled = {}, {k: [] for k in ("ttft", "tpot", "tpot_w", "e2e", "e2e_w", "norm", "norm_w",
                                             "itl", "itl_w", "ttft_w")}
    for b in bs:
        ttft, dsum, itl_v, itl_w = _per_request(tm, b, L, O, W)
        e2e = ttft + dsum
        has_dec = O >= 2
        tpot = dsum[has_dec] / (O[has_dec] - 1)
        has_out = O >= 1
        norm = e2e[has_out] / O[has_out]
        r = _summarise(ttft, W, tpot, W[has_dec], itl_v, itl_w, e2e, W, norm, W[has_out])
        per_batch[b] = r
        for k, v in (("ttft", ttft), ("ttft_w", W), ("tpot", tpot), ("tpot_w", W[has_dec]), ("e2e", e2e),
                     ("e2e_w", W), ("norm", norm), ("norm_w", W[has_out])):
            pooled[k].append(v)
        pooled["itl"].append(itl_v)
        pooled["itl_w"].append(itl_w / max(itl_w.sum(), 1e-300))
    if len(bs) == 1:
        out = per_batch[bs[0]]
    else:
        c = {k: np.concatenate(v) for k, v in pooled.items()}
        out = _summarise(c["ttft"], c["ttft_w"], c["tpot"], c["tpot_w"], c["itl"], c["itl_w"], c["e2e"],
                         c["e2e_w"], c["norm"], c["norm_w"])
        out["per_batch"] = {str(b): v for b, v in per_batch.items()}
    out["batch_sizes"] = list(bs)
    out["measured_on"] = what
    return out


def _summarise(ttft, ttft_w, tpot, tpot_w, itl, itl_w, e2e, e2e_w, norm, norm_w) -> dict:
    tp = _pct(tpot, tpot_w)
    nm = _pct(norm, norm_w)
    return {
        "ttft_s": _pct(ttft, ttft_w),
        "tpot_s": tp,
        "itl_s": _pct(itl, itl_w),
        "e2e_s": _pct(e2e, e2e_w),
        "e2e_per_output_token_s": nm,
        "p90_decode_tokens_per_s": (1.0 / tp["p90"]) if tp["p90"] else None,
        "p50_decode_tokens_per_s": (1.0 / tp["p50"]) if tp["p50"] else None,
        "interactivity_p90": (1.0 / nm["p90"]) if nm["p90"] else None,
    }


def _forward_metrics(w: Workload, timing_model) -> dict:
    if isinstance(timing_model, dict):
        t = {(k.key() if isinstance(k, Bucket) else str(k)): float(v) for k, v in timing_model.items()}
        missing = [b.key() for b in w.buckets if b.key() not in t]
        if missing:
            raise TkccError(f"no timing for bucket(s) {missing[:5]}")
        times = np.array([t[b.key()] for b in w.buckets])
    elif callable(timing_model):
        times = np.array([float(timing_model(b)) for b in w.buckets])
    else:
        raise TkccError("forward workloads need a dict of per-bucket timings or a callable(bucket) -> seconds")
    wts = np.array([b.weight for b in w.buckets])
    return {"mean_latency_s": float((times * wts).sum() / wts.sum()),
            "latency_s": _pct(times, wts), "measured_on": {"workload": w.fingerprint(), "buckets": len(w.buckets)}}


def objective(workload: Workload, bucket_timings: dict) -> float:
    """The workload's objective (``workload.objective``) from per-bucket timings (see OBJECTIVES for direction)."""
    name = workload.objective
    if name not in OBJECTIVES:
        raise TkccError(f"unknown objective {name!r}; known: {sorted(OBJECTIVES)}")
    m = serving_metrics(workload, bucket_timings)
    cur = m
    for part in OBJECTIVES[name][0].split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise TkccError(f"objective {name!r} does not apply to this workload (phases {sorted(workload.phases())})")
        cur = cur[part]
    if cur is None:
        raise TkccError(f"objective {name!r} is undefined here (no request has a decode step?)")
    return float(cur)
