"""Start-up determinism probe: does the reference forward reproduce its own bits?

Exact-mode validation compares a candidate with the reference bit for bit, so
it is only meaningful when the reference agrees with itself. On a GPU it may
not: cuBLAS and sdpa pick kernels by pointer alignment and memory-pool state
(on an H200 the captured olmoe-16l bf16 decode step differed from its own
eager rerun by 0.035 in logits, and two CUDA-graph captures of the same
forward replayed 0.4-0.7 apart). The engine therefore runs, per tier, before
any candidate code: the reference several times on the same inputs with
poisoned, freshly allocated memory, and on CUDA at least two *separate*
graph captures of it, replayed, and compares everything bitwise.

A tier whose reference reproduces itself stays in exact mode. One that does
not switches to tolerance mode (``--validation auto``, the default) with a
*scale-aware* tolerance: the error of an output is normalised by the
reference output's scale (its largest finite magnitude), and the bound is the
measured self-disagreement (normalised the same way) times ``SAFETY``, never
below the dtype's floor, the ``rtol`` of ``tkcc.passes.lint.TOLERANCES`` (the
one table for passes, golden checks and the engine). Beside the bound, a
candidate's greedy tokens must equal the reference's wherever the reference
agrees with itself (``tkcc.runtime.golden.reference_greedy``).

A search that admits inexact passes (``tkcc.compile(mode="tolerance")``, ``tkcc campaign --tolerance``, a
server's watcher over a tolerance artifact) starts its engine with ``--validation tolerance``: under ``auto`` a
reference that reproduces its own bits keeps its tier exact, and every inexact pass is then refused as "not
bit-exact in exact mode" (a tolerance-mode ``tkcc compile`` of olmoe-16l on an H200 shipped an elementwise
fusion at +33% that way, never its lowered step).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from tkcc.errors import EngineError
from tkcc.kernels.graph_replay import CapturedCall, GraphCaptureError
from tkcc.runtime.timing import bucket_inputs
from tkcc.runtime.validation import (
    TOLERANCES,
    StateGuard,
    run_candidate,
    scaled_error,
    tensors_of,
)

MODES = ("auto", "exact", "tolerance")
SAFETY = 4.0  # bound = SAFETY x the measured self-disagreement: a handful of probes under-samples the worst case
EAGER_RUNS = 3
CAPTURES = 2


def check_mode(mode) -> str:
    """The user's ``--validation`` choice, or a clear error naming the allowed values."""
    m = "auto" if mode is None else str(mode)
    if m not in MODES:
        raise EngineError(f"--validation {mode!r}: must be one of {list(MODES)}")
    return m


def dtype_floor(dtype: torch.dtype) -> float:
    """The dtype's relative tolerance from TOLERANCES: the tightest bound tolerance mode ever uses."""
    return float(TOLERANCES.get(dtype, (1e-4, 1e-4))[0])


@dataclass
class ScaledTolerance:
    """max |out - ref| / scale(ref) must stay <= ``bound`` (scale: the reference's largest finite magnitude)."""

    bound: float
    measured: float       # the reference's self-disagreement, normalised by its scale
    measured_abs: float   # the same, in absolute units
    safety: float
    floor: float
    dtype: str

    def describe(self) -> str:
        return (f"max({self.safety:g} x the reference's measured self-disagreement {self.measured:.3g}, the "
                f"{self.dtype} floor {self.floor:g})")

    def allowed_abs(self, scale: float) -> float:
        return self.bound * scale

    def to_json(self) -> dict:
        return asdict(self)


def tolerance_from(probe: dict, dtype: torch.dtype, safety: float = SAFETY) -> ScaledTolerance:
    floor = dtype_floor(dtype)
    measured = max(float(probe.get("max_norm_diff", 0.0)), float(probe.get("eager_vs_graph_norm", 0.0)))
    measured_abs = max(float(probe.get("max_abs_diff", 0.0)), float(probe.get("eager_vs_graph_abs", 0.0)))
    return ScaledTolerance(bound=max(safety * measured, floor), measured=measured,
                           measured_abs=measured_abs, safety=float(safety), floor=floor,
                           dtype=str(dtype).replace("torch.", ""))


