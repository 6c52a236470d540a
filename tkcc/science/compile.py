"""compile_exact: a bit-exact, faster forward for a non-LLM model and its Workload.

    from tkcc.science import build, compile_exact
    sm = build("gcn", device="cuda")
    fast = compile_exact(sm.module, sm.workload, inputs=sm.make_inputs, deterministic=sm.deterministic)
    y = fast(*sm.inputs(sm.workload.buckets[0]))      # torch.equal to sm.module(...) under the same mode
    fast.report()

How it decides (per model, on CUDA):

1. ``whole``: probe one eager forward per bucket with CUDA sync debugging; if
   no bucket synchronises with the host, capture the whole forward once per
   bucket (``exact_cudagraph``), largest bucket first into one shared pool.
2. ``speculative``: otherwise, if every host read depends only on the model's
   own state (torchdiffeq comparing its time grid), capture the whole forward
   with those reads fixed and checked after every replay
   (``exact_cudagraph(speculate_host_reads=True)``).
3. ``regions``: otherwise cut the forward at its graph breaks
   (``exact_regions``) and capture every piece between host reads.
4. Golden check (invariant 2): on ``validate`` fresh inputs per bucket, each
   run twice (the second run replays graphs captured on first sight), every
   output must be ``torch.equal`` to eager. If ``whole`` fails it, ``regions``
   is tried; if that fails too, the forward stays eager (exact by
   definition) and the report says why. A non-exact forward is never returned.

On CPU there is nothing to capture: ``whole`` is the eager forward itself;
``regions`` still splits with TorchDynamo (the pieces run as FX graphs), which
is what the CPU tests check bit for bit.

``deterministic``: for models whose eager CUDA forward uses atomics
(``scatter_add_``), run under ``torch.use_deterministic_algorithms(True)``:
the reference, the capture and every call. Otherwise "bit-exact to eager"
has no meaning, as eager differs from itself.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable

import torch
import torch.utils._pytree as pytree

from tkcc.errors import TkccError
from tkcc.kernels.graph_replay import new_pool, probe_sync
from tkcc.passes.exact_cudagraph import CudaGraphForward, weight_pointers
from tkcc.passes.exact_regions import split_regions
from tkcc.traffic.workload import Bucket, Workload

MODES = ("auto", "whole", "speculative", "regions", "eager")


@contextlib.contextmanager
def deterministic_mode(on: bool):
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` for the duration, restored after."""
    if not on:
        yield
        return
    prev, prev_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUBLAS_WORKSPACE_CONFIG.*")
            warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
            yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def _device_of(model) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def default_inputs(device) -> Callable:
    """Inputs for a bucket when the caller gives no maker: one float tensor per named shape, positional."""
    def make(bucket: Bucket, gen: torch.Generator):
        if not bucket.shapes:
            raise TkccError(f"workload bucket {bucket.key()} has no input shapes; give compile_exact(inputs=...)")
        return tuple(torch.randn(tuple(s), generator=gen).to(device) for _, s in bucket.shapes)
    return make


def _tensors_equal(a, b) -> tuple[bool, str]:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb:
        return False, f"output structure differs: {sa} vs {sb}"
    for i, (x, y) in enumerate(zip(la, lb)):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.shape != y.shape or x.dtype != y.dtype:
                return False, f"output {i}: shape/dtype differs"
            if not torch.equal(x, y):
                d = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float("nan")
                return False, f"output {i}: values differ (max abs diff {d:.3g})"
        elif x != y:
            return False, f"output {i}: {x!r} != {y!r}"
    return True, ""


def _numel(bucket: Bucket) -> int:
    total = 0
    for _, s in bucket.shapes:
        n = 1
        for d in s:
            n *= int(d)
        total += n
    return total


class ExactForward:
    """The compiled forward: call it like the model. ``report()`` says what was captured and checked."""

    def __init__(self, model, impl, mode: str, deterministic: bool, info: dict):
        self.model, self._impl, self.mode, self.deterministic = model, impl, mode, deterministic
        self.info = info

    def __call__(self, *args, **kwargs):
        with torch.no_grad(), deterministic_mode(self.deterministic):
            return self._impl(*args, **kwargs)

    def reference(self, *args, **kwargs):
        """The eager forward under the same grad and determinism mode (what outputs must equal)."""
        with torch.no_grad(), deterministic_mode(self.deterministic):
            return self.model(*args, **kwargs)

    def report(self) -> dict:
        out = dict(self.info)
        out["mode"] = self.mode
        out["deterministic"] = self.deterministic
        if hasattr(self._impl, "report"):
            out["capture"] = self._impl.report()
        return out


def _candidate(model, mode: str, pool, ptrs):
    if mode in ("whole", "speculative"):
        return CudaGraphForward(model, name="forward", pool=pool, capture_after=1, static_ptrs=ptrs,
                                speculate=mode == "speculative")
    if mode == "regions":
        return split_regions(model, name="forward", pool=pool, capture_after=2, static_ptrs=ptrs)
    return model


