"""CUDA-graph capture of a Python callable for fixed inputs, with static input and output buffers.

Why it keeps bits: a CUDA graph records the very kernels the callable launched
while it was captured (same kernels, same launch parameters, same argument
pointers) and replays them; nothing is recompiled, fused or reordered. So a
replay computes bit for bit what one eager call computes on the same input
values, as long as the eager call is itself deterministic and its kernel
choice depends only on what the capture key below fixes.

What the capture key fixes (``signature``):

- every device tensor's shape, stride, dtype, device and 16-byte alignment of
  its data pointer (cuBLAS/cuBLASLt pick algorithms by alignment), and
- the *values* of everything else: Python scalars, strings, and CPU tensors
  (a 0-dim CPU tensor is passed into CUDA kernels as an immediate argument,
  so it is baked into the graph; a different value needs a different graph).

At each call the inputs' values are copied into the static input buffers (a
bitwise copy), the graph is replayed on the current stream, and the outputs
are cloned out of the graph's private memory (a bitwise copy), so results
stay valid after the next replay.

``GraphCache`` holds one captured graph per signature with a policy for
signatures that come and go (a data-dependent size seen once is run eagerly;
seen twice, captured), and falls back to plain eager execution, with the
reason recorded, whenever a capture is impossible (the callable synchronises
with the host, or the device is not CUDA). Falling back never changes bits:
it is the reference itself.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_ALIGN = 16  # bytes; the largest alignment cuBLASLt's heuristics distinguish


def _leaf_key(x: Any, static_ptrs: frozenset = frozenset()):
    """Part of the capture key for one flattened input leaf (called per input per call: kept cheap)."""
    if isinstance(x, torch.Tensor):
        if x.is_cuda:
            p = x.data_ptr()
            if p in static_ptrs:  # a weight: read in place by the graph, keyed by address
                return (p, x.shape)
            return (x.shape, x.stride(), x.dtype, x.device.index, p % _ALIGN == 0)
    # host tensors reach kernels by value: the value is part of the key
        v = x.detach()
        v = v.float() if v.dtype == torch.bfloat16 else v
        return ("host", tuple(x.shape), x.dtype, v.contiguous().numpy().tobytes())
    if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return ("const", type(x).__name__, x)
    if isinstance(x, torch.SymInt):  # a concrete call never passes one; keep it hashable anyway
        return ("const", "int", int(x))
    raise TypeError(f"cannot use a {type(x).__name__} as a captured-graph input; "
                    "inputs must be tensors, Python scalars, strings or containers of them")


def signature(args: tuple, kwargs: dict | None = None, static_ptrs: frozenset = frozenset()):
    """Hashable capture key of a call (see the module docstring for what it fixes)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    return (str(spec), tuple(_leaf_key(x, static_ptrs) for x in leaves))


def _is_cuda_call(args, kwargs) -> bool:
    leaves = pytree.tree_leaves((args, kwargs))
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in leaves)


class SyncError(RuntimeError):
    """The callable synchronises with the host, so it cannot be captured as one graph."""


def probe_sync(fn: Callable, args: tuple, kwargs: dict | None = None) -> str | None:
    """Run ``fn`` once with CUDA sync debugging set to error; None if it never waits on the device.

    A host synchronisation (``.item()``, ``nonzero``, a blocking copy) inside a
    capture invalidates it; finding it with a plain eager run first avoids
    entering a capture that must fail.
    """
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(*args, **(kwargs or {}))
        return None
    except RuntimeError as e:
        if "synchroniz" not in str(e).lower():
            raise
        return f"synchronises with the host ({str(e).strip().splitlines()[0][:160]})"
    finally:
        torch.cuda.set_sync_debug_mode(prev)


class SpeculationError(SyncError):
    """A host read cannot be speculated (its value depends on the inputs, or the reads changed)."""


def _storage(x: torch.Tensor) -> int:
    try:
        return x.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensors without storage (fake, sparse) are never tainted
        return 0