@dataclass
class TierPolicy:
    """How one tier validates candidates: the mode, why, and (tolerance) the bound and greedy reference."""

    mode: str                       # exact | tolerance
    source: str                     # auto | forced
    probe: dict
    tolerance: ScaledTolerance | None = None
    greedy: object | None = None    # golden.GreedyReference (causal LMs in tolerance mode)

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    def why(self) -> str:
        p = self.probe
        if self.mode == "exact":
            cross = p.get("eager_vs_graph_abs") or 0.0
            return (f"exact: the reference reproduced itself bit for bit ({p.get('eager_runs')} eager runs"
                    + (f", {p.get('captures')} CUDA-graph captures" if p.get("captures") else "") + ")"
                    + (f"; its eager run and graph replay differ by {cross:.3g}, so replays are compared with the "
                       "reference's own replay" if cross else ""))
        if self.source == "forced":
            return f"tolerance (forced by --validation tolerance): bound {self.tolerance.bound:.3g} of output scale"
        return (f"tolerance (auto): the reference is not bitwise reproducible on {p.get('device')} (self-disagreement "
                f"{p.get('max_abs_diff', 0):.3g} abs, {p.get('max_norm_diff', 0):.3g} of the output's scale); bound "
                f"{self.tolerance.bound:.3g} = {self.tolerance.describe()}, plus identical greedy tokens")

    def summary(self) -> dict:
        """What goes into status, every validation record and every measurement."""
        out = {"mode": self.mode, "source": self.source, "deterministic": bool(self.probe.get("deterministic")),
               "self_disagreement_abs": self.probe.get("max_abs_diff", 0.0),
               "self_disagreement_norm": self.probe.get("max_norm_diff", 0.0), "why": self.why()}
        if self.tolerance is not None:
            out["tolerance"] = self.tolerance.to_json()
        if self.greedy is not None:
            out["greedy_reference"] = self.greedy.summary()
        return out


def decide(probe: dict, requested: str, dtype: torch.dtype, tier: str, safety: float = SAFETY) -> TierPolicy:
    """The tier's policy from the probe and the user's choice; forced exact on a non-reproducible model raises."""
    requested = check_mode(requested)
    det = bool(probe["deterministic"])
    if requested == "exact":
        if not det:
            raise EngineError(
                f"--validation exact: the reference forward of the {tier} tier is not bitwise reproducible on "
                f"{probe.get('device')} ({probe.get('worst')}: runs differ by up to {probe['max_abs_diff']:.3g} "
                f"absolute, {probe['max_norm_diff']:.3g} of the output's scale), so exact validation would reject "
                f"the baseline against itself; use --validation auto or tolerance")
        return TierPolicy("exact", "forced", probe)
    if requested == "tolerance":
        return TierPolicy("tolerance", "forced", probe, tolerance_from(probe, dtype, safety))
    if det:
        return TierPolicy("exact", "auto", probe)
    return TierPolicy("tolerance", "auto", probe, tolerance_from(probe, dtype, safety))


def probe_buckets(workload, program) -> list:
    """The default workload's shapes plus, for a causal LM, decode at half and at the full cache length
    (non-reproducibility on a GPU shows at some contexts only)."""
    from tkcc.runtime.validation import pick_buckets
    from tkcc.traffic.workload import Bucket

    out = list(pick_buckets(workload, 3))
    cap = int(program.meta.get("max_cache_len") or 0)
    if "decode" in program.graphs and cap >= 4:
        batch = int(program.meta.get("batch") or 1)
        have = {(b.phase, b.context) for b in out}
        for ctx in (cap // 2, cap - 1):
            if ("decode", ctx) not in have:
                out.append(Bucket("decode", batch, ctx, 1, 1.0))
                have.add(("decode", ctx))
    return out


def compare_runs(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[bool, float, float]:
    """(bitwise equal, max abs diff, max diff normalised by a's scale) over paired tensors."""
    equal, worst_abs, worst_norm = True, 0.0, 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, float("inf"), float("inf")
        if torch.equal(x, y) or (x.is_floating_point() and bool(torch.isclose(x, y, 0, 0, equal_nan=True).all())):
            continue
        equal = False
        if x.is_floating_point():
            ab, _, nm = scaled_error(x, y)
        else:
            ab = float((x.long() - y.long()).abs().max())
            nm = float("inf")
        worst_abs, worst_norm = max(worst_abs, ab), max(worst_norm, nm)
    return equal, worst_abs, worst_norm


def probe(program, reference: dict, buckets: list, device: torch.device, *, eager_runs: int = EAGER_RUNS,
          captures: int = CAPTURES, seed: int = 1234) -> dict:
    """Run the reference repeatedly on the same inputs per bucket and compare bitwise; see the module docstring.

    ``deterministic`` is True only if every eager rerun equals the first and every graph capture's replay
    equals the first capture's (validation compares like with like: eager with eager, replay with replay).
    Eager vs replay is reported apart (``eager_vs_graph_*``); a tolerance bound covers it too, so it allows
    every way the same math was seen to differ.
    """
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    det, worst_abs, worst_norm, worst = True, 0.0, 0.0, None
    cross_abs, cross_norm = 0.0, 0.0  # eager run vs graph replay: not self-disagreement, but the bound covers it
    rows, notes = [], []
    cuda = device.type == "cuda"
    for b in buckets:
        key = b.key()
        inputs = bucket_inputs(program, b, gen, 1)[0]
        guard = StateGuard(program.state)
        eager, prev, poison_bytes = [], [], 0
        for k in range(eager_runs):
            outs = run_candidate(reference[b.phase], inputs, guard, prev, device, poison_bytes,
                                 f"probe {key} eager run {k + 1}")
            eager.append([o.clone() for o in outs] + guard.current())
            poison_bytes = poison_bytes or sum(o.numel() * o.element_size() for o in outs)
            prev = outs
        graphs = []
        if cuda:
            for c in range(captures):
                guard.restore()
                try:
                    g = CapturedCall(reference[b.phase], inputs, warmup=3, device=device)
                except GraphCaptureError as e:
                    notes.append(f"{key}: the reference cannot be captured ({e}); eager runs only")
                    break
                guard.restore()
                outs = g.run(*inputs)
                torch.cuda.synchronize(device)
                graphs.append([t.clone() for t in tensors_of(outs)] + guard.current())
                del g, outs
            torch.cuda.empty_cache()
        guard.restore()
        row = {"bucket": key, "eager_equal": True, "graphs_equal": True, "eager_max_abs": 0.0,
               "graph_max_abs": 0.0, "eager_vs_graph_max_abs": 0.0}
        for label, runs, field_eq, field_abs in (("eager", eager, "eager_equal", "eager_max_abs"),
                                                 ("graph", graphs, "graphs_equal", "graph_max_abs")):
            for i, r in enumerate(runs[1:], start=2):
                eq, ab, nm = compare_runs(runs[0], r)
                if not eq:
                    det = False
                    row[field_eq] = False
                    row[field_abs] = max(row[field_abs], ab)
                    if nm >= worst_norm:
                        worst = f"bucket {key}, {label} run {i} vs run 1"
                    worst_abs, worst_norm = max(worst_abs, ab), max(worst_norm, nm)
        if graphs:
            _, ab, nm = compare_runs(eager[0], graphs[0])
            row["eager_vs_graph_max_abs"] = ab
            cross_abs, cross_norm = max(cross_abs, ab), max(cross_norm, nm)
        rows.append(row)
    if program.state is not None and hasattr(program.state, "reset"):
        program.state.reset()
    return {"deterministic": det, "max_abs_diff": worst_abs, "max_norm_diff": worst_norm, "worst": worst,
            "eager_vs_graph_abs": cross_abs, "eager_vs_graph_norm": cross_norm,
            "eager_runs": eager_runs, "captures": captures if cuda else 0, "device": str(device),
            "buckets": rows, "notes": notes, "seconds": time.perf_counter() - t0}
