"""General passes: dead code, common subexpressions, no-op casts, host synchronisations.

All four are bit-exact: they only remove work whose result is unused, merge
computations that are the same computation on the same values, drop casts
and views that return their input unchanged, or drop checks that are proven
to hold. They work on both graph levels tkcc sees: ATen graphs from
``torch.export`` (the frontend) and Torch-level graphs from dynamo (the
``torch.compile`` backend).

What counts as a side effect (never removed, never merged):
- any op whose schema writes to an argument (``index_copy_``, ``copy_``,
  ``add_`` ...), Torch-level in-place functions and methods (trailing ``_``)
  and calls with an ``out=`` argument;
- FX's own side-effectful set (asserts, grad-mode and autocast switches,
  profiler ranges, ``setitem``);
- random ops (tagged ``nondeterministic_seeded``, or ``torch.rand*``,
  ``dropout``, ...): removing one changes the random stream of the next;
- higher-order ops and ``call_module`` of modules outside a short list of
  stateless layers (they may hide any of the above).
"""
from __future__ import annotations


import torch
import torch.fx

from tkcc.passes.base import CLEANUP, register
from tkcc.passes.graph_pass import GraphPass
from tkcc.passes.lint import _fetch_attr, _mutated_arg_positions, _root

aten = torch.ops.aten

_RANDOM_FUNCS = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
                 torch.randint_like, torch.bernoulli, torch.multinomial, torch.normal, torch.poisson,
                 torch.nn.functional.dropout, torch.dropout, torch.nn.functional.alpha_dropout,
                 torch.nn.functional.feature_alpha_dropout, torch.nn.functional.dropout1d,
                 torch.nn.functional.dropout2d, torch.nn.functional.dropout3d,
                 torch.nn.functional.gumbel_softmax, torch.nn.functional.rrelu}
_IMPURE_METHODS = {"backward", "register_hook", "retain_grad", "record_stream", "set_", "resize_", "copy_",
                   "uniform_", "normal_", "random_", "exponential_", "bernoulli_", "share_memory_"}
_PURE_MODULES = (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Embedding, torch.nn.Identity, torch.nn.Flatten,
                 torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Softmax,
                 torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.GroupNorm)
if hasattr(torch.nn, "RMSNorm"):
    _PURE_MODULES = _PURE_MODULES + (torch.nn.RMSNorm,)


def _is_random(node: torch.fx.Node) -> bool:
    t = node.target
    tags = getattr(t, "tags", None)
    if tags is not None and torch.Tag.nondeterministic_seeded in tags:
        return True
    if node.op == "call_method":
        return t in ("uniform_", "normal_", "random_", "exponential_", "bernoulli_", "bernoulli", "multinomial")
    return t in _RANDOM_FUNCS


def mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Argument nodes this node may write to (conservatively: all args of opaque calls)."""
    args = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            pos = _mutated_arg_positions(node.target)
            out = [node.args[i] for i in pos if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)]
            schema = node.target._schema
            for a in schema.arguments:
                if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write:
                    v = node.kwargs.get(a.name)
                    if isinstance(v, torch.fx.Node):
                        out.append(v)
            return out
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return args
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and args:
            return args[:1]
        if isinstance(node.kwargs.get("out"), torch.fx.Node):
            return [node.kwargs["out"]]
        return []
    if node.op == "call_method":
        if (node.target.endswith("_") and not node.target.endswith("__")) or node.target in _IMPURE_METHODS:
            return args[:1]
        return []
    if node.op == "call_module":
        return args
    return []


def is_pure(node: torch.fx.Node, gm: torch.fx.GraphModule | None = None) -> bool:
    """True if removing (when unused) or merging this node cannot change any observable effect."""
    if node.op in ("placeholder", "output"):
        return False
    if node.op == "get_attr":
        return True
    if _is_random(node) or mutated_args(node):
        return False
    t = node.target
    if node.op == "call_function":
        if isinstance(t, torch._ops.HigherOrderOperator):
            return False
        if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable:
            return False
        if t in torch.fx.node._side_effectful_functions:
            return False
        if "out" in node.kwargs:
            return False
        return True
    if node.op == "call_method":
        return not (t.endswith("_") or t in _IMPURE_METHODS)
    if node.op == "call_module":
        if gm is None:
            return False
        mod = _fetch_attr(gm, t)
        return isinstance(mod, _PURE_MODULES) and (not mod.training or not any(True for _ in mod.buffers()))
    return False


def _remove_dead(gm: torch.fx.GraphModule, candidates=None, keep_get_attr: bool = False) -> list[str]:
    """Erase pure nodes without users, in reverse order so whole dead chains go."""
    removed = []
    for node in reversed(list(gm.graph.nodes)):
        if candidates is not None and node not in candidates:
            continue
        if node.users or not is_pure(node, gm):
            continue
        if keep_get_attr and node.op == "get_attr":
            continue
        removed.append(node.name)
        gm.graph.erase_node(node)
    return removed


@register
class DeadCodeElimination(GraphPass):
    """Remove pure nodes whose results nobody uses (exact: unused values change nothing)."""

    name = "dce"
    stage = CLEANUP + 3
    version = "1"
    exact = True
    description = "remove pure nodes whose results are unused (side effects, random ops and mutations stay)"
    params = {"get_attr": ["remove", "keep"]}

    def rewrite(self, gm, info, phase, get_attr="remove"):
        removed = _remove_dead(gm, keep_get_attr=(get_attr == "keep"))
        info.matched += len(removed)
        info.replaced += len(removed)
        if removed:
            info.notes.append(f"{phase}: removed {len(removed)} dead nodes")


# ---- common subexpressions -------------------------------------------------------------------

def _freeze(x, canon):
    """Hashable, type-exact key of an argument (1, 1.0 and True stay distinct; -0.0 != 0.0)."""
    if isinstance(x, torch.fx.Node):
        return ("node", canon.get(x, x).name)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_freeze(v, canon) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((str(k), _freeze(v, canon)) for k, v in x.items())))
    if isinstance(x, slice):
        return ("slice", _freeze(x.start, canon), _freeze(x.stop, canon), _freeze(x.step, canon))
    if isinstance(x, float):
        return ("float", repr(x))
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x))  # a constant tensor literal: only the same object is the same value
    try:
        hash(x)
    except TypeError:
        return ("obj", id(x))
    return (type(x).__name__, x)


@register
class CommonSubexpressionElimination(GraphPass):
    """Merge nodes that compute the same pure op on the same inputs (exact: same op, same values).

    Mutation-aware: every storage that some node writes to in place carries
    an epoch that advances at each write; a node's key includes the epoch of
    each input's storage, so a read before a write never merges with a read
    after it. Nodes whose own result is later written to (or a view of it
    is) are never merged: two buffers must stay two buffers.
    """

    name = "cse"
    stage = CLEANUP + 2
    version = "1"
    exact = True
    description = "merge identical pure computations on identical inputs (mutation- and randomness-aware)"
    params = {"get_attr": ["merge", "keep"]}

    def rewrite(self, gm, info, phase, get_attr="merge"):
        merged = merge_duplicates(gm.graph, gm, keep_get_attr=get_attr == "keep")
        info.matched += merged
        info.replaced += merged
        if merged:
            info.notes.append(f"{phase}: merged {merged} duplicate nodes")


def merge_duplicates(graph: torch.fx.Graph, gm: torch.fx.GraphModule | None = None, select=None,
                     keep_get_attr: bool = False) -> int:
    """``cse``'s merge (see its class), on ``graph``; returns how many nodes went. ``select(node)``: only the nodes
    it accepts may merge (the lowering's canonical form merges views only)."""
    nodes = list(graph.nodes)
    written_roots = set()
    for n in nodes:
        for a in mutated_args(n):
            written_roots.add(_root(a))
    epoch: dict[torch.fx.Node, int] = {}
    seen: dict[tuple, torch.fx.Node] = {}
    canon: dict[torch.fx.Node, torch.fx.Node] = {}
    merged = 0
    for n in nodes:
        for a in mutated_args(n):
            r = _root(canon.get(a, a))
            epoch[r] = epoch.get(r, 0) + 1
        if not is_pure(n, gm) or n.op == "call_module" or (select is not None and not select(n)):
            continue
        if n.op == "get_attr" and keep_get_attr:
            continue
        if _root(n) in written_roots or n in written_roots:
            continue
        inputs = [a for a in n.all_input_nodes]
        epochs = tuple(epoch.get(_root(canon.get(a, a)), 0) for a in inputs)
        key = (n.op, _freeze(n.target, canon) if not callable(n.target) else ("fn", id(n.target)),
               _freeze(n.args, canon), _freeze(n.kwargs, canon), epochs)
        prev = seen.get(key)
        if prev is None:
            seen[key] = n
            continue
        n.replace_all_uses_with(prev)
        canon[n] = prev
        graph.erase_node(n)
        merged += 1
    return merged


# ---- no-op casts and views -------------------------------------------------------------------

def _val(node):
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _same_shape(v: torch.Tensor, shape) -> bool:
    try:
        return list(v.shape) == [int(s) for s in shape]
    except (TypeError, ValueError):
        return False


@register
class NoopElimination(GraphPass):
    """Drop casts and views that return their input unchanged (exact: the op is the identity).

    Removed, using the shapes and dtypes recorded at capture (``node.meta['val']``):
    ``aten.to`` to the tensor's own dtype/device with ``copy=False`` (it returns
    its input), ``aten.view``/``reshape``/``expand`` to the input's own shape,
    and ``aten.alias``. Each of these returns the input or a view of the same
    storage, so values and aliasing are unchanged.
    """

    name = "noop-elim"
    stage = CLEANUP + 1
    version = "1"
    exact = True
    description = "drop no-op casts (.to same dtype) and views/reshapes to the same shape"
    params = {"views": ["remove", "keep"]}

    def rewrite(self, gm, info, phase, views="remove"):
        removed = 0
        for n in list(gm.graph.nodes):
            if n.op != "call_function" or not n.args or not isinstance(n.args[0], torch.fx.Node):
                continue
            src = n.args[0]
            vin, vout = _val(src), _val(n)
            if vin is None or vout is None:
                continue
            same_meta = vin.dtype == vout.dtype and vin.device == vout.device and vin.shape == vout.shape
            t = n.target
            drop = False
            if t in (aten.to.dtype, aten.to.dtype_layout, aten.to.device):
                drop = same_meta and not n.kwargs.get("copy", False) and n.kwargs.get("memory_format") is None \
                    and not (t is aten.to.dtype and len(n.args) > 3 and n.args[3])
            elif views == "remove" and t in (aten.view.default, aten.reshape.default, aten.expand.default):
                drop = same_meta and len(n.args) > 1 and _same_shape(vin, n.args[1])
            elif views == "remove" and t is aten.alias.default:
                drop = same_meta
            if drop:
                n.replace_all_uses_with(src)
                gm.graph.erase_node(n)
                removed += 1
        info.matched += removed
        info.replaced += removed
        if removed:
            info.notes.append(f"{phase}: removed {removed} no-op casts/views")


# ---- host synchronisations -------------------------------------------------------------------

def _ops(*names):
    """The named ATen overloads this torch has (older versions lack some)."""
    out = set()
    for name in names:
        op, overload = name.split(".")
        packet = getattr(aten, op, None)
        if packet is not None and hasattr(packet, overload):
            out.add(getattr(packet, overload))
    return out


_ASSERTS = _ops("_assert_async.default", "_assert_async.msg", "_assert_scalar.default")
_CONSTRAINTS = _ops("sym_constrain_range.default", "sym_constrain_range_for_size.default")
_TO_HOST = _ops("_local_scalar_dense.default")
_METADATA_ASSERT = _ops("_assert_tensor_metadata.default")


def _metadata_assert_holds(node: torch.fx.Node) -> bool:
    """``_assert_tensor_metadata(t, size, stride, dtype, device=, layout=)`` provably true from capture metadata."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    v = _val(node.args[0])
    if v is None:
        return False
    args = list(node.args[1:]) + [None] * 3
    size = node.kwargs.get("size", args[0])
    stride = node.kwargs.get("stride", args[1])
    dtype = node.kwargs.get("dtype", args[2])
    device, layout = node.kwargs.get("device"), node.kwargs.get("layout")
    try:
        if dtype is not None and v.dtype != dtype:
            return False
        if device is not None and v.device != torch.device(device):
            return False
        if layout is not None and v.layout != layout:
            return False
        if size is not None and [int(s) for s in v.shape] != [int(s) for s in size]:
            return False
        if stride is not None and [int(s) for s in v.stride()] != [int(s) for s in stride]:
            return False
    except (TypeError, ValueError, RuntimeError):
        return False  # symbolic sizes we cannot decide here: keep the check
    return True


def _constant_true(x) -> bool:
    if isinstance(x, bool):
        return x
    if isinstance(x, (int, float)):
        return bool(x)
    if isinstance(x, torch.fx.Node):
        v = x.meta.get("val")
        if isinstance(v, bool):
            return v
        if isinstance(v, torch.SymBool):
            try:
                return bool(v.node.expr) if v.node.expr.is_Boolean else False  # only literal True/False
            except Exception:
                return False
    return False


def _to_host_copy(node: torch.fx.Node) -> bool:
    """A device -> host copy (``.cpu()``, ``.to('cpu')``, ``_to_copy(device=cpu)``) of a device tensor."""
    if node.op == "call_method" and node.target in ("cpu", "item", "tolist", "numpy"):
        return True
    if node.op == "call_function" and node.target in (aten._to_copy.default, aten.to.device, aten.to.dtype_layout):
        dev = node.kwargs.get("device", node.args[1] if node.target is aten.to.device and len(node.args) > 1 else None)
        src = _val(node.args[0]) if node.args else None
        return dev is not None and torch.device(dev).type == "cpu" and src is not None and src.device.type != "cpu"
    return node.target in _TO_HOST


@register
class HostSyncRemoval(GraphPass):
    """Remove host round-trips that block CUDA-graph capture and cost a sync per call.

    Removed (``asserts="proven"``, the default; bit-exact):
    - ``aten._assert_tensor_metadata`` whose dtype/device/layout/size/stride
      equal the metadata the graph was captured with: export specialises the
      graph on them, so the check can never fail;
    - ``aten._assert_async`` / ``aten._assert_scalar`` / ``sym_constrain_range*``
      whose condition is a literal or a captured constant True;
    - then, host reads with no remaining users: ``_local_scalar_dense``
      (``.item()``), ``.tolist()``, ``.cpu()`` / ``_to_copy(device='cpu')`` of a
      device tensor, and the pure computations that fed only them.
    A host read whose value the graph still uses (data-dependent control or
    shapes) is kept: removing it would change results.

    ``asserts="all"`` also removes data-dependent ``_assert_async`` checks
    (e.g. index bounds). Outputs on valid inputs are unchanged, but invalid
    inputs no longer raise: opt-in only.
    """

    name = "host-sync-removal"
    stage = CLEANUP
    version = "1"
    exact = True
    description = "remove proven-true asserts and unused device->host reads that block CUDA-graph capture"
    params = {"asserts": ["proven", "all"]}

    def rewrite(self, gm, info, phase, asserts="proven"):
        removed: list[str] = []
        feeders: set[torch.fx.Node] = set()
        for n in list(gm.graph.nodes):
            if n.op != "call_function":
                continue
            drop = False
            if n.target in _METADATA_ASSERT:
                drop = _metadata_assert_holds(n)
            elif n.target in _ASSERTS or n.target in _CONSTRAINTS:
                drop = _constant_true(n.args[0]) if n.args else False
                if not drop and asserts == "all" and n.target in _ASSERTS:
                    drop = True
            if drop and not n.users:
                feeders.update(n.all_input_nodes)
                removed.append(n.name)
                gm.graph.erase_node(n)
        # host reads nobody uses any more, and the pure work that only fed them
        syncs = [n for n in gm.graph.nodes if _to_host_copy(n) and not n.users]
        for n in syncs:
            feeders.update(n.all_input_nodes)
            removed.append(n.name)
            gm.graph.erase_node(n)
        erased: set[torch.fx.Node] = set()
        frontier = set(feeders)
        while frontier:
            nxt = set()
            for n in frontier:
                if n in erased or n.users or n.op in ("placeholder", "get_attr") or not is_pure(n, gm):
                    continue
                nxt.update(n.all_input_nodes)
                removed.append(n.name)
                erased.add(n)
                gm.graph.erase_node(n)
            frontier = nxt - erased
        info.matched += len(removed)
        info.replaced += len(removed)
        if removed:
            info.notes.append(f"{phase}: removed {len(removed)} host checks/reads")


DEFAULT_EXACT_PLAN = [("host-sync-removal", {}), ("noop-elim", {}), ("cse", {}), ("dce", {})]
