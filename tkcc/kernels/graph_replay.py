"""The one CUDA-graph capture and replay utility, and the PDL setting of the kernels launched inside it.

Every CUDA graph tkcc makes is made here: the decode step of ``tkcc.compile``'s result (and its
self-feeding greedy step), the engine's graph per bucket, ``exact_cudagraph``, ``exact_regions`` and the science path,
the torch.compile backend's replayed forwards, and the parallel profiler's replay timings. It imports
nothing of tkcc, so kernels, passes, runtime and parallel may all use it.

A capture (``CapturedCall``) of ``fn(*args, **kwargs)``:

- copies every device input into a static buffer of the same shape, strides and dtype, except the
  tensors in ``static_ptrs`` (weights), which the graph reads in place;
- runs ``warmup`` eager calls on a side stream (lazy library set-up, Triton compiles and cuBLAS
  workspaces happen there, not in the graph), then captures one call on that stream, under
  ``torch.no_grad()`` (a replay records no autograd history);
- allocates into a memory pool: private to the graph (``pool=None``) or shared (``new_pool()``;
  sound for graphs that never run at the same time and whose outputs are cloned or consumed before
  another graph of the pool replays);
- runs warm-up and capture inside ``pdl_scope(pdl)``: a kernel op called with ``pdl=None`` then
  launches with programmatic dependent launch (Hopper and later), so the graph records PDL edges and a
  kernel's prologue overlaps the tail of the one before it.

A replay: ``load`` copies new values into the static inputs, ``replay`` runs the graph,
``static_outputs`` are the graph's own output tensors (overwritten by the next replay); ``run`` is load
then replay. ``__call__`` is the drop-in for ``fn``: it also copies back inputs the call writes in
place, and clones the outputs out of the pool, so they stay valid after the next replay.

Why a replay keeps bits: a CUDA graph records the very kernels the call launched (same kernels, launch
parameters and argument pointers) and replays them; nothing is recompiled, fused or reordered. So a
replay computes bit for bit what one eager call computes on the same values, as long as the eager call
is deterministic and its kernel choice depends only on what the capture key fixes.

The capture key (``signature``) fixes:

- every device tensor's shape, strides, dtype, device and the 16-byte alignment of its data pointer
  (cuBLAS and cuBLASLt pick algorithms by alignment); a weight, by its address;
- the *values* of everything else: Python scalars, strings, and CPU tensors (a 0-dim CPU tensor is
  passed into a kernel as an immediate argument, so it is baked into the graph);
- the process-global switches that pick kernels (``kernel_switches``): deterministic algorithms, the
  float32 matmul precision, reduced-precision reductions, the cuDNN and attention-backend switches,
  autocast and the PDL scope.

``GraphCache`` holds one graph per key, with a policy for keys that come and go (a data-dependent size
seen once runs eagerly; seen twice, it is captured), and falls back to the eager call, with the reason
recorded, where a capture is impossible (the callable synchronises with the host, or the device is not
CUDA). Falling back never changes bits: it is the reference itself. Host reads that depend only on the
model's own state may instead be speculated (``speculate=True``, ``tkcc.kernels.host_reads``).
"""
from __future__ import annotations

import contextlib
import contextvars
import statistics
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

_ALIGN = 16  # bytes; the largest alignment cuBLASLt's heuristics distinguish


class GraphCaptureError(RuntimeError):
    """The callable cannot be captured as one CUDA graph; its caller runs it eagerly instead."""


class SyncError(GraphCaptureError):
    """The callable synchronises with the host, or needs an aliasing that separate buffers would cut."""


class SpeculationError(SyncError):
    """A host read cannot be speculated (its value depends on the inputs, or the reads changed)."""


# ---- PDL ------------------------------------------------------------------------------------------

_PDL = contextvars.ContextVar("tkcc_pdl", default=False)
_CAPABILITY: dict = {}


def pdl_supported(device=None) -> bool:
    """Programmatic dependent launch needs a CUDA device of compute capability 9.0 or later."""
    if not torch.cuda.is_available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return False
    idx = torch.cuda.current_device() if dev.index is None else dev.index
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _CAPABILITY[idx]