class HostReads(TorchDispatchMode):
    """Record, then replay without syncing, the values a forward reads on the host (``.item()``, ``bool()``).

    Which reads may be speculated: only reads whose value does not depend on
    the call's inputs. Dependence is tracked by storage: the inputs' storages
    are tainted, every op with a tainted tensor argument taints its outputs and
    the arguments it writes. A read of a tainted tensor raises
    SpeculationError (that forward is split into regions instead). What stays
    is reads of weights, buffers and constants (torchdiffeq compares its own
    time grid every step): the same at every call, unless the model's state
    is changed in place, which the guards catch.

    ``record``: run eagerly, keep each value. ``replay`` (inside a capture):
    return the recorded values in order without synchronising, and keep a
    clone of each read tensor (a guard, computed by the graph at every replay).
    """

    def __init__(self, inputs, mode: str, recorded: list | None = None):
        super().__init__()
        self.mode = mode
        self.values: list = [] if mode == "record" else list(recorded or [])
        self.guards: list = []
        self.taint = {_storage(x) for x in inputs if isinstance(x, torch.Tensor)} - {0}
        self.i = 0

    def _tainted(self, x) -> bool:
        return isinstance(x, torch.Tensor) and _storage(x) in self.taint

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            x = args[0]
            if self._tainted(x):
                raise SpeculationError("a host read depends on the inputs (a data-dependent branch or size)")
            if self.mode == "record":
                v = func(*args, **kwargs)
                if not isinstance(v, (bool, int, float)) or (isinstance(v, int) and abs(v) > 2**53):
                    raise SpeculationError(f"host read of {type(v).__name__} {v!r} cannot be guarded exactly")
                self.values.append(v)
                return v
            if self.i >= len(self.values):
                raise SpeculationError("the forward read more values on the host than when it was recorded")
            v = self.values[self.i]
            self.i += 1
            self.guards.append(x.detach().reshape(()).clone())
            return v
        out = func(*args, **kwargs)
        flat = pytree.tree_leaves((args, kwargs))
        in_storages = {_storage(a) for a in flat if isinstance(a, torch.Tensor)}
        if not any(self._tainted(a) for a in flat):
            # a fresh output of untainted inputs may sit where a freed tainted tensor was: untaint its memory
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and _storage(o) not in in_storages:
                    self.taint.discard(_storage(o))
        else:
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    self.taint.add(_storage(o))
            for arg, a in zip(func._schema.arguments, args):
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, torch.Tensor):
                    self.taint.add(_storage(a))
            for name, a in kwargs.items():
                if isinstance(a, torch.Tensor) and name == "out":
                    self.taint.add(_storage(a))
        return out