def _graphs(cap) -> int:
    if not cap:
        return 0
    if "regions" in cap:
        return sum(r["graphs"] for r in cap["regions"])
    return int(cap.get("graphs", 0))


def _refusals(cap) -> list:
    if not cap:
        return []
    if "regions" in cap:
        return sorted({x for r in cap["regions"] for x in r["refused"]})
    return list(cap.get("refused", []))


def _golden_check(impl, model, per_bucket, deterministic) -> tuple[bool, str]:
    with torch.no_grad(), deterministic_mode(deterministic):
        for key, samples in per_bucket:
            for i, (args, ref) in enumerate(samples):
                for rep in range(2):
                    got = impl(*args)
                    ok, why = _tensors_equal(ref, got)
                    if not ok:
                        return False, f"bucket {key}, input {i}, run {rep + 1}: {why}"
    return True, ""


def compile_exact(model: torch.nn.Module, workload: Workload, inputs: Callable | None = None, *,
                  mode: str = "auto", deterministic: bool = False, validate: int = 2, seed: int = 1234
                  ) -> ExactForward:
    """Bit-exact compiled forward of ``model`` for the shapes in ``workload`` (see the module docstring).

    inputs:  ``(bucket, torch.Generator) -> tuple`` of positional args with
             exactly the bucket's shapes; default: one ``randn`` per named shape.
    mode:    "auto" (whole if nothing syncs, else speculative, else regions), or one of them, or "eager".
    """
    if mode not in MODES:
        raise TkccError(f"compile_exact: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(workload, Workload) or not workload.buckets:
        raise TkccError("compile_exact: workload must be a tkcc.traffic.workload.Workload with at least one bucket")
    if validate < 1:
        raise TkccError(f"compile_exact: validate must be >= 1 (golden check on fresh inputs), got {validate}")
    t0 = time.perf_counter()
    model.eval()
    device = _device_of(model)
    make = inputs or default_inputs(device)
    buckets = sorted(workload.buckets, key=_numel, reverse=True)  # largest first: pool reuse by smaller ones
    gen = torch.Generator().manual_seed(seed)
    per_bucket = []
    with torch.no_grad(), deterministic_mode(deterministic):
        for b in buckets:
            samples = []
            for _ in range(validate):
                args = make(b, gen)
                samples.append((args, model(*args)))
            per_bucket.append((b.key(), samples))
    cuda = device.type == "cuda"
    info = {"device": str(torch.cuda.get_device_name(device) if cuda else device), "buckets": [b.key() for b in buckets],
            "validated_inputs_per_bucket": validate, "tried": []}

    order = {"auto": ["whole", "regions"] if cuda else ["whole"], "whole": ["whole"], "regions": ["regions"],
             "speculative": ["speculative"], "eager": []}[mode]
    if mode == "auto" and cuda:
        with torch.no_grad(), deterministic_mode(deterministic):
            for key, samples in per_bucket:
                try:
                    why = probe_sync(model, samples[0][0])
                except Exception as e:  # noqa: BLE001 - whatever stops the probe also stops one whole graph
                    why = f"probe run failed: {type(e).__name__}: {e}"
                if why:
                    info["tried"].append({"mode": "whole", "ok": False, "why": f"bucket {key}: forward {why}"})
                    order = ["speculative", "regions"]
                    break
    ptrs = weight_pointers(model)
    chosen, impl = "eager", model
    for m in order:
        # a fresh memory pool per attempt: a capture that failed part-way can leave its pool marked as
        # recording, and every later capture into it then fails ("already recording to mempool_id")
        pool = new_pool() if cuda else None
        cand = _candidate(model, m, pool, ptrs)
        try:
            ok, why = _golden_check(cand, model, per_bucket, deterministic)
        except Exception as e:  # noqa: BLE001 - a candidate that raises is refused, never shipped
            ok, why = False, f"{type(e).__name__}: {e}"
        entry = {"mode": m, "ok": ok, "why": why}
        if hasattr(cand, "report"):
            entry["capture"] = cand.report()
        if ok and cuda and _graphs(entry.get("capture")) == 0:
            ok, entry["ok"] = False, False  # exact only because it ran eagerly (plus overhead): try the next way
            entry["why"] = "nothing was captured: " + "; ".join(_refusals(entry.get("capture")))[:400]
        info["tried"].append(entry)
        if ok:
            chosen, impl = m, cand
            break
    if chosen == "eager" and mode != "eager":
        warnings.warn(f"tkcc.science.compile_exact: no exact captured forward for this model; running eager. "
                      f"Attempts: {info['tried']}", stacklevel=2)
    info["compile_s"] = round(time.perf_counter() - t0, 3)
    return ExactForward(model, impl, chosen, deterministic, info)