@contextlib.contextmanager
def pdl_scope(on: bool, device=None):
    """Within: kernel ops called with ``pdl=None`` launch with PDL (where the device supports it)."""
    token = _PDL.set(bool(on) and pdl_supported(device))
    try:
        yield _PDL.get()
    finally:
        _PDL.reset(token)


def launch_pdl(pdl: bool | None = None) -> bool:
    """What a kernel op launches with: its own ``pdl`` argument when given, else the enclosing
    ``pdl_scope``'s setting (off outside any)."""
    return _PDL.get() if pdl is None else bool(pdl)


# ---- the capture key ------------------------------------------------------------------------------

def kernel_switches() -> tuple:
    """The process-global settings that change which kernel an op launches (so a graph captured under
    other settings would replay other kernels than an eager call makes now)."""
    b = torch.backends
    autocast = torch.is_autocast_enabled("cuda")
    return (torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
            b.cuda.matmul.allow_fp16_reduced_precision_reduction, b.cuda.matmul.allow_bf16_reduced_precision_reduction,
            b.cudnn.enabled, b.cudnn.benchmark, b.cudnn.deterministic, b.cudnn.allow_tf32,
            b.cuda.flash_sdp_enabled(), b.cuda.mem_efficient_sdp_enabled(), b.cuda.math_sdp_enabled(),
            b.cuda.cudnn_sdp_enabled(), torch.get_autocast_dtype("cuda") if autocast else None, _PDL.get())


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
    return (str(spec), tuple(_leaf_key(x, static_ptrs) for x in leaves), kernel_switches())


def _is_cuda_call(args, kwargs) -> bool:
    leaves = pytree.tree_leaves((args, kwargs))
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in leaves)


_CAPTURE_STREAMS: dict = {}


def capture_stream(device) -> "torch.cuda.Stream":
    """The one side stream of ``device`` every warm-up and capture runs on. Libraries keep state per stream for
    the process's life (cuBLAS a 32 MiB workspace per handle and stream), so a new stream per capture made the
    device memory grow by a workspace at each of the first captures (seen: 224 MiB over one candidate's); torch's
    own ``torch.cuda.graph`` likewise keeps one default capture stream."""
    dev = torch.device(device)
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    s = _CAPTURE_STREAMS.get(key)
    if s is None:
        s = _CAPTURE_STREAMS[key] = torch.cuda.Stream(key)
    return s


def new_pool():
    """A memory pool several graphs may share (None off CUDA)."""
    return torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None


# ---- capture --------------------------------------------------------------------------------------

# One capture (or sync probe) at a time in the process: they share each device's capture stream, and the probe's
# sync-debug mode is process-wide. Callers that capture from several threads (a server's lazy captures) wait here.
_CAPTURE_LOCK = threading.RLock()


def probe_sync(fn: Callable, args: tuple, kwargs: dict | None = None) -> str | None:
    """Run ``fn`` once with CUDA sync debugging set to error; None if it never waits on the device.

    A host synchronisation (``.item()``, ``nonzero``, a blocking copy) inside a capture invalidates it;
    finding it with a plain eager run first avoids entering a capture that must fail.
    """
    with _CAPTURE_LOCK:
        return _probe_sync(fn, args, kwargs)


def _probe_sync(fn: Callable, args: tuple, kwargs: dict | None) -> str | None:
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


def _device_for(leaves, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.is_cuda:
            return x.device
    return torch.device("cuda", torch.cuda.current_device())


class CapturedCall:
    """One CUDA graph of ``fn(*args, **kwargs)`` (see the module docstring).

    Inputs the warm-up calls (on a side stream) wrote to (their version counter moved) are restored before the capture, and ``__call__`` copies
    them back to the caller's tensors after each replay, so in-place ops on inputs keep their meaning.
    ``speculate``: host reads of the model's own state are recorded in the first warm-up call and
    replayed during capture, each checked after every replay (``tkcc.kernels.host_reads``).

    Raises GraphCaptureError where the call cannot be captured; an out-of-memory error or a device
    fault (an illegal address) is raised as it is, since it is not the callable's shape that failed.
    """

    def __init__(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *, pool=None, warmup: int = 2,
                 static_ptrs: frozenset = frozenset(), speculate: bool = False, pdl: bool = False,
                 device=None):
        self.fn = fn
        self.pdl = bool(pdl)
        self.guard_vec, self.expected = None, None
        self.guard_failures = 0
        self.host_reads = 0
        leaves, self.in_spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        self.device = _device_for(leaves, device)
        try:
            with _CAPTURE_LOCK, torch.cuda.device(self.device), torch.no_grad(), pdl_scope(self.pdl, self.device):
                self._capture(leaves, pool, warmup, frozenset(static_ptrs), speculate)
        except Exception as e:
            if _device_fault(e):
                raise
            _recover_after_failed_capture()
            if isinstance(e, GraphCaptureError):
                raise
            raise GraphCaptureError(_capture_failure_reason(e)) from e

    def _capture(self, leaves, pool, warmup, static_ptrs, speculate) -> None:
        self.static_ptrs = static_ptrs
        self._dev_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)
                         and x.device.type == "cuda" and x.data_ptr() not in static_ptrs]
        copied = set(self._dev_idx)
        # what the graph holds baked in: host values, and the weights it reads in place (by address)
        self._fixed = [(i, _leaf_key(x, static_ptrs)) for i, x in enumerate(leaves) if i not in copied]
        storages = [leaves[i].untyped_storage().data_ptr() for i in self._dev_idx]
        self.static_leaves = list(leaves)
        for i in self._dev_idx:
            x = leaves[i]
            self.static_leaves[i] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
        s_args, s_kwargs = pytree.tree_unflatten(self.static_leaves, self.in_spec)
        self.static_args, self.static_kwargs = s_args, s_kwargs  # what the graph reads: write into them in place
        versions = [self.static_leaves[i]._version for i in self._dev_idx]
        dev_inputs = [self.static_leaves[i] for i in self._dev_idx]
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        recorded = None
        with torch.cuda.stream(stream):
            for w in range(max(1, warmup)):
                if speculate and w == 0:
                    from tkcc.kernels.host_reads import HostReads

                    with HostReads(dev_inputs, "record") as rec:
                        self.fn(*s_args, **s_kwargs)
                    recorded = rec.values
                else:
                    self.fn(*s_args, **s_kwargs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self._written = [i for i, v in zip(self._dev_idx, versions) if self.static_leaves[i]._version != v]
        if self._written and len(set(storages)) != len(storages):
            raise SyncError("the callable writes to an input that shares memory with another input; "
                            "separate static buffers would break that aliasing")
        for i in self._written:  # warm-up changed the buffers: the caller's values again before capturing
            self.static_leaves[i].copy_(leaves[i])
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a server captures a swapped-in forward beside the thread serving the old one, whose
        # launches a process-wide capture would fail ("operation not permitted when stream is capturing")
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            if speculate:
                from tkcc.kernels.host_reads import HostReads

                with HostReads(dev_inputs, "replay", recorded) as rep:
                    out = self.fn(*s_args, **s_kwargs)
                if rep.i != len(recorded):
                    raise SpeculationError("the forward read fewer values on the host than when it was recorded")
                if rep.guards:  # computed by the graph at every replay, checked after it
                    self.guard_vec = torch.stack([g.to(torch.float64) for g in rep.guards])
                    self.expected = [float(v) for v in recorded]
            else:
                out = self.fn(*s_args, **s_kwargs)
        torch.cuda.synchronize(self.device)
        self.host_reads = len(recorded or [])
        self.outputs = out
        self.out_leaves, self.out_spec = pytree.tree_flatten(out)
        self.static_outputs = [x for x in self.out_leaves if isinstance(x, torch.Tensor)]
        self.aliasing = _output_aliasing(self.out_leaves, [x for x in self.static_leaves if isinstance(x, torch.Tensor)])
        self.nodes = _graph_nodes(self.graph)

    # -- replay -----------------------------------------------------------------------------------
    def load(self, *args, **kwargs) -> None:
        """Copy a call's input values into the static buffers (checked: same layout, same host values)."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise GraphCaptureError(f"inputs of another structure than the captured call: {spec} vs {self.in_spec}")
        for i in self._dev_idx:
            x, buf = leaves[i], self.static_leaves[i]
            if not isinstance(x, torch.Tensor) or x.shape != buf.shape or x.dtype != buf.dtype:
                got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise GraphCaptureError(f"input {i} is {got}, the graph was captured for "
                                        f"{tuple(buf.shape)} {buf.dtype}")
        for i, key in self._fixed:
            if _leaf_key(leaves[i], self.static_ptrs) != key:
                raise GraphCaptureError(f"input {i} differs from the captured call's, which the graph holds "
                                        "baked in (a host value, or a weight read in place): capture another graph")
        self._copy_in(leaves)

    def _copy_in(self, leaves) -> None:
        for i in self._dev_idx:
            self.static_leaves[i].copy_(leaves[i])

    def replay(self) -> None:
        """Run the graph on what the static inputs hold; a speculated host read that changed raises."""
        self.graph.replay()
        if self.guard_vec is not None and not self._guards_hold():
            raise SpeculationError("a host read of the model's state changed since capture; run it eagerly")

    def _guards_hold(self) -> bool:
        return self.guard_vec.tolist() == self.expected

    @property
    def static_inputs(self) -> tuple:
        """The positional inputs as the graph holds them (its static buffers for tensors)."""
        return tuple(self.static_args)

    def run(self, *args, **kwargs) -> list[torch.Tensor]:
        """``load`` then ``replay``; the graph's own output tensors (valid until the next replay)."""
        self.load(*args, **kwargs)
        self.replay()
        return self.static_outputs

    def __call__(self, *args, **kwargs):
        """What ``fn(*args, **kwargs)`` returns, from a replay (the caller has matched the key)."""
        if self.aliasing:
            raise SyncError(self.aliasing)
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        self._copy_in(leaves)
        self.graph.replay()
        if self.guard_vec is not None and not self._guards_hold():
            # a value the forward reads on the host changed (the model's state was edited in place):
            # this replay took another path than eager would; discard it and run eagerly
            self.guard_failures += 1
            with pdl_scope(self.pdl, self.device):
                return self.fn(*args, **kwargs)
        for i in self._written:
            leaves[i].copy_(self.static_leaves[i])
        outs = [x.clone(memory_format=torch.preserve_format) if isinstance(x, torch.Tensor) else x
                for x in self.out_leaves]
        return pytree.tree_unflatten(outs, self.out_spec)

    def replay_times_us(self, reps: int, warm: int = 1) -> list[float]:
        """Device microseconds of each of ``reps`` replays (CUDA events around the replay alone)."""
        for _ in range(warm):
            self.graph.replay()
        out = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.graph.replay()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1e3)
        return out


def replay_us(fn: Callable, reps: int = 20, warmup: int = 2, warm_replays: int = 1, pdl: bool = False,
              device=None) -> float:
    """Median device microseconds of ``fn()`` replayed from a CUDA graph (launch gaps as in a captured
    step, no host overhead): what the machine profiler and the lowered step's tuning time."""
    g = CapturedCall(fn, (), warmup=warmup, pdl=pdl, device=device)
    return statistics.median(g.replay_times_us(reps, warm=warm_replays))


def _output_aliasing(outs, ins) -> str | None:
    """Why the outputs cannot be cloned out (they share memory with each other or an input), or None.

    A clone would silently cut the aliasing that later in-place writes in the caller's code may rely on.
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
            return f"output {i} shares memory with {seen[p]}; cloning it out would break that aliasing"
        seen[p] = f"output {i}"
    return None


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


def _device_fault(e: Exception) -> bool:
    """Out of memory, or a broken device context: not an uncapturable callable; its caller must handle it."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    msg = str(e)
    return "illegal memory access" in msg or ("CUDA error" in msg and "captur" not in msg)


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


# ---- one graph per key ----------------------------------------------------------------------------

@dataclass
class CacheStats:
    replays: int = 0
    eager_calls: int = 0
    captures: int = 0
    failures: dict = field(default_factory=dict)  # reason -> count

    def to_dict(self) -> dict:
        return {"replays": self.replays, "eager_calls": self.eager_calls, "captures": self.captures,
                "failures": dict(self.failures)}


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    return next(x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor))


def greedy_body(fn: Callable, ids: torch.Tensor, pos: torch.Tensor):
    """One decode step and its greedy choice, feeding itself: ``fn(ids, pos)`` (logits, or a structure whose first
    tensor is them), the argmax of the last position written back into ``ids`` and ``pos`` advanced, in place.
    Returns (token [B], that position's logits [B, vocab])."""
    from tkcc.kernels.argmax import argmax

    last = _first_tensor(fn(ids, pos))[:, -1]
    tok = argmax(last)  # torch.argmax's index, without its one-block 37 us kernel (tkcc.kernels.argmax)
    ids.copy_(tok[:, None])
    pos.add_(1)
    return tok, last


class GreedyStep:
    """A decode forward's greedy step (``greedy_body``) captured as one CUDA graph that feeds itself: each replay
    reads the token and position the one before wrote, so the greedy loop runs one replay and one 8-byte copy
    per token, with no input copies, argmax or position kernels launched between replays (on llama-1b-16l those
    cost ~45 us a token on the H200).
    Where the step cannot be captured (``GraphCache`` refused the forward, or the capture fails) it runs the
    same body through the cache's call, eagerly or from its plain graph."""

    def __init__(self, cache: "GraphCache"):
        self.cache = cache
        self.graph: CapturedCall | None = None
        self.key = None
        self.refused: str | None = None
        self._ids = self._pos = None

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor | None, *, position: int | None = None,
                 continued: bool = False):
        """``tok`` [B, 1] (the token chosen last), ``pos`` [1] (its position; None when ``continued``: the step
        goes on from its own). Returns (the next token [B], its logits [B, vocab], valid until the next step)."""
        if not continued:
            self._start(tok, pos)
        if self.graph is None:
            out, last = greedy_body(self.cache, self._ids, self._pos)
            return out.clone(), last
        self.graph.replay()
        out, last = self.graph.static_outputs
        return out.clone(), last

    def _start(self, tok, pos) -> None:
        if pos is None:
            raise GraphCaptureError("a greedy step starts from a position (pos is None and not continued)")
        key = self.cache._key((tok, pos), {})
        if self.graph is not None and self.key == key:
            ids_s, pos_s = self.graph.static_inputs
            ids_s.copy_(tok)
            pos_s.copy_(pos)
            return
        self.graph, self.key = None, key
        self._ids, self._pos = tok.clone(), pos.clone()
        if self.refused is not None or not _is_cuda_call((tok, pos), {}) or self.cache.capture(tok, pos) is None:
            self.refused = self.refused or "the forward is not captured (see its cache's report)"
            return
        cache = self.cache
        try:  # a pool of its own: a replay of the cache's plain graph must not overwrite the logits it returned
            with cache._lock:
                g = CapturedCall(lambda ids, p: greedy_body(cache.fn, ids, p), (tok, pos), pool=new_pool(),
                                 warmup=1, static_ptrs=cache.static_ptrs, pdl=cache.pdl)
        except GraphCaptureError as e:
            self.refused = str(e)
            return
        if g.aliasing:
            self.refused = g.aliasing
            return
        self.graph = g


class GraphCache:
    """Captured graphs of one callable, one per capture key, with an eager fallback.

    capture_after: capture a key the n-th time it is seen (1: at once; 2: sizes that occur only once,
                   e.g. a one-off neighbour count, stay eager and cost no capture).
    max_graphs:    at most this many graphs; later new keys run eagerly.
    pool:          a pool shared by every graph (``new_pool()``, possibly shared with other caches), or
                   None for one pool of this cache's own (made on first capture).
    static_ptrs:   data pointers of tensors the graph reads in place (weights).
    probe:         run one eager call with sync debugging before capturing a key, and refuse it if it
                   synchronises.
    pdl:           the PDL setting of kernel ops launched inside (``pdl_scope``), eager calls included.
    """

    def __init__(self, fn: Callable, name: str = "region", capture_after: int = 1, max_graphs: int = 64,
                 pool=None, warmup: int = 2, static_ptrs=frozenset(), probe: bool = True,
                 speculate: bool = False, pdl: bool = False):
        self.fn, self.name = fn, name
        self.speculate, self.pdl = speculate, bool(pdl)
        self.capture_after, self.max_graphs, self.warmup = capture_after, max_graphs, warmup
        self.pool = pool
        self.static_ptrs = frozenset(static_ptrs)
        self.probe = probe
        self.graphs: dict = {}
        self.seen: dict = {}
        self.refused: dict = {}  # key -> reason capture is impossible
        self.stats = CacheStats()
        self._lock = threading.Lock()

    def _fail(self, reason: str):
        self.stats.failures[reason] = self.stats.failures.get(reason, 0) + 1

    def _refuse(self, key, reason: str) -> None:
        self.refused[key] = reason
        self._fail(reason)

    def _key(self, args, kwargs):
        return signature(args, kwargs, self.static_ptrs)

    def capture(self, *args, **kwargs) -> CapturedCall | None:
        """Capture now for this key (used at compile time for known shapes); None if impossible."""
        return self._capture(self._key(args, kwargs), args, kwargs)

    def _capture(self, key, args, kwargs) -> CapturedCall | None:
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
                with pdl_scope(self.pdl):
                    reason = probe_sync(self.fn, p_args, p_kwargs)
            except Exception as e:  # noqa: BLE001 - a probe that fails leaves the call to run eagerly
                reason = f"probe run failed: {type(e).__name__}: {str(e)[:160]}"
            if reason:
                self._refuse(key, reason)
                return None
        if self.pool is None:
            self.pool = new_pool()
        try:
            g = CapturedCall(self.fn, args, kwargs, pool=self.pool, warmup=self.warmup,
                             static_ptrs=self.static_ptrs, speculate=self.speculate, pdl=self.pdl)
        except GraphCaptureError as e:
            self._refuse(key, str(e))
            return None
        except Exception as e:  # noqa: BLE001 - any capture failure means: run this key eagerly
            self._refuse(key, _capture_failure_reason(e))
            _recover_after_failed_capture()
            return None
        if g.aliasing:
            self._refuse(key, g.aliasing)
            return None
        self.graphs[key] = g
        self.stats.captures += 1
        return g

    def __call__(self, *args, **kwargs):
        key = self._key(args, kwargs)
        g = self.graphs.get(key)
        if g is None and key not in self.refused:
            n = self.seen.get(key, 0) + 1
            self.seen[key] = n
            if n >= self.capture_after:
                with self._lock:
                    g = self._capture(key, args, kwargs)
        if g is None:
            self.stats.eager_calls += 1
            if self.pdl or _PDL.get():
                with pdl_scope(self.pdl):
                    return self.fn(*args, **kwargs)
            return self.fn(*args, **kwargs)
        self.stats.replays += 1
        return g(*args, **kwargs)

    @property
    def tkcc_greedy(self):
        """The greedy loop's self-feeding step over this callable (``GreedyStep``). Not for a speculating cache:
        its replays are checked against host reads."""
        if self.speculate:
            return None
        step = self.__dict__.get("_greedy")
        if step is None:
            step = self.__dict__["_greedy"] = GreedyStep(self)
        return step

    def report(self) -> dict:
        step = self.__dict__.get("_greedy")
        greedy = None if step is None else {"captured": step.graph is not None, "refused": step.refused}
        return {"name": self.name, "graphs": len(self.graphs), "greedy_step": greedy,
                "nodes": [g.nodes for g in self.graphs.values()],
                "speculated_host_reads": [g.host_reads for g in self.graphs.values()] if self.speculate else None,
                "guard_failures": sum(g.guard_failures for g in self.graphs.values()),
                "refused": sorted(set(self.refused.values())), **self.stats.to_dict()}