class CapturedCall:
    """One CUDA graph of ``fn(*args, **kwargs)`` for one signature.

    Device tensors are copied into static buffers of the same shape, strides
    and dtype, except ``static_ptrs`` (weights): those the graph reads in
    place. Capture runs ``warmup`` eager calls on a side stream first (lazy
    library initialisation, cuBLAS workspaces and cuDNN handles happen there,
    not in the graph), then captures one call. Inputs the warm-up call wrote
    to (their version counter moved) are copied back to the caller's tensors
    after each replay, so in-place ops on inputs keep their meaning.
    ``pool`` lets several graphs share one memory pool (static allocation
    reuse across shapes; safe because outputs are cloned out right after each
    replay and graphs never run concurrently).
    """

    def __init__(self, fn: Callable, args: tuple, kwargs: dict | None = None, pool=None, warmup: int = 2,
                 static_ptrs: frozenset = frozenset(), speculate: bool = False):
        kwargs = dict(kwargs or {})
        self.fn = fn
        self.guard_vec, self.expected = None, None
        self.guard_failures = 0
        leaves, self.in_spec = pytree.tree_flatten((tuple(args), kwargs))
        self._dev_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)
                         and x.device.type == "cuda" and x.data_ptr() not in static_ptrs]
        storages = [leaves[i].untyped_storage().data_ptr() for i in self._dev_idx]
        self.static_leaves = list(leaves)
        for i in self._dev_idx:
            x = leaves[i]
            buf = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
            buf.copy_(x)
            self.static_leaves[i] = buf
        s_args, s_kwargs = pytree.tree_unflatten(self.static_leaves, self.in_spec)
        versions = [self.static_leaves[i]._version for i in self._dev_idx]
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        dev_inputs = [self.static_leaves[i] for i in self._dev_idx]
        recorded = None
        with torch.cuda.stream(stream):
            for w in range(max(1, warmup)):
                if speculate and w == 0:
                    with HostReads(dev_inputs, "record") as rec:
                        fn(*s_args, **s_kwargs)
                    recorded = rec.values
                else:
                    fn(*s_args, **s_kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self._written = [i for i, v in zip(self._dev_idx, versions) if self.static_leaves[i]._version != v]
        if self._written and len(set(storages)) != len(storages):
            raise SyncError("the callable writes to an input that shares memory with another input; "
                            "separate static buffers would break that aliasing")
        if self._written:  # warm-up changed the buffers: restore the caller's values before capturing
            for i in self._written:
                self.static_leaves[i].copy_(leaves[i])
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            if speculate:
                with HostReads(dev_inputs, "replay", recorded) as rep:
                    out = fn(*s_args, **s_kwargs)
                if rep.i != len(recorded):
                    raise SpeculationError("the forward read fewer values on the host than when it was recorded")
                if rep.guards:  # computed by the graph at every replay, checked after it
                    self.guard_vec = torch.stack([g.to(torch.float64) for g in rep.guards])
                    self.expected = [float(v) for v in recorded]
            else:
                out = fn(*s_args, **s_kwargs)
        torch.cuda.synchronize()
        self.host_reads = len(recorded or [])
        self.out_leaves, self.out_spec = pytree.tree_flatten(out)
        _check_output_aliasing(self.out_leaves, [x for x in self.static_leaves if isinstance(x, torch.Tensor)])
        self.nodes = _graph_nodes(self.graph)

    def __call__(self, *args, **kwargs):
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        for i in self._dev_idx:
            self.static_leaves[i].copy_(leaves[i])
        self.graph.replay()
        if self.guard_vec is not None and self.guard_vec.tolist() != self.expected:
            # a value the forward reads on the host changed (the model's state was edited in place):
            # this replay took another path than eager would; discard it and run eagerly
            self.guard_failures += 1
            return self.fn(*args, **kwargs)
        for i in self._written:
            leaves[i].copy_(self.static_leaves[i])
        outs = [x.clone(memory_format=torch.preserve_format) if isinstance(x, torch.Tensor) else x
                for x in self.out_leaves]
        return pytree.tree_unflatten(outs, self.out_spec)


def _check_output_aliasing(outs, ins) -> None:
    """Refuse graphs whose outputs share memory with each other or with an input.

    Outputs are cloned out of the graph's pool; a clone would silently cut the
    aliasing that later in-place writes in the caller's code may rely on.
    """
    seen = {}
    for x in ins:
        if x.is_cuda and x.untyped_storage().data_ptr():
            seen[x.untyped_storage().data_ptr()] = "an input"
    for i, x in enumerate(outs):
        if not isinstance(x, torch.Tensor) or not x.untyped_storage().data_ptr():
            continue  # empty tensors own no memory
        p = x.untyped_storage().data_ptr()
        if p in seen:
            raise SyncError(f"output {i} shares memory with {seen[p]}; cloning it out would break that aliasing")
        seen[p] = f"output {i}"


def _copies(args, kwargs, static_ptrs):
    """The call's inputs with every non-weight device tensor copied (same layout)."""
    def cp(x):
        if isinstance(x, torch.Tensor) and x.device.type == "cuda" and x.data_ptr() not in static_ptrs:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
        return x
    return pytree.tree_map(cp, (tuple(args), dict(kwargs or {})))


def _graph_nodes(graph) -> int | None:
    """Number of kernel/memcpy nodes in a captured graph, where the CUDA driver API is at hand."""
    try:
        raw = graph.raw_cuda_graph()
        from cuda.bindings import runtime as cudart  # cuda-bindings

        err, _, n = cudart.cudaGraphGetNodes(raw, 0)
        return int(n) if int(err) == 0 else None
    except Exception:  # noqa: BLE001 - a count for the report only
        return None


@dataclass
class CacheStats:
    replays: int = 0
    eager_calls: int = 0
    captures: int = 0
    failures: dict = field(default_factory=dict)  # reason -> count

    def to_dict(self) -> dict:
        return {"replays": self.replays, "eager_calls": self.eager_calls, "captures": self.captures,
                "failures": dict(self.failures)}


class GraphCache:
    """Captured graphs of one callable, one per input signature, with an eager fallback.

    capture_after: capture a signature the n-th time it is seen (1: at once;
                   2: sizes that occur only once, e.g. a one-off neighbour
                   count, stay eager and cost no capture).
    max_graphs:    at most this many graphs; later new signatures run eagerly.
    pool:          a ``torch.cuda.graph_pool_handle()`` shared by every graph,
                   or None for one pool per cache (made on first capture).
    static_ptrs:   data pointers of tensors the graph reads in place (weights).
    probe:         run one eager call with sync debugging before capturing a
                   signature, and refuse it if it synchronises.
    """

    def __init__(self, fn: Callable, name: str = "region", capture_after: int = 1, max_graphs: int = 64,
                 pool=None, warmup: int = 2, static_ptrs=frozenset(), probe: bool = True,
                 speculate: bool = False):
        self.fn, self.name = fn, name
        self.speculate = speculate
        self.capture_after, self.max_graphs, self.warmup = capture_after, max_graphs, warmup
        self.pool = pool
        self.static_ptrs = frozenset(static_ptrs)
        self.probe = probe
        self.graphs: dict = {}
        self.seen: dict = {}
        self.refused: dict = {}  # signature -> reason capture is impossible
        self.stats = CacheStats()
        self._lock = threading.Lock()

    def _fail(self, reason: str):
        self.stats.failures[reason] = self.stats.failures.get(reason, 0) + 1

    def _refuse(self, key, reason: str) -> None:
        self.refused[key] = reason
        self._fail(reason)

    def capture(self, *args, **kwargs) -> CapturedCall | None:
        """Capture now for this signature (used at compile time for known shapes); None if impossible."""
        key = signature(args, kwargs, self.static_ptrs)
        if key in self.graphs:
            return self.graphs[key]
        if key in self.refused:
            return None
        if not _is_cuda_call(args, kwargs):
            self._refuse(key, "no CUDA tensor among the inputs (nothing to capture; runs eagerly)")
            return None
        if len(self.graphs) >= self.max_graphs:
            self._fail(f"graph limit {self.max_graphs} reached")
            return None
        if self.probe and not self.speculate:  # a speculating capture reads on the host by design
            p_args, p_kwargs = _copies(args, kwargs, self.static_ptrs)  # the probe must not write to the caller's
            try:
                reason = probe_sync(self.fn, p_args, p_kwargs)
            except Exception as e:  # noqa: BLE001 - a probe that fails leaves the call to run eagerly
                reason = f"probe run failed: {type(e).__name__}: {str(e)[:160]}"
            if reason:
                self._refuse(key, reason)
                return None
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            g = CapturedCall(self.fn, args, kwargs, pool=self.pool, warmup=self.warmup,
                             static_ptrs=self.static_ptrs, speculate=self.speculate)
        except Exception as e:  # noqa: BLE001 - any capture failure means: run this signature eagerly
            self._refuse(key, _capture_failure_reason(e))
            _recover_after_failed_capture()
            return None
        self.graphs[key] = g
        self.stats.captures += 1
        return g

    def __call__(self, *args, **kwargs):
        key = signature(args, kwargs, self.static_ptrs)
        g = self.graphs.get(key)
        if g is None and key not in self.refused:
            n = self.seen.get(key, 0) + 1
            self.seen[key] = n
            if n >= self.capture_after:
                with self._lock:
                    g = self.capture(*args, **kwargs)
        if g is None:
            self.stats.eager_calls += 1
            return self.fn(*args, **kwargs)
        self.stats.replays += 1
        return g(*args, **kwargs)

    def report(self) -> dict:
        return {"name": self.name, "graphs": len(self.graphs),
                "nodes": [g.nodes for g in self.graphs.values()],
                "speculated_host_reads": [g.host_reads for g in self.graphs.values()] if self.speculate else None,
                "guard_failures": sum(g.guard_failures for g in self.graphs.values()),
                "refused": sorted(set(self.refused.values())), **self.stats.to_dict()}


def _capture_failure_reason(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    low = str(e).lower()
    if "capture" in low and ("sync" in low or "not permitted" in low or "invalidated" in low
                             or "unsupported" in low or "operation not permitted" in low):
        return f"host synchronisation or unsupported call during capture ({type(e).__name__}: {msg[:160]})"
    return f"{type(e).__name__}: {msg[:200]}"


def _recover_after_failed_capture() -> None:
    """After a failed capture the CUDA error state must be cleared so later work runs."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass
    try:
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass
