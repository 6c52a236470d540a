"""Rewrites as pairs of plain PyTorch functions, matched on aten graphs by op pattern (TorchInductor style).

A ``Rewrite`` is a ``pattern`` and a ``replacement`` with the same signature: tensors positional, scalars by
keyword. The pattern is what a model's code computes for a region (Hugging Face's RMSNorm, its gated MLP,
its attention block); the replacement computes the same with ``torch.ops.tkcc`` kernel ops. Both are traced
to aten exactly as the Program's graphs are made (non-strict ``torch.export``, cleaned by
``tkcc.frontend.export``), on meta tensors, so tracing costs no memory at any model size.

Matching a rewrite on a graph:

1. the pattern, traced at example shapes with *sentinel* scalars, is matched structurally
   (``torch.fx`` ``SubgraphMatcher``: same ops, same data flow, literals ignored; every node but the
   outputs, and views of the inputs alone, used only inside the region);
2. each scalar is read off the graph where its sentinel stands in the pattern (the ``eps`` of an add, a
   ``scale`` keyword, a ``topk`` k); every occurrence must agree;
3. the pattern is traced again at the matched inputs' shapes, strides and dtypes with those scalars, and
   compared with the region literal by literal: the region is then exactly the pattern's aten program, so
   the replacement (tested against the pattern on random inputs) computes what the region computed;
4. the rewrite's ``check`` sees the match (shapes, dtypes, weights, producers of its inputs) and may refuse
   it with a reason, which the pass logs: the region then stays in aten;
5. the replacement, traced at the same shapes (with any tensors the rewrite adds: packed weights, arrival
   counters), is inlined in place of the region, and every new node records the nodes it came from.

Both the pattern's trace and the graph are canonicalised the same way first (``canonicalize``: casts to
the dtype a tensor already has and ``aten.alias`` are dropped, equal views of one tensor merged), so one
pattern serves fp32 graphs, where ``x.to(torch.float32)`` is the identity, and bf16 graphs, where it is a real
cast, and graphs that ``cse`` ran on or not.
"""
from __future__ import annotations

import copy
import heapq
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from tkcc.passes.general import merge_duplicates
from tkcc.passes.graph_pass import origin
from tkcc.passes.lower import pattern_ops

_NOOP_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
               torch.ops.aten.alias.default, torch.ops.aten.contiguous.default}


# ---- canonical form -------------------------------------------------------------------------------------

def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


_MULS = {torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar}


def _is_times_one(n: torch.fx.Node) -> bool:
    """``x * 1`` (MiniMax's residual ``h * beta`` with beta 1): x bit for bit, when the product has x's dtype and
    shape. Kept where the product is an output of the graph or something writes into it (it is a new tensor)."""
    if len(n.args) != 2 or not isinstance(n.args[0], torch.fx.Node) or n.kwargs:
        return False
    one = n.args[1]
    if isinstance(one, bool) or not isinstance(one, (int, float)) or one != 1:
        return False
    src, out = _val(n.args[0]), _val(n)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if src.dtype != out.dtype or tuple(src.shape) != tuple(out.shape):
        return False
    return not any(u.op == "output" or (isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable)
                   for u in n.users)


def _is_noop(n: torch.fx.Node) -> bool:
    if n.op == "call_function" and n.target is torch.ops.aten.dropout.default:  # eval: the identity
        args = _all_args(n)
        return args[2] is False or args[1] == 0.0
    if n.op == "call_function" and n.target in _MULS:
        return _is_times_one(n)
    if n.op != "call_function" or n.target not in _NOOP_CASTS or not n.args:
        return False
    src, out = _val(n.args[0]), _val(n)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if n.target is torch.ops.aten.alias.default:
        return True
    if n.target is torch.ops.aten.contiguous.default:
        return src.is_contiguous()
    named = dict(zip((a.name for a in n.target._schema.arguments), _all_args(n)))
    if named.get("copy") or named.get("memory_format") not in (None, torch.preserve_format):
        return False
    # eager's ``to`` returns its input itself when nothing changes, whatever strides the trace recorded for
    # it (the ``noop-elim`` pass's rule, so that a graph it ran on matches as the captured one does)
    return src.dtype == out.dtype and src.device.type == out.device.type and src.shape == out.shape


VIEW_OPS = {torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
            torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
            torch.ops.aten.expand.default, torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
            torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.t.default}


def _is_view(n: torch.fx.Node) -> bool:
    """A call that returns a view of its input (a ``reshape`` only of a contiguous input: else it copies)."""
    if n.op != "call_function" or n.target not in VIEW_OPS:
        return False
    if n.target is torch.ops.aten.reshape.default:
        src = _val(n.args[0])
        return isinstance(src, torch.Tensor) and src.is_contiguous()
    return True


def _merge_views(graph: torch.fx.Graph) -> int:
    """Make one node of equal views of one tensor (``cse``'s merge, views only), so that a graph matches a pattern
    whether or not ``cse`` ran first: Hugging Face's code often takes ``x.view(-1, H)`` twice. Views compute
    nothing and alias their input, so merging them is bit-exact."""
    return merge_duplicates(graph, select=_is_view)


_FRESH = {torch.ops.aten.zeros_like.default, torch.ops.aten.empty_like.default, torch.ops.aten.zeros.default,
          torch.ops.aten.empty.memory_format}


def _whole_writes(graph: torch.fx.Graph) -> int:
    """``z = zeros_like(v); z.select(d, 0).copy_(src)`` where z's dim d has size 1 (transformers' per-token loops,
    run for one token, write their output so): the copy overwrites all of z, so z's later readers read
    ``src.unsqueeze(d)`` instead, bit for bit. Written as data flow, a pattern's output is reachable from the
    inputs it was computed from (the copy is a side effect no output depends on). Returns the nodes dropped."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    dropped = 0
    for c in list(graph.nodes):
        if c.op != "call_function" or c.target is not torch.ops.aten.copy_.default or c.users or len(c.args) < 2:
            continue
        sel, src = c.args[0], c.args[1]
        if not isinstance(sel, torch.fx.Node) or sel.target is not torch.ops.aten.select.int or len(sel.users) != 1:
            continue
        z, dim, idx = sel.args
        if not isinstance(z, torch.fx.Node) or z.op != "call_function" or z.target not in _FRESH:
            continue
        zv, sv = _val(z), _val(src)
        if not isinstance(zv, torch.Tensor) or not isinstance(sv, torch.Tensor):
            continue
        dim = dim % zv.dim()
        if zv.shape[dim] != 1 or idx not in (0, -1) or sv.dtype != zv.dtype or \
                tuple(sv.shape) != tuple(zv.shape[:dim]) + tuple(zv.shape[dim + 1:]):
            continue
        readers = [u for u in z.users if u is not sel]
        if any(order[u] < order[c] for u in readers):
            continue  # a reader of the zeros
        with graph.inserting_after(c):
            new = graph.call_function(torch.ops.aten.unsqueeze.default, (src, dim))
        mode = getattr(sv, "fake_mode", None)
        if mode is not None:
            with mode:
                new.meta["val"] = sv.unsqueeze(dim)
        else:
            new.meta["val"] = sv.unsqueeze(dim)
        for u in readers:
            u.replace_input_with(z, new)
        for n in (c, sel, z):
            graph.erase_node(n)
        dropped += 2
    return dropped


_ANDS = {torch.ops.aten.__and__.Tensor, torch.ops.aten.bitwise_and.Tensor, torch.ops.aten.logical_and.default}
_ONES = {torch.ops.aten.ones.default, torch.ops.aten.new_ones.default, torch.ops.aten.ones_like.default}
_KEEPS_ONES = VIEW_OPS | _NOOP_CASTS | {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default,
                                       torch.ops.aten.index.Tensor}


def _all_ones(n, depth: int = 0) -> bool:
    """Whether ``n`` holds ones (True) everywhere by construction: ``ones`` through casts, views and gathers."""
    if not isinstance(n, torch.fx.Node) or n.op != "call_function" or depth > 16:
        return False
    if n.target in _ONES:
        return True
    return n.target in _KEEPS_ONES and _all_ones(n.args[0], depth + 1)


def _true_masks(graph: torch.fx.Graph) -> int:
    """``m & p`` where p is all True by construction and m (bool) already has the result's shape: m itself.

    A model given no padding (tkcc's step passes an all-ones mask over the whole cache where the model would
    size one by the cache's length: ``tkcc.frontend.hf.mask_sized_by_the_cache``) ands that mask into every
    attention's causal mask; without the term the attention patterns match. Bit-exact (x & True is x)."""
    dropped = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in _ANDS or len(n.args) != 2:
            continue
        out = _val(n)
        for keep, ones in (n.args, n.args[::-1]):
            kv, ov = _val(keep), _val(ones)
            if (isinstance(kv, torch.Tensor) and isinstance(ov, torch.Tensor) and isinstance(out, torch.Tensor)
                    and kv.dtype == ov.dtype == torch.bool and tuple(kv.shape) == tuple(out.shape)
                    and _all_ones(ones)):
                n.replace_all_uses_with(keep)
                graph.erase_node(n)
                dropped += 1 + _erase_unused(graph, ones)
                break
    return dropped


def _erase_unused(graph: torch.fx.Graph, n) -> int:
    """Erase ``n`` and, in turn, its inputs that nothing else reads (only the pure ops ``_all_ones`` walks)."""
    erased = 0
    while isinstance(n, torch.fx.Node) and not n.users and (n.target in _ONES or n.target in _KEEPS_ONES):
        src = n.args[0] if n.target not in _ONES else None
        graph.erase_node(n)
        erased += 1
        n = src
    return erased


def canonicalize(graph: torch.fx.Graph) -> int:
    """Drop casts to what a tensor already is and aliases (eager returns the tensor itself) and products by one
    (``_is_times_one``), write a copy that overwrites a fresh tensor whole as the value copied (``_whole_writes``),
    drop an all-True term of a mask (``_true_masks``), and merge equal views of one tensor; returns how many nodes
    went. Bit-exact: the ops dropped compute nothing."""
    dropped = 0
    for n in list(graph.nodes):
        if _is_noop(n):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
            dropped += 1
    return dropped + _whole_writes(graph) + _true_masks(graph) + _merge_views(graph)


def stable_toposort(graph: torch.fx.Graph) -> None:
    """Reorder so that every node follows its inputs, moving as few as possible (each node keeps its place
    unless an input now comes after it). Replacements are inlined after their last input; a region's output
    whose users came before that point moves down with them."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    pending = {n: len(set(n.all_input_nodes)) for n in nodes}
    users: dict[torch.fx.Node, list] = {n: [] for n in nodes}
    for n in nodes:
        for a in set(n.all_input_nodes):
            users[a].append(n)
    heap = [(pos[n], n.name, n) for n in nodes if pending[n] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, n = heapq.heappop(heap)
        order.append(n)
        for u in users[n]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(heap, (pos[u], u.name, u))
    if len(order) != len(nodes):
        raise RuntimeError("stable_toposort: the graph has a cycle")
    if order == nodes:
        return
    out = [n for n in order if n.op == "output"]
    cursor = order[0]
    for n in order[1:]:
        if n.op == "output":
            continue
        cursor.append(n)
        cursor = n
    if out:
        cursor.append(out[0])


# ---- tracing ---------------------------------------------------------------------------------------------

class _Fn(torch.nn.Module):
    def __init__(self, fn, scalars):
        super().__init__()
        self.fn, self.scalars = fn, scalars

    def forward(self, *tensors):
        return self.fn(*tensors, **self.scalars)


def _meta_like(v: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(int(s) for s in v.shape), tuple(int(s) for s in v.stride()), dtype=v.dtype,
                               device="meta")


def _sig(tensors, scalars) -> tuple:
    return (tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors),
            tuple(sorted((k, repr(v)) for k, v in scalars.items())))


_TRACES: dict[tuple, torch.fx.GraphModule] = {}


def trace(fn: Callable, tensors: tuple, scalars: dict | None = None) -> torch.fx.GraphModule:
    """``fn(*tensors, **scalars)`` as a canonical aten graph, traced on meta tensors like the Program's
    graphs (cached per function, shapes, strides, dtypes and scalars: a trace is deterministic)."""
    from tkcc.frontend.export import clean_exported

    scalars = dict(scalars or {})
    metas = tuple(_meta_like(t) for t in tensors)
    key = (fn, _sig(metas, scalars))
    hit = _TRACES.get(key)
    if hit is not None:
        return hit
    with torch.no_grad():
        ep = torch.export.export(_Fn(fn, scalars), metas, strict=False)
    gm, _spec = clean_exported(ep)
    canonicalize(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _TRACES[key] = gm
    return gm


# ---- literals --------------------------------------------------------------------------------------------

def with_arg(n, args, kwargs, index, name, value):
    """The call's args with argument ``index`` (``name`` when given by keyword) replaced, the defaults before it
    written out."""
    args = list(args)
    if name in kwargs:
        kwargs = dict(kwargs, **{name: value})
    else:
        schema = n.target._schema.arguments
        while len(args) <= index:
            a = schema[len(args)]
            args.append(a.default_value if a.has_default_value() else None)
        args[index] = value
    return args, kwargs


def set_arg(n, index, name, value) -> None:
    """Argument ``index`` (``name``) of the call ``n`` set to ``value`` in place (``with_arg``)."""
    args, kwargs = with_arg(n, n.args, n.kwargs, index, name, value)
    n.args, n.kwargs = tuple(args), kwargs


def _all_args(n: torch.fx.Node) -> list:
    """A call's arguments in schema order, defaults filled in (so that two spellings of one call compare)."""
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        out = []
        for i, a in enumerate(t._schema.arguments):
            if a.name in n.kwargs:
                out.append(n.kwargs[a.name])
            elif not a.kwarg_only and i < len(n.args):
                out.append(n.args[i])
            else:
                out.append(a.default_value if a.has_default_value() else None)
        return out
    return list(n.args) + [n.kwargs[k] for k in sorted(n.kwargs)]


def _leaves(value, path=()):
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, path + (i,))
    else:
        yield path, value


def _at(value, path):
    for i in path:
        if not isinstance(value, (list, tuple)) or i >= len(value):
            raise KeyError(path)
        value = value[i]
    return value


def _same_literal(a, b) -> bool:
    if isinstance(a, torch.device) and isinstance(b, torch.device):
        return True  # patterns are traced on meta tensors; the device is the graph's
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b and isinstance(a, float) == isinstance(b, float)
    return type(a) is type(b) and a == b


def _has_node(v) -> bool:
    if isinstance(v, torch.fx.Node):
        return True
    return isinstance(v, (list, tuple)) and any(_has_node(x) for x in v)


def _shareable(pattern: torch.fx.Graph) -> set:
    """The pattern's nodes that are views of its inputs only (``cos.unsqueeze(1)``, a slice of the mask). Such a
    node may also feed the graph outside the region: after ``cse``, every layer reads one ``unsqueeze`` of the
    rotary table. The replacement reads the inputs themselves, so the view stays for its other readers."""
    out: set = set()
    returned = set(list(pattern.nodes)[-1].all_input_nodes)  # (an output is replaced, never kept)
    for n in pattern.nodes:
        if n.op == "call_function" and n.target in VIEW_OPS and n not in returned and all(
                a.op == "placeholder" or a in out for a in n.all_input_nodes):
            out.add(n)
    return out


class _Matcher(SubgraphMatcher):
    """``SubgraphMatcher`` that matches data flow only: a literal matches any literal (``_verify`` compares
    them against a trace at the region's own shapes), never a node, and a node never a literal.

    A view of the inputs alone (``_shareable``) may have readers outside the region and be in several regions:
    it is left out of the containment, cycle and overlap checks, which ``match`` therefore makes itself (the
    same checks as ``SubgraphMatcher.match``, on the region's own nodes). Kept in the cycle check, the one view
    that every layer reads after ``cse`` sits at the first layer and makes every later layer's region a cycle."""

    def __init__(self, pattern: torch.fx.Graph, **kw):
        super().__init__(pattern, **kw)
        self.shared = _shareable(pattern)

    def _match_literals(self, pn, gn, match) -> bool:
        return not _has_node(pn) and not _has_node(gn)

    def _own(self, m) -> list:
        return [gn for pn, gn in m.nodes_map.items() if pn.op not in ("placeholder", "output")
                and pn not in self.shared]

    def match(self, graph: torch.fx.Graph, node_name_match: str = "") -> list:
        from torch.fx.passes.utils.fuser_utils import validate_partition
        from torch.fx.passes.utils.matcher_utils import InternalMatch

        candidates = [(a, [n for n in graph.nodes if self._nodes_are_equal(a, n, node_name_match)])
                      for a in self.pattern_anchors]
        found: list = []

        def extend(i: int, m) -> None:  # every anchor bound to a candidate, each consistent with the others
            if i == len(candidates):
                m.placeholder_nodes = [m.nodes_map[pn] for pn in self.pattern_placeholder_nodes]
                m.returning_nodes = [m.nodes_map[pn] for pn in self.pattern_returning_nodes]
                found.append(m)
                return
            anchor, nodes = candidates[i]
            for gn in nodes:
                trial = copy.copy(m)
                if self._match_nodes(anchor, gn, trial, node_name_match):
                    extend(i + 1, trial)

        if candidates and all(nodes for _, nodes in candidates):
            extend(0, InternalMatch(anchors=self.pattern_anchors))
        kept, taken = [], set()
        for m in found:
            own = self._own(m)
            inside = set(own) | {gn for pn, gn in m.nodes_map.items() if pn in self.shared}
            leaks = any(u not in inside for pn, gn in m.nodes_map.items()
                        if pn.op != "placeholder" and pn not in self.pattern_returning_nodes and pn not in self.shared
                        for u in gn.users)
            if leaks or not validate_partition(own):
                continue  # a value computed inside is read outside, or the region would be a cycle if fused
            if self.remove_overlapping_matches:
                if set(own) & taken:
                    continue
                taken |= set(own)
            kept.append(m)
        return kept


# ---- rewrites --------------------------------------------------------------------------------------------

@dataclass
class Match:
    """One region of the graph that a rewrite's pattern matched, with what its check and params may read."""

    rewrite: "Rewrite"
    gm: torch.fx.GraphModule
    inputs: list                  # graph nodes bound to the pattern's tensor inputs, in order
    outputs: list                 # graph nodes bound to the pattern's outputs, in order
    nodes: list                   # every graph node of the region (inputs excluded)
    scalars: dict                 # scalar name -> value read off the graph
    extra: dict = field(default_factory=dict)  # what params() added (scalars, tensors) for the replacement
    shared: list = field(default_factory=list)  # views of the inputs the region read, kept if others read them

    def val(self, i: int):
        """The i-th input's example value (a fake tensor: shape, stride, dtype, device)."""
        return _val(self.inputs[i])

    def tensor(self, i: int) -> torch.Tensor | None:
        """The i-th input's real tensor when it is a weight or buffer of the graph (``get_attr``), else None."""
        n = self.inputs[i]
        if isinstance(n, torch.fx.Node) and n.op == "get_attr":
            obj = self.gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            return obj if isinstance(obj, torch.Tensor) else None
        return None

    def producer(self, i: int):
        """The node that computed the i-th input."""
        return self.inputs[i]


class Refused(Exception):
    """A rewrite's params() found the match unusable (reason in the message): the region stays in aten."""


@dataclass
class Rewrite:
    """One pattern and its replacement (see the module docstring).

    example(dtype) -> (tensors, scalars): inputs to trace the pattern at, scalars as sentinels (values that
        stand out among the pattern's other literals, so that the matcher finds where they are).
    check(match) -> None, or why this match must stay in aten (shapes, dtypes, weights, producers).
    params(match, ctx) -> dict of extra keyword arguments for the replacement: scalars, and tensors it adds
        to the graph through ``ctx.tensor`` (packed weights, counters). May raise Refused.
    exact: the replacement is bit-exact with the pattern on every device (else only within tolerance).
    fixed: scalars held at these values rather than read off the graph (``at_one``'s twins).
    into_readers(match) -> None: rewrites the region's readers before the replacement takes the region's place (a
        region moved into each of its readers: a norm into every reader's prologue, the replacement its input).
    """

    name: str
    pattern: Callable
    replacement: Callable
    example: Callable[[torch.dtype], tuple]
    region: str
    exact: bool = False
    check: Callable[[Match], str | None] | None = None
    params: Callable | None = None
    fixed: dict = field(default_factory=dict)
    into_readers: Callable[[Match], None] | None = None
    _traced: dict = field(default_factory=dict, repr=False)

    def pattern_graph(self, dtype: torch.dtype):
        """The pattern traced at its example with sentinels, its matcher, and where each sentinel stands."""
        hit = self._traced.get(dtype)
        if hit is not None:
            return hit
        tensors, scalars = self.example(dtype)
        scalars = {**scalars, **self.fixed}
        gm = trace(self.pattern, tensors, scalars)
        # numbers are sentinels, read off the graph where they stand; anything else (a dtype) is fixed
        fixed = {k: v for k, v in scalars.items()
                 if k in self.fixed or isinstance(v, bool) or not isinstance(v, (int, float))}
        scalars = {k: v for k, v in scalars.items() if k not in fixed}
        where: dict[str, list] = {k: [] for k in scalars}
        nodes = list(gm.graph.nodes)
        for i, pn in enumerate(nodes):
            if pn.op != "call_function":
                continue
            for path, v in _leaves(_all_args(pn)):
                for k, s in scalars.items():
                    if _same_literal(v, s) and not isinstance(v, torch.device):
                        where[k].append((i, path))
        missing = [k for k, w in where.items() if not w]
        if missing:
            raise RuntimeError(f"rewrite {self.name}: scalars {missing} appear nowhere in the traced pattern")
        matcher = _Matcher(gm.graph, match_output=False, match_placeholder=False, remove_overlapping_matches=True,
                           ignore_literals=False)
        hit = self._traced[dtype] = (gm, matcher, where, fixed)
        return hit


def at_one(rw: Rewrite, *names: str) -> Rewrite:
    """A twin of ``rw`` with the scalars ``names`` held at 1. ``canonicalize`` drops a product by one from the graph
    and from a pattern's trace alike, so a model whose scale is 1 (a rotary table's ``attention_scaling``) lacks the
    product that ``rw``'s trace at its sentinel has: the twin, traced at 1, matches it. List it after ``rw``."""
    return Rewrite(f"{rw.name}[{', '.join(names)} 1]", rw.pattern, rw.replacement, rw.example, rw.region, rw.exact,
                   rw.check, rw.params, {**rw.fixed, **{k: 1.0 for k in names}})


class Context:
    """What a rewrite's params() may add to the graph: tensors held by the graph module (``get_attr``)."""

    def __init__(self, gm: torch.fx.GraphModule, prefix: str = "_lowered", options: dict | None = None):
        self.gm, self.prefix = gm, prefix
        self.options = dict(options or {})  # the pass's settings the rewrites read (configs, pdl)
        self.added: list[torch.fx.Node] = []
        self.match: Match | None = None  # the match whose params() is running (the new tensors' provenance)
        self._shared: dict[Any, torch.fx.Node] = {}

    def tensor(self, hint: str, value: torch.Tensor, *, packed_from: list | None = None, share_key=None):
        """A get_attr node for ``value`` (one per ``share_key``: regions with the same key share the tensor).
        ``packed_from``: the get_attr nodes of the weights ``value`` packs row-wise (codegen rebuilds it from
        the model's own parameters at bind time instead of embedding it)."""
        if share_key is not None and share_key in self._shared:
            return self._shared[share_key]
        i = 0
        while hasattr(self.gm, f"{self.prefix}_{hint}_{i}"):
            i += 1
        name = f"{self.prefix}_{hint}_{i}"
        self.gm.register_buffer(name, value, persistent=False)
        first = next(iter(self.gm.graph.nodes))
        with self.gm.graph.inserting_before(first):
            node = self.gm.graph.get_attr(name)
        mode = _fake_mode(self.gm.graph)
        node.meta["val"] = mode.from_tensor(value) if mode is not None else value
        if packed_from is not None:
            node.meta["tkcc_packed_from"] = [n.target for n in packed_from]
            origin(node, *packed_from)
        elif self.match is not None:
            origin(node, *self.match.nodes)
        self.added.append(node)
        if share_key is not None:
            self._shared[share_key] = node
        return node


def _fake_mode(graph: torch.fx.Graph):
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    return detect_fake_mode(vals[:8]) if vals else None


@dataclass
class Outcome:
    matched: int = 0
    replaced: int = 0
    refused: dict = field(default_factory=dict)  # reason -> count
    new_nodes: dict = field(default_factory=dict)  # new node name -> names of the region's nodes
    refused_at: dict = field(default_factory=dict)  # reason -> the refused regions' graph nodes


def find(rewrite: Rewrite, gm: torch.fx.GraphModule, dtype: torch.dtype, at: dict | None = None) \
        -> tuple[list[Match], dict]:
    """Every match of ``rewrite`` in ``gm`` (verified literal by literal), and why candidates were refused
    (``at``, when given, gets each reason's regions' graph nodes)."""
    if not pattern_ops.ops(rewrite, dtype) <= pattern_ops.graph_ops(gm.graph):
        return [], {}  # an op of the pattern is not in the graph: no match, and no trace of the pattern
    pgm, matcher, where, fixed = rewrite.pattern_graph(dtype)
    pnodes = list(pgm.graph.nodes)
    out_node = pnodes[-1]
    p_outs = list(out_node.args[0]) if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    p_inputs = [n for n in pnodes if n.op == "placeholder"]
    refused: dict[str, int] = {}
    found = []
    for m in matcher.match(gm.graph):
        got = _verify(rewrite, m, pnodes, p_inputs, p_outs, where, fixed, gm, matcher.shared)
        if isinstance(got, str):
            refused[got] = refused.get(got, 0) + 1
            if at is not None:
                at.setdefault(got, set()).update(gn for pn, gn in m.nodes_map.items()
                                                 if pn.op not in ("placeholder", "output"))
            continue
        found.append(got)
    return found, refused


def _verify(rewrite, m, pnodes, p_inputs, p_outs, where, fixed, gm, shared=frozenset()):
    """A Match when the structural match ``m`` is exactly the pattern's program, else why not."""
    inputs = [m.nodes_map[p] for p in p_inputs]
    if not all(isinstance(n, torch.fx.Node) and isinstance(_val(n), torch.Tensor) for n in inputs):
        return "an input of the pattern is not a tensor of the graph"
    scalars = dict(fixed)
    for k in where:
        vals = []
        for i, path in where[k]:
            try:
                vals.append(_at(_all_args(m.nodes_map[pnodes[i]]), path))
            except KeyError:
                return f"scalar {k} is not where the pattern has it"
        if any(isinstance(v, torch.fx.Node) for v in vals) or any(not _same_literal(v, vals[0]) for v in vals):
            return f"scalar {k} differs between its uses ({vals})"
        scalars[k] = vals[0]
    try:
        again = trace(rewrite.pattern, tuple(_val(n) for n in inputs), scalars)
    except Exception as e:  # noqa: BLE001 - the pattern does not apply at these shapes: no match
        return f"the pattern does not trace at these shapes ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    qnodes = list(again.graph.nodes)
    if [(n.op, n.target) for n in qnodes if n.op != "placeholder"] != \
            [(n.op, n.target) for n in pnodes if n.op != "placeholder"] or len(qnodes) != len(pnodes):
        return "the pattern traces to other ops at these shapes"
    for pn, qn in zip(pnodes, qnodes):
        if pn.op != "call_function":
            continue
        gn = m.nodes_map[pn]
        ga, qa = _all_args(gn), _all_args(qn)
        if len(ga) != len(qa):
            return f"{gn.name}: {len(ga)} arguments, the pattern has {len(qa)}"
        for (path, qv) in _leaves(qa):
            try:
                gv = _at(ga, path)
            except KeyError:
                return f"{gn.name}: argument {path} is missing"
            if isinstance(qv, torch.fx.Node):
                twin = pnodes[qnodes.index(qv)]
                if gv is not m.nodes_map.get(twin):
                    return f"{gn.name}: argument {path} is not the pattern's"
            elif isinstance(gv, torch.fx.Node) or not _same_literal(qv, gv):
                return f"{gn.name}: argument {path} is {gv!r}, the pattern has {qv!r}"
    nodes = [m.nodes_map[p] for p in pnodes if p.op not in ("placeholder", "output") and p not in shared]
    outputs = [m.nodes_map[p] for p in p_outs]
    match = Match(rewrite, gm, inputs, outputs, nodes, scalars, shared=[m.nodes_map[p] for p in pnodes if p in shared])
    if rewrite.check is not None:
        why = rewrite.check(match)
        if why:
            return why
    return match


def apply(rewrite: Rewrite, gm: torch.fx.GraphModule, dtype: torch.dtype, ctx: Context | None = None,
          limit: int | None = None) -> Outcome:
    """Replace every match of ``rewrite`` in ``gm`` (to a fixpoint: a replacement can make a new match)."""
    ctx = ctx or Context(gm)
    res = Outcome()
    while True:
        at: dict = {}
        matches, refused = find(rewrite, gm, dtype, at)
        for k, v in refused.items():
            res.refused[k] = res.refused.get(k, 0) + v
            res.refused_at.setdefault(k, set()).update(at.get(k, ()))
        done = 0
        erased: set = set()
        for match in matches:
            if limit is not None and res.replaced >= limit:
                break
            if any(n in erased for n in match.inputs + match.nodes):
                continue  # an earlier replacement in this sweep changed this region: the next sweep sees it
            res.matched += 1
            ctx.match = match
            try:
                extra = rewrite.params(match, ctx) if rewrite.params is not None else {}
            except Refused as e:
                res.refused[str(e)] = res.refused.get(str(e), 0) + 1
                res.refused_at.setdefault(str(e), set()).update(match.nodes)
                continue
            match.extra = extra
            new = _replace(match, ctx)
            erased |= set(match.nodes)  # (a shared view another region still reads is not in it)
            res.replaced += 1
            done += 1
            for n in new:
                res.new_nodes[n.name] = [s for s in n.meta.get("tkcc_from", [])]
        if done:
            stable_toposort(gm.graph)
        if not done or (limit is not None and res.replaced >= limit):
            break
        # refused candidates are counted once per sweep they appear in; only the last sweep's stand
        res.refused = dict(refused)
        res.refused_at = {k: set(at.get(k, ())) for k in refused}
    return res


def _replace(match: Match, ctx: Context) -> list[torch.fx.Node]:
    """Inline the replacement's trace in place of the region; returns the new nodes."""
    rw, gm = match.rewrite, match.gm
    graph = gm.graph
    extra_t = {k: v for k, v in match.extra.items() if isinstance(v, torch.fx.Node)}
    extra_s = {k: v for k, v in match.extra.items() if not isinstance(v, torch.fx.Node)}
    tensors = [_val(n) for n in match.inputs] + [_val(v) for v in extra_t.values()]
    scalars = {**match.scalars, **extra_s}

    rgm = trace(_replacement_fn(rw, len(match.inputs), tuple(extra_t)), tuple(tensors), scalars)
    bound = list(match.inputs) + list(extra_t.values())
    env: dict[torch.fx.Node, Any] = {}
    ph = [n for n in rgm.graph.nodes if n.op == "placeholder"]
    for p, g in zip(ph, bound):
        env[p] = g
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max(bound, key=lambda n: order[n])
    first = min(match.nodes, key=lambda n: order[n])
    where = first if order[first] > order[anchor] else anchor.next
    new_nodes = []
    stack = common_stack(match.nodes)
    mode = _fake_mode(graph)
    outs = None
    with graph.inserting_before(where):
        for rn in rgm.graph.nodes:
            if rn.op == "placeholder":
                continue
            if rn.op == "output":
                outs = rn.args[0]
                continue
            if rn.op != "call_function":
                raise RuntimeError(f"rewrite {rw.name}: the replacement traced to a {rn.op} node")
            args = torch.fx.map_arg(rn.args, lambda a: env[a])
            kwargs = torch.fx.map_arg(rn.kwargs, lambda a: env[a])
            nn = graph.call_function(rn.target, args, kwargs)
            nn.meta["val"] = _fake_run(mode, rn.target, args, kwargs) if mode is not None else rn.meta.get("val")
            origin(nn, *match.nodes)
            nn.meta["tkcc_rewrite"] = rw.name
            if stack:
                nn.meta["nn_module_stack"] = dict(stack)
            env[rn] = nn
            new_nodes.append(nn)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if len(outs) != len(match.outputs):
        raise RuntimeError(f"rewrite {rw.name}: the replacement returns {len(outs)} values, the pattern "
                           f"{len(match.outputs)}")
    if rw.into_readers is not None:
        rw.into_readers(match)
    for old, new in zip(match.outputs, outs):
        old.replace_all_uses_with(env[new] if isinstance(new, torch.fx.Node) else new)
    for n in sorted(match.nodes + match.shared, key=lambda n: -order[n]):
        if not n.users:
            graph.erase_node(n)
    return new_nodes


_REPLACEMENTS: dict = {}


def _replacement_fn(rw: Rewrite, n: int, extra_names: tuple):
    """``rw.replacement`` with the tensors params() added passed positionally after the pattern's ``n``
    inputs: one function object per (rewrite, added tensors), so its traces are cached like the pattern's."""
    key = (id(rw), n, extra_names)
    fn = _REPLACEMENTS.get(key)
    if fn is None:
        def fn(*ts, **kw):
            return rw.replacement(*ts[:n], **dict(zip(extra_names, ts[n:])), **kw)

        fn.__qualname__ = f"{rw.name}.replacement"
        _REPLACEMENTS[key] = fn
    return fn


def common_stack(nodes) -> dict:
    """The module stack every node of the region shares (the innermost module holding all of it: a norm and the
    projection after it are in their decoder layer, not in the norm), so that passes that find regions by
    module never take a fused node for a piece of one module."""
    stacks = [list((n.meta.get("nn_module_stack") or {}).items()) for n in nodes if n.meta.get("nn_module_stack")]
    if not stacks:
        return {}
    common = []
    for items in zip(*stacks):
        if any(it != items[0] for it in items[1:]):
            break
        common.append(items[0])
    return dict(common)


def _fake_run(mode, target, args, kwargs):
    vals_a = torch.fx.map_arg(args, lambda a: a.meta.get("val"))
    vals_k = torch.fx.map_arg(kwargs, lambda a: a.meta.get("val"))
    if target is operator.getitem:
        return vals_a[0][vals_a[1]]
    with mode:
        return target(*vals_a, **vals_k)
