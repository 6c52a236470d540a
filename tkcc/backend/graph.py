"""One captured graph as the backend runs it: the baseline built at compile time, the choice made on the first call.

At compile time (dynamo's fake or example inputs, its shape environment and guards) only the baseline
is built: Inductor's compile, or tkcc's exact plan when Inductor is switched off or fails.

On the first real call:

1. the graph dynamo captured runs eagerly on the call's inputs: that is the call's result and the
   reference every candidate is checked against;
2. if that run wrote to an input or drew random numbers, nothing is re-run (re-running would repeat the
   effect): the baseline is kept unchecked, and the decision says why;
3. otherwise the candidates are tried (``tkcc.backend.choose``): built, run once on the same inputs,
   checked (``torch.equal`` for tkcc's exact forwards and the eager graph; Inductor's within a tolerance
   relative to the output's scale), timed with ``tkcc.runtime.timing.time_eager``, and the winner kept.

Later calls run the winner directly: nothing is recompiled or re-measured per call. A graph with
symbolic shapes is decided on its first call's shapes and tries only the default tier (the baseline,
built at compile time, its CUDA-graph replay and the eager graph): anything else would be compiled at
call time, without dynamo's shape guards.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch

from tkcc.backend import candidates as cands
from tkcc.backend.choose import Candidate, Trial, pick, run

log = logging.getLogger("tkcc.backend")


@dataclass
class GraphDecision:
    """What the backend chose for one graph, and why (``tkcc.backend.decisions()`` lists them)."""

    graph: int
    nodes: int
    device: str
    dtype: str | None
    winner: str
    kind: str               # inductor | tkcc | eager
    exact: bool             # the winner promises eager's bits (and was checked with torch.equal)
    numerics: str
    why: str
    searched: bool          # search-tier candidates were tried
    search_s: float
    decide_s: float
    trials: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"graph {self.graph} ({self.nodes} nodes, {self.device} {self.dtype}): {self.winner} [{self.numerics}] "
                f"- {self.why}")


class _Bound:
    """A scale-aware bound for ``tkcc.runtime.validation.compare``: max |out - ref| / max |ref|."""

    def __init__(self, bound: float, source: str):
        self.bound, self.source = bound, source

    def describe(self) -> str:
        return self.source


# fp32 matmuls/convolutions that torch runs in TF32 (10-bit mantissa, unit roundoff 2^-11 = 4.9e-4): two valid
# algorithms differ by a few of those relative to the output's scale, so fp32's 1e-4 would reject Inductor's
TF32_FLOOR = 5e-3
_MATMUL = ("matmul", "linear", "mm", "bmm", "addmm", "baddbmm", "einsum", "bilinear", "attention", "lstm", "gru",
           "rnn", "multi_head")


def tf32_ops(gm: torch.fx.GraphModule) -> float | None:
    """The fp32 floor when torch's current flags let an op of this graph run reduced on CUDA, else None.

    TF32 (``torch.backends.cudnn.allow_tf32``, on by default for convolutions;
    ``torch.backends.cuda.matmul.allow_tf32`` or ``set_float32_matmul_precision("high")``): TF32_FLOOR;
    ``set_float32_matmul_precision("medium")`` (bf16 internally): bf16's row of TOLERANCES.
    """
    from tkcc.runtime.determinism import dtype_floor

    names = " ".join(str(getattr(n.target, "__name__", n.target)).lower() for n in gm.graph.nodes
                     if n.op in ("call_function", "call_method", "call_module"))
    has_mm = any(k in names for k in _MATMUL)
    if has_mm and torch.get_float32_matmul_precision() == "medium":
        return dtype_floor(torch.bfloat16)
    conv = torch.backends.cudnn.allow_tf32 and "conv" in names
    mm = has_mm and (torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() == "high")
    return TF32_FLOOR if conv or mm else None


def _tolerance(ref: list, user: float | None, tf32: float | None = None) -> _Bound:
    from tkcc.runtime.determinism import dtype_floor

    if user is not None:
        return _Bound(user, "options['tolerance']")
    floats = [t.dtype for t in ref if t.is_floating_point()]
    if not floats:
        return _Bound(0.0, "no float outputs")
    worst = max(floats, key=dtype_floor)
    if tf32 and worst == torch.float32 and any(t.is_cuda for t in ref):
        return _Bound(tf32, "fp32 whose matmuls/convolutions torch.backends lets run in TF32 (or bf16)")
    return _Bound(dtype_floor(worst), f"the {str(worst).replace('torch.', '')} row of TOLERANCES")


def _abs_close(ref: list, out: list, rtol: float) -> bool:
    from tkcc.passes.lint import TOLERANCES

    for r, o in zip(ref, out):
        if r.shape != o.shape or r.dtype != o.dtype:
            return False
        if r.is_floating_point():
            atol = TOLERANCES.get(r.dtype, (1e-4, 1e-4))[1]
            if not torch.allclose(o.double(), r.double(), rtol=rtol, atol=atol, equal_nan=True):
                return False
        elif not torch.equal(r, o):
            return False
    return len(ref) == len(out)


def check_close(ref: list, out: list, bound: _Bound, what: str) -> None:
    """ValidationFailure unless each output is within ``bound`` of its scale, or elementwise close.

    The scale-aware bound (max |out - ref| / max |ref|) judges most outputs; an output that is itself
    the result of cancellation (a sum of a normalised row: its largest value ~1e-6) has no useful scale,
    so it also passes when elementwise close: |out - ref| <= atol + bound * |ref|, with the dtype's
    absolute tolerance from TOLERANCES (fp32: 1e-4).
    """
    from tkcc.runtime.validation import ValidationFailure, compare

    try:
        compare(ref, out, False, 0.0, 0.0, what, scaled=bound)
    except ValidationFailure:
        if not _abs_close(ref, out, bound.bound):
            raise


def _rng_state(device: torch.device):
    cpu = torch.random.get_rng_state()
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, gpu


def _same_rng(a, b) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


def _versions(args) -> list | None:
    try:
        return [a._version if isinstance(a, torch.Tensor) else None for a in args]
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _may_mutate(gm: torch.fx.GraphModule) -> bool:
    from tkcc.passes.general import is_pure

    return any(not is_pure(n, gm) for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr"))


def is_dynamic(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """Symbolic sizes among the graph's inputs (dynamo's ``dynamic`` compile, or after a shape recompile)."""
    if any(isinstance(x, (torch.SymInt, torch.SymFloat, int)) and not isinstance(x, bool) for x in example_inputs):
        return True
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("example_value", n.meta.get("val"))
            if isinstance(v, (torch.SymInt, torch.SymFloat)):
                return True
            if isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape):
                return True
    return False


TIMED_S = 0.2  # about this long per candidate: a slow graph gets fewer calls (at least MIN_REPS), never more


MIN_REPS = 6   # the fewest samples whose median has a 95 % interval (order statistics: [min, max] at n = 6)


def default_timer(reps: int | None):
    """Seconds per call of ``fn(*args)``: tkcc's one timing loop (CUDA events on a GPU, perf_counter on CPU).

    ``reps`` calls (default 30 on CUDA, 10 on CPU), fewer for a graph slower than TIMED_S / reps.
    """
    import statistics

    from tkcc.runtime.timing import time_eager

    def timer(fn, args, device: torch.device) -> list[float]:
        cuda = device.type == "cuda"
        n = reps or (30 if cuda else 10)
        sets = [tuple(args)]
        first = time_eager(fn, sets, 3, 3 if cuda else 1, device)  # warm-up, and how long one call takes
        n = max(MIN_REPS, min(n, int(TIMED_S / max(statistics.median(first), 1e-9))))
        return time_eager(fn, sets, n, 0, device)

    return timer


class BackendGraph:
    """The callable dynamo runs for one graph (module docstring)."""

    def __init__(self, index: int, gm: torch.fx.GraphModule, example_inputs, opts, record, timer=None,
                 clock=time.monotonic):
        self.index, self.opts, self.record = index, opts, record
        self.timer = timer or default_timer(opts.reps)
        self.clock = clock
        self.reference = cands.copy_graph(gm)  # the graph dynamo captured, run as is
        self.nodes = sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
        self.dynamic = is_dynamic(gm, example_inputs)
        self.tf32 = tf32_ops(gm)
        self.plan = opts.plan
        self.fn = None
        self.decision: GraphDecision | None = None
        self.plan_forwards: list = []  # tkcc's PlanForward objects (pass logs, artifact)
        self._built: dict = {}
        self._tried: list = []
        self.base, self.base_note = self._build_baseline(gm, example_inputs)

    # ---- compile time ----------------------------------------------------------------------------
    def _tkcc_plan(self):
        if self.plan is None:
            from tkcc.passes.default_plan import default_plan

            self.plan = default_plan(self.opts.mode)
        return self.plan

    def _build_baseline(self, gm, example_inputs) -> tuple[Candidate, str]:
        note = ""
        if self.opts.inductor:
            t0 = time.perf_counter()
            try:
                fn = cands.inductor(gm, example_inputs, self.opts.inductor_options)
                self._built["inductor"] = fn
                took = f"compiled in {time.perf_counter() - t0:.2f} s"
                return Candidate("inductor", "inductor", False, lambda: fn), took
            except Exception as e:  # noqa: BLE001 - a graph Inductor cannot compile runs tkcc's plan instead
                note = f"Inductor could not compile this graph ({type(e).__name__}: {str(e)[:300]})"
                log.warning("tkcc backend: graph %d: %s; using tkcc's plan", self.index, note)
        try:
            fn = cands.plan_forward(cands.copy_graph(self.reference), example_inputs, self._tkcc_plan(),
                                    self.opts.mode, self.opts.codegen, self.plan_forwards)
            self._built["tkcc"] = fn
            return Candidate("tkcc", "tkcc", self.opts.mode == "exact", lambda: fn), note
        except Exception as e:  # noqa: BLE001 - last resort: the graph dynamo captured, eagerly
            why = f"tkcc's plan could not trace it ({type(e).__name__}: {str(e)[:200]})"
            note = f"{note}; {why}" if note else why
            log.warning("tkcc backend: graph %d: %s; running it eagerly", self.index, note)
            return Candidate("eager", "eager", True, lambda: self.reference.forward), note

    # ---- the candidates of the first call ----------------------------------------------------------
    def _candidates(self, args, device: torch.device) -> list[Candidate]:
        cuda = device.type == "cuda"
        opts, base = self.opts, self.base
        out = [base]

        def cg(name):
            def build():
                if name not in self._built:
                    raise RuntimeError(f"{name} is not available to replay")
                r = cands.replayed(self._built[name], args, f"graph{self.index}:{name}", self.dynamic)
                self._built[f"{name}+cudagraph"] = r
                return r
            return build

        def remember(name, build):
            def b():
                fn = build()
                self._built[name] = fn
                return fn
            return b

        if cuda and opts.cudagraphs:
            out.append(Candidate(f"{base.name}+cudagraph", base.kind, base.exact, cg(base.name)))
        # .forward: the generated code itself, without nn.Module.__call__'s hook checks (a microsecond a call)
        eager = Candidate("eager", "eager", True, remember("eager", lambda: self.reference.forward),
                          tier="default" if cuda else "search")
        if cuda and base.name != "eager":
            # a graph of one or two library calls (a matmul, a convolution) can run faster as the eager graph
            # than through Inductor's wrapper; on CUDA that is measured by default
            out.append(eager)
        if self.dynamic:
            # search-tier builds happen at call time, where dynamo's symbolic shapes (and guards) are gone
            self.base_note = "; ".join(x for x in (self.base_note, "symbolic shapes: only the default tier "
                                                   "(baseline, its CUDA-graph replay, eager) is tried") if x)
            return out
        if not cuda and base.name != "eager":
            out.append(eager)
        if base.name != "tkcc":
            build = remember("tkcc", lambda: cands.plan_forward(cands.copy_graph(self.reference), args,
                                                                self._tkcc_plan(), opts.mode, opts.codegen,
                                                                self.plan_forwards))
            out.append(Candidate("tkcc", "tkcc", opts.mode == "exact", build, tier="search"))
            if cuda and opts.cudagraphs:
                out.append(Candidate("tkcc+cudagraph", "tkcc", opts.mode == "exact", cg("tkcc"), tier="search"))
        if cuda and opts.inductor:
            # Inductor's own tuning benchmarks every kernel (coordinate descent: ~1-2 s per kernel on an H200;
            # max-autotune: each matmul/conv against templates): tried only with a budget that can pay for it
            for name, patches, need in (("inductor-coordinate-descent", {"coordinate_descent_tuning": True}, 10.0),
                                        ("inductor-max-autotune", {"max_autotune": True}, 30.0)):
                p = {**opts.inductor_options, **patches, "triton.cudagraphs": False}
                build = remember(name, lambda p=p: cands.inductor(cands.copy_graph(self.reference), args, p))
                out.append(Candidate(name, "inductor", False, build, tier="search", min_budget_s=need))
                if opts.cudagraphs:
                    out.append(Candidate(f"{name}+cudagraph", "inductor", False, cg(name), tier="search"))
        return out

    def _trial(self, c: Candidate, args, ref: list, device: torch.device, timed: bool) -> Trial:
        from tkcc.runtime.validation import ValidationFailure, compare, scaled_error, tensors_of

        t0 = self.clock()
        try:
            fn = c.build()
            out = tensors_of(fn(*args))
        except Exception as e:  # noqa: BLE001 - a candidate that cannot build or run is recorded and dropped
            return Trial(c.name, c.kind, c.exact, "failed", f"{type(e).__name__}: {str(e)[:300]}",
                         build_s=self.clock() - t0)
        build_s = self.clock() - t0
        refused = fn.refused() if isinstance(fn, cands.Replayed) else None
        if refused:
            return Trial(c.name, c.kind, c.exact, "failed", f"no CUDA graph: {refused}", build_s=build_s)
        try:
            if c.exact:
                compare(ref, out, True, 0.0, 0.0, c.name)
                err = 0.0
            else:
                check_close(ref, out, _tolerance(ref, self.opts.tolerance, self.tf32), c.name)
                err = max((scaled_error(r, o)[2] for r, o in zip(ref, out) if r.is_floating_point()), default=0.0)
        except ValidationFailure as e:
            return Trial(c.name, c.kind, c.exact, "rejected", str(e), build_s=build_s)
        note = ""
        if c.kind == "tkcc" and self.plan_forwards:
            note = self.plan_forwards[-1].note
        trial = Trial(c.name, c.kind, c.exact, "ok", note, error=err, build_s=build_s, fn=fn)
        if timed:
            try:
                trial.samples_s = list(self.timer(fn, args, device))
            except Exception as e:  # noqa: BLE001 - a forward that fails when timed is dropped
                trial.status, trial.why = "failed", f"timing: {type(e).__name__}: {str(e)[:200]}"
        return trial

    # ---- the first call ----------------------------------------------------------------------------
    def __call__(self, *args):
        fn = self.fn
        if fn is not None:
            return fn(*args)
        return self._decide(args)

    def _decide(self, args):
        from tkcc.runtime.validation import tensors_of

        t0 = self.clock()
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        first = next((a for a in tensors if a.is_cuda), tensors[0] if tensors else None)
        device = first.device if first is not None else torch.device("cpu")
        with torch.no_grad():
            versions, rng = _versions(args), _rng_state(device)
            ref_out = self.reference(*args)
            ref = tensors_of(ref_out)
            after = _versions(args)
            if versions is None or after is None:
                wrote = "it may write to its inputs (inference tensors keep no version counter)" \
                    if _may_mutate(self.reference) else None
            else:
                hit = [i for i, (a, b) in enumerate(zip(versions, after)) if a != b]
                wrote = f"it wrote to input(s) {hit}" if hit else None
            drew = None if _same_rng(rng, _rng_state(device)) else "it drew random numbers"
            effect = wrote or drew
            if effect or not ref:
                why = f"{effect}: not re-run for checks or timing" if effect else "no tensor outputs"
                trials = [Trial(self.base.name, self.base.kind, self.base.exact, "ok", "unchecked: " + why,
                                fn=self.base.build())]
                winner, pick_why = trials[0], f"{self.base.name} kept unchecked ({why})"
            else:
                todo = self._tried = self._candidates(args, device)
                timed = len(todo) > 1  # timed only where there is a choice to make
                trials = run(todo, lambda c: self._trial(c, args, ref, device, timed), self.opts.search_s,
                             self.clock)
                winner, pick_why = pick(trials, self.opts.min_gain)
        if winner is None:
            fn, name, kind, exact = self.reference.forward, "eager", "eager", True
            pick_why = "eager (fallback): " + pick_why
        else:
            fn, name, kind, exact = winner.fn, winner.name, winner.kind, winner.exact
        numerics = self._numerics(winner, exact, ref)
        self.decision = GraphDecision(
            graph=self.index, nodes=self.nodes, device=str(device),
            dtype=str(ref[0].dtype).replace("torch.", "") if ref else None, winner=name, kind=kind, exact=exact,
            numerics=numerics, why=pick_why + (f"; baseline: {self.base_note}" if self.base_note else ""),
            searched=any(t.status != "skipped" for t, c in zip(trials, self._tried) if c.tier == "search"),
            search_s=self.opts.search_s, decide_s=self.clock() - t0, trials=[t.to_json() for t in trials])
        self.fn = fn
        self._built.clear()  # the losers (compiled variants, captured graphs and their memory pools) go
        self.record(self.decision)
        log.info("tkcc backend: %s", self.decision.summary())
        return ref_out

    def _numerics(self, winner: Trial | None, exact: bool, ref: list) -> str:
        if winner is None or winner.error is None:
            if winner is not None and winner.why.startswith("unchecked"):
                return "unchecked (" + ("exact passes only, each checked bitwise by the PassManager" if exact
                                        else "Inductor's numerics") + ")"
            return "bit-exact (the eager graph itself)"
        if exact:
            return "bit-exact vs eager (checked with torch.equal on the first call)"
        bound = _tolerance(ref, self.opts.tolerance, self.tf32)
        return (f"within tolerance of eager: error {winner.error:.2g} of the output's scale on the first call "
                f"(bound {bound.bound:g}, {bound.describe()})")
