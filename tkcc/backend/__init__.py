"""``torch.compile(model, backend="tkcc")``: tkcc as a dynamo backend that builds on Inductor.

    compiled = torch.compile(model, backend="tkcc")                               # Inductor, or faster where measured
    compiled = torch.compile(model, backend="tkcc", options={"search_s": 10})     # per-graph search, 10 s
    compiled = torch.compile(model, backend="tkcc", options={"inductor": False})  # bit-exact everywhere
    tkcc.backend.decisions()                                                      # what each graph runs as, and why

Each graph dynamo captures (graph breaks give several) is compiled by Inductor; tkcc's own forwards
take a graph only where they measure faster on its first call (``tkcc.backend.graph``). Without a search
budget the challengers, on CUDA only, are Inductor's forward replayed from CUDA graphs and the eager
graph (on CPU, Inductor's code runs unmeasured). With a budget (``options={"search_s": S}`` or
``$TKCC_BACKEND_SEARCH_S``) a graph also tries tkcc's pass plan and its generated kernels (with and
without CUDA-graph replay), the eager graph on CPU, and tuned Inductor configurations.
Options: ``tkcc.backend.options``.

Numerics, by what a graph ends up running:
- Inductor (with or without CUDA-graph replay, which keeps Inductor's bits): not bit-exact vs eager.
  Checked on the first call against the eager graph within a tolerance relative to the output's scale
  (fp32 1e-4, fp16 1e-2, bf16 5e-2, or ``options["tolerance"]``); a graph that fails runs eagerly.
- tkcc's plan in ``mode="exact"`` (the default), and the eager graph: bit-exact, checked with
  ``torch.equal`` on the first call. ``mode="tolerance"`` lets tkcc's plan use inexact passes, checked
  like Inductor.
- ``options={"inductor": False}``: only bit-exact forwards, every graph as exact as eager.
- A graph that writes to its inputs or draws random numbers is not re-run for checks or timings (that
  would repeat the effect): it runs the baseline unchecked, and its decision says so.
The checks run on the first call's inputs only; they are a guard, not a proof for every input.

Training graphs (inputs that require grad, grad enabled) go to Inductor as they are.
"""
from __future__ import annotations

import collections
import threading

import torch

from tkcc.backend.graph import BackendGraph, GraphDecision
from tkcc.backend.options import SEARCH_ENV, BackendOptions

__all__ = ["BackendOptions", "GraphDecision", "SEARCH_ENV", "TkccBackend", "decisions", "make_backend", "register",
           "tkcc_backend"]


class TkccBackend:
    """A dynamo backend with fixed options; ``decisions`` holds one GraphDecision per graph, in call order.

    ``timer(fn, args, device) -> [seconds]`` and ``clock() -> seconds`` replace the real timing loop and
    wall clock (tests drive the choice with fake timings; default: ``tkcc.runtime.timing.time_eager``).
    """

    def __init__(self, options: dict | None = None, *, timer=None, clock=None, keep: int = 1024):
        self.raw = dict(options or {})
        self.options = BackendOptions.parse(self.raw)  # bad options fail here, before any compile
        self.timer, self.clock = timer, clock
        self.decisions: collections.deque = collections.deque(maxlen=keep)
        self.graphs = 0
        self._lock = threading.Lock()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None,
                 options: dict | None = None):
        # parsed per graph: torch.compile's own options and mode, and $TKCC_BACKEND_SEARCH_S as it is now
        opts = BackendOptions.parse({**self.raw, **(options or {})}, mode=mode)
        with self._lock:
            index = self.graphs
            self.graphs += 1
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
            return self._training(index, gm, example_inputs, opts)
        kw = {"clock": self.clock} if self.clock is not None else {}
        return BackendGraph(index, gm, example_inputs, opts, self.decisions.append, timer=self.timer, **kw)

    def _training(self, index, gm, example_inputs, opts):
        from tkcc.backend import candidates

        if opts.inductor:
            winner, fn = "inductor", candidates.inductor(gm, example_inputs, opts.inductor_options)
        else:
            from tkcc.passes.default_plan import default_plan

            plan = opts.plan if opts.plan is not None else default_plan(opts.mode)
            winner, fn = "tkcc", candidates.plan_forward(gm, example_inputs, plan, opts.mode, opts.codegen)
        first = next((x for x in example_inputs if isinstance(x, torch.Tensor)), None)
        nodes = sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
        self.decisions.append(GraphDecision(
            graph=index, nodes=nodes, device=str(first.device) if first is not None else "cpu",
            dtype=str(first.dtype).replace("torch.", "") if first is not None else None, winner=winner,
            kind=winner, exact=winner == "tkcc",
            numerics="unchecked (training graph)", why="needs autograd: compiled as is, not searched (tkcc "
            "searches inference forwards; call under torch.no_grad() for that)", searched=False,
            search_s=opts.search_s, decide_s=0.0))
        return fn


def make_backend(plan=None, mode: str = "exact", codegen: bool = True, *, timer=None, clock=None,
                 **options) -> TkccBackend:
    """A backend with these options (``tkcc.backend.options``); pass it as ``torch.compile(m, backend=...)``."""
    opts = dict(options, mode=mode, codegen=codegen)
    if plan is not None:
        opts["plan"] = plan
    return TkccBackend(opts, timer=timer, clock=clock)


_DEFAULT: TkccBackend | None = None


def _default() -> TkccBackend:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = TkccBackend()
    return _DEFAULT


def tkcc_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None, options: dict | None = None):
    """The ``"tkcc"`` backend (the entry point ``torch.compile(..., backend="tkcc")`` finds)."""
    return _default()(gm, example_inputs, mode=mode, options=options)


def decisions() -> list[GraphDecision]:
    """The decisions of the ``"tkcc"`` backend in this process, oldest first (the last 1024)."""
    return list(_default().decisions)


def register() -> None:
    """Register ``"tkcc"`` with dynamo (idempotent; installed packages find it through the entry point)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "tkcc" not in _BACKENDS:
        register_backend(name="tkcc")(tkcc_backend)
