"""Shard one aten-level FX graph for one rank: slice the weights, fix the shapes, insert collectives.

How it works: seed placements on the weights a strategy splits (q/k/v and
gate/up column-parallel, lm_head by vocabulary, MoE experts inside each
expert or whole experts per rank), then walk the graph in order and give every
value a placement (see ``placement.py``). Each op either keeps the placement
it receives (pointwise ops, views, matmuls, attention), rewrites the head
counts in its shape arguments (``view``, ``expand``, ``split``), or, when it
cannot run on shards, gets its inputs materialised first: an all-gather for a
sharded value, an all-reduce for partial sums. Row-parallel weights follow
from their input: a matmul whose contraction dim is sharded takes the matching
slice of the weight and gives partial sums. The all-reduce is placed lazily,
at the first op that needs the full value (the residual add), so reshapes
and the MoE weighted sum run on partials.

A buffer that receives sharded data in place (the static KV cache) is sharded
too: the walk restarts with that buffer seeded. An op with no rule gets
materialised inputs, so an unknown op costs speed, never correctness.

Collectives are ``torch.ops._c10d_functional`` ops (all_reduce,
all_gather_into_tensor, wait_tensor) on the default process group: NCCL on
GPUs, gloo on CPU.
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from tkcc.errors import PassError
from tkcc.passes.sharding.placement import M, P, Placement, R, S

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# ops that only change dtype/aliasing/layout: every placement passes through
_IDENTITY = {
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.detach.default, aten.type_as.default, aten.to.device, aten.to.other,
    aten.lift_fresh_copy.default, aten.dropout.default,
}
_VIEW = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_FACTORY = {aten.zeros.default, aten.empty.memory_format, aten.full.default, aten.ones.default}
_MUTATE_INTO = {aten.index_copy_.default, aten.index_copy.default, aten.copy_.default, aten.index_put_.default,
                aten.index_put.default, aten.slice_scatter.default}
_PARTIAL_LINEAR_BINARY = {aten.add.Tensor, aten.sub.Tensor}
_PARTIAL_SCALE = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.neg.default}
_NO_OUTPUT = {aten._assert_tensor_metadata.default}

COL_LINEAR = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
ROW_LINEAR = ("o_proj", "down_proj", "w2")
EXPERT_COL = ("gate_up_proj", "up_proj", "gate_proj")
EXPERT_ROW = ("down_proj",)


class _Restart(Exception):
    def __init__(self, seeds: dict[str, Placement]):
        self.seeds = seeds


@dataclass
class ShardContext:
    """What a rank needs to shard graphs; ``shards`` is shared by every phase so
    prefill and decode use one copy of each slice (and one KV cache)."""

    rank: int
    world: int
    strategy: str
    group_name: str
    expert_intermediate: int = 0
    output_weight: object = None  # the model's lm_head tensor (vocab-parallel)
    shards: dict = field(default_factory=dict)  # (id(t), dim, blocks, scale) -> (t, shard)
    collectives: list = field(default_factory=list)  # (phase, kind, node name)
    sharded_attrs: dict = field(default_factory=dict)  # new attr -> (orig target, placement)

    def shard(self, t: torch.Tensor, dim: int, blocks: int = 1, scale: float = 1.0) -> torch.Tensor:
        key = (id(t), dim, blocks, scale)
        hit = self.shards.get(key)
        if hit is not None:
            return hit[1]
        n = t.shape[dim]
        if n % (self.world * blocks):
            raise PassError(f"cannot shard a tensor of shape {tuple(t.shape)} on dim {dim} into "
                            f"{self.world} x {blocks} blocks")
        bl = n // blocks
        per = bl // self.world
        pieces = [t.narrow(dim, b * bl + self.rank * per, per) for b in range(blocks)]
        out = pieces[0] if blocks == 1 else torch.cat(pieces, dim)
        if dim != 0 or blocks != 1:
            out = out.contiguous()  # a row slice is strided; matmuls want it dense (a copy: see docs)
        if scale != 1.0:
            out = out * scale
        self.shards[key] = (t, out)
        return out


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _shape(node) -> list[int] | None:
    v = _val(node)
    if not isinstance(v, torch.Tensor):
        return None
    out = []
    for s in v.shape:
        try:
            out.append(int(s))
        except Exception:  # symbolic: use its hint, good enough to group dims
            out.append(int(s.node.hint) if getattr(s.node, "hint", None) is not None else -1)
    return out


def _ndim(node) -> int:
    v = _val(node)
    return v.dim() if isinstance(v, torch.Tensor) else 0


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def view_groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]] | None:
    """Group dims of two shapes with equal products: [(in dims, out dims)], or None."""
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i); pa *= a[i]; i += 1  # noqa: E702
            elif pb < pa and j < len(b):
                gj.append(j); pb *= b[j]; j += 1  # noqa: E702
            else:
                return None
        groups.append((gi, gj))
    while i < len(a):
        if a[i] != 1 or not groups:
            return None
        groups[-1][0].append(i); i += 1  # noqa: E702
    while j < len(b):
        if b[j] != 1 or not groups:
            return None
        groups[-1][1].append(j); j += 1  # noqa: E702
    return groups


class GraphSharder:
    """Shards one GraphModule for ``ctx.rank``. Use :func:`shard_graph_module`."""

    def __init__(self, gm: fx.GraphModule, ctx: ShardContext, phase: str, seeds: dict[str, Placement]):
        self.src, self.ctx, self.phase, self.seeds = gm, ctx, phase, seeds
        self.d = ctx.world
        memo = {id(t): t for t in list(gm.parameters()) + list(gm.buffers())}
        for name, v in vars(gm).items():
            if isinstance(v, torch.Tensor):
                memo[id(v)] = v
        self.gm = copy.deepcopy(gm, memo)
        self.g = self.gm.graph
        self.env: dict[fx.Node, object] = {}
        self.materialized: dict[tuple, fx.Node] = {}
        self.attr_nodes: dict[tuple, fx.Node] = {}
        self.ep_masks: dict[fx.Node, tuple] = {}
        self.holder = torch.nn.Module()
        self.gm.add_submodule("_tp", self.holder)
        self.matched = 0
        self.pending: dict[str, Placement] = {}  # buffers found to need sharding: restart with them seeded
        self.collectives: list = []

    # ---------- helpers that add nodes ----------
    def _call(self, before: fx.Node, target, args, kwargs=None) -> fx.Node:
        with self.g.inserting_before(before):
            return self.g.call_function(target, tuple(args), kwargs or {})

    def _tensor_of(self, node: fx.Node) -> torch.Tensor:
        obj = self.gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return obj

    def sharded_attr(self, attr: fx.Node, before: fx.Node, pl: Placement, scale: float = 1.0) -> fx.Node:
        """A get_attr node for this rank's slice of ``attr``'s tensor (one per tensor and placement)."""
        key = (attr, pl.dim, pl.blocks, scale)
        hit = self.attr_nodes.get(key)
        if hit is not None:
            return hit
        t = self._tensor_of(attr)
        shard = self.ctx.shard(t, pl.dim, pl.blocks, scale)
        name = f"{attr.target.replace('.', '_')}__s{pl.dim}b{pl.blocks}" + ("_scaled" if scale != 1.0 else "")
        if not hasattr(self.holder, name):
            self.holder.register_buffer(name, shard, persistent=False)
        self.ctx.sharded_attrs[f"_tp.{name}"] = (attr.target, repr(pl))
        first = next(iter(self.g.nodes))
        with self.g.inserting_before(first if first.op != "placeholder" else self._after_placeholders()):
            node = self.g.get_attr(f"_tp.{name}")
        v = _val(attr)
        if isinstance(v, torch.Tensor):
            node.meta["val"] = v  # full logical shape: rules reason about logical shapes
        self.attr_nodes[key] = node
        self.env[node] = pl
        return node

    def _after_placeholders(self) -> fx.Node:
        for n in self.g.nodes:
            if n.op != "placeholder":
                return n
        return self.g.output_node()

    def all_reduce(self, x: fx.Node, before: fx.Node) -> fx.Node:
        r = self._call(before, c10d.all_reduce.default, [x, "sum", self.ctx.group_name])
        self.collectives.append((self.phase, "all_reduce", r.name))
        return self._call(before, c10d.wait_tensor.default, [r])

    def all_gather(self, x: fx.Node, pl: Placement, logical: fx.Node, before: fx.Node) -> fx.Node:
        shape = _shape(logical)
        nd = len(shape)
        k = pl.dim
        perm = [k] + [i for i in range(nd) if i != k]
        y = x
        if k != 0:
            y = self._call(before, aten.permute.default, [y, perm])
        y = self._call(before, aten.clone.default, [y], {"memory_format": torch.contiguous_format})
        g = self._call(before, c10d.all_gather_into_tensor.default, [y, self.d, self.ctx.group_name])
        self.collectives.append((self.phase, "all_gather", g.name))
        g = self._call(before, c10d.wait_tensor.default, [g])
        if pl.blocks > 1:
            rest = [shape[i] for i in perm[1:]]
            n = shape[k]
            g = self._call(before, aten.view.default, [g, [self.d, pl.blocks, n // (self.d * pl.blocks)] + rest])
            g = self._call(before, aten.transpose.int, [g, 0, 1])
            g = self._call(before, aten.reshape.default, [g, [n] + rest])
        if k != 0:
            inv = [perm.index(i) for i in range(nd)]
            g = self._call(before, aten.permute.default, [g, inv])
        return g

    def apply_mask(self, x: fx.Node, pl: Placement, logical: fx.Node, before: fx.Node) -> fx.Node:
        nd = _ndim(logical)
        dtype = _val(logical).dtype
        mf = self._call(before, aten.to.dtype, [pl.mask, dtype])
        if nd > 1:
            mf = self._call(before, aten.view.default, [mf, [-1] + [1] * (nd - 1)])
        return self._call(before, aten.mul.Tensor, [x, mf])

    def to_partial(self, arg: fx.Node, user: fx.Node) -> None:
        """Turn an M (masked rows) input of ``user`` into P."""
        pl = self.env[arg]
        key = (arg, "P")
        new = self.materialized.get(key)
        if new is None:
            new = self.apply_mask(arg, pl, arg, user)
            self.materialized[key] = new
            self.env[new] = P
            new.meta["val"] = _val(arg)
        user.replace_input_with(arg, new)

    def materialize(self, arg: fx.Node, user: fx.Node) -> None:
        """Replace ``arg`` in ``user`` by its replicated value (collective inserted before ``user``)."""
        pl = self.env.get(arg, R)
        if pl.kind == "R":
            return
        key = (arg, "R")
        new = self.materialized.get(key)
        if new is None:
            x = arg
            if pl.kind == "M":
                x = self.apply_mask(x, pl, arg, user)
                new = self.all_reduce(x, user)
            elif pl.kind == "P":
                new = self.all_reduce(x, user)
            else:
                new = self.all_gather(x, pl, arg, user)
            new.meta["val"] = _val(arg)
            self.env[new] = R
            self.materialized[key] = new
        user.replace_input_with(arg, new)

    def materialize_all(self, n: fx.Node) -> Placement:
        for a in list(n.all_input_nodes):
            self.materialize(a, n)
        return R

    # ---------- the walk ----------
    def run(self) -> fx.GraphModule:
        for n in list(self.g.nodes):
            if n.op == "placeholder":
                self.env[n] = R
            elif n.op == "get_attr":
                seed = self.seeds.get(n.name)
                if seed is not None and seed.kind == "S":
                    new = self.sharded_attr(n, n, seed)
                    n.replace_all_uses_with(new)
                    self.env[n] = R
                else:
                    self.env[n] = R
            elif n.op == "output":
                for a in list(n.all_input_nodes):
                    self.materialize(a, n)
            elif n.op == "call_function":
                self.env[n] = self.visit(n)
            else:  # call_module / call_method: no rule, run on full values
                self.env[n] = self.materialize_all(n)
        if self.pending:
            raise _Restart(self.pending)
        self.batch_small_all_reduces()
        for n in list(self.g.nodes):
            if n.op == "get_attr" and not n.users and not n.target.startswith("_tp."):
                self.g.erase_node(n)
        self.g.lint()
        self.gm.recompile()
        return self.gm

    def batch_small_all_reduces(self, max_elems: int = 1 << 16) -> None:
        """Merge consecutive independent all-reduces of equal small shapes into one (stack, reduce, select).

        OLMoE's q and k RMSNorms each need a sum over the full width: two
        latency-bound all-reduces per layer become one. The producer chain
        of the second is moved before the first when it does not depend on it.
        """
        ars = [n for n in self.g.nodes if n.target is c10d.all_reduce.default]
        i = 0
        while i + 1 < len(ars):
            a, b = ars[i], ars[i + 1]
            va, vb = _val(a.args[0]), _val(b.args[0])
            small = all(isinstance(v, torch.Tensor) and v.numel() <= max_elems if not any(
                isinstance(x, torch.SymInt) for x in v.shape) else isinstance(v, torch.Tensor) for v in (va, vb))
            same = isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and \
                [str(x) for x in va.shape] == [str(x) for x in vb.shape]
            if not (small and same) or self._depends_on(b.args[0], a):
                i += 1
                continue
            order = {n: k for k, n in enumerate(self.g.nodes)}
            anc = self._ancestors_after(b.args[0], order[a], order)
            if any(getattr(getattr(n.target, "_schema", None), "is_mutable", False) for n in anc):
                i += 1
                continue  # never move a write
            for n in sorted(anc, key=order.get):
                a.prepend(n)
            wa, wb = next(iter(a.users)), next(iter(b.users))
            st = self._call(a, aten.stack.default, [[a.args[0], b.args[0]]])
            ar = self._call(a, c10d.all_reduce.default, [st, "sum", self.ctx.group_name])
            w = self._call(a, c10d.wait_tensor.default, [ar])
            sa = self._call(a, aten.select.int, [w, 0, 0])
            sb = self._call(a, aten.select.int, [w, 0, 1])
            wa.replace_all_uses_with(sa)
            wb.replace_all_uses_with(sb)
            for n in (wb, b, wa, a):
                self.g.erase_node(n)
            self.collectives = [c for c in self.collectives if c[2] not in (a.name, b.name)] + \
                [(self.phase, "all_reduce", ar.name)]
            ars = [n for n in self.g.nodes if n.target is c10d.all_reduce.default]
            i += 1

    @staticmethod
    def _depends_on(node, target) -> bool:
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n is target:
                return True
            if n in seen or not isinstance(n, fx.Node):
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        return False

    @staticmethod
    def _ancestors_after(node, pos: int, order) -> set:
        out, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in out or order[n] <= pos:
                continue
            out.add(n)
            stack.extend(n.all_input_nodes)
        return out

    def visit(self, n: fx.Node):
        ins = {a: self.env.get(a, R) for a in n.all_input_nodes}
        t = n.target
        if all(p.kind == "R" for p in ins.values() if isinstance(p, Placement)) and \
                not any(isinstance(p, tuple) for p in ins.values()):
            if t in (aten.linear.default,):
                return self._linear(n)
            if t is aten.index.Tensor:
                return self._index(n)
            if t in _FACTORY and n.name in self.seeds:
                return self._factory(n)
            return R
        if t is operator.getitem:
            src = n.args[0]
            pls = self.env.get(src)
            if isinstance(pls, tuple):
                return pls[n.args[1]]
            return R if pls is None or pls == R else self.materialize_all(n)
        if t in _NO_OUTPUT:
            return R
        if t in _IDENTITY:
            return ins[n.args[0]] if n.args and isinstance(n.args[0], fx.Node) else R
        if t is aten.linear.default:
            return self._linear(n)
        if t in (aten.bmm.default, aten.mm.default, aten.matmul.default):
            return self._matmul(n)
        if t in _VIEW:
            return self._view(n)
        if t is aten.expand.default:
            return self._expand(n)
        if t in (aten.transpose.int, aten.permute.default, aten.t.default, aten.unsqueeze.default,
                 aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            return self._dims_move(n)
        if t in (aten.slice.Tensor, aten.select.int, aten.narrow.default):
            return self._slice(n)
        if t is aten.cat.default:
            return self._cat(n)
        if t in (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default):
            return self._split(n)
        if t in (aten.sum.dim_IntList, aten.mean.dim):
            return self._reduce(n)
        if t is aten.scaled_dot_product_attention.default:
            return self._sdpa(n)
        if t is aten.index.Tensor:
            return self._index(n)
        if t in _MUTATE_INTO:
            return self._mutate(n)
        if t is aten.repeat_interleave.self_int:
            return self._repeat_interleave(n)
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            return self._pointwise(n)
        return self.materialize_all(n)

    # ---------- rules ----------
    def _is_output_weight(self, n) -> bool:
        w = n.args[1] if len(n.args) > 1 else None
        if not (isinstance(w, fx.Node) and w.op == "get_attr") or self.ctx.output_weight is None:
            return False
        try:
            return self._tensor_of(w) is self.ctx.output_weight
        except AttributeError:
            return False

    def _weight_kind(self, w) -> str | None:
        if not (isinstance(w, fx.Node) and w.op == "get_attr"):
            return None
        parts = w.target.split(".")
        if len(parts) < 2:
            return None
        mod, leaf = parts[-2], parts[-1]
        if mod == "experts":
            if leaf in EXPERT_COL:
                return "expert_col"
            if leaf in EXPERT_ROW:
                return "expert_row"
            return None
        if leaf not in ("weight", "bias"):
            return None
        if mod in COL_LINEAR:
            return "col_" + leaf
        if mod in ROW_LINEAR:
            return "row_" + leaf
        return None

    def _linear(self, n):
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        px = self.env.get(x, R)
        if px.kind == "P":
            self.materialize(x, n)
            px = R
        nd = _ndim(x)
        if px.kind == "S" and px.dim == nd - 1:
            if self.env.get(w, R).kind != "R" or not (isinstance(w, fx.Node) and w.op == "get_attr"):
                return self.materialize_all(n)
            n.replace_input_with(w, self.sharded_attr(w, n, S(1, px.blocks)))
            if isinstance(b, fx.Node):  # each rank adds bias/world; the all-reduce sums to bias
                n.replace_input_with(b, self._scaled_bias(b, n))
            self.matched += 1
            return P
        if px.kind in ("S", "M"):
            if self.env.get(w, R).kind != "R" or (isinstance(b, fx.Node) and self.env.get(b, R).kind != "R"):
                return self.materialize_all(n)
            return px if px.kind == "M" else S(px.dim)
        kind = self._weight_kind(w)
        if self._is_output_weight(n) or (kind or "").startswith("col_"):
            out_dim = _shape(w)[0]
            if out_dim % self.d:
                return R
            n.replace_input_with(w, self.sharded_attr(w, n, S(0)))
            if isinstance(b, fx.Node):
                n.replace_input_with(b, self.sharded_attr(b, n, S(0)))
            self.matched += 1
            return S(nd - 1)
        return R

    def _scaled_bias(self, b, n):
        key = (b, "scaled")
        hit = self.attr_nodes.get(key)
        if hit is None:
            t = self._tensor_of(b)
            name = f"{b.target.replace('.', '_')}__div{self.d}"
            self.holder.register_buffer(name, t / self.d, persistent=False)
            with self.g.inserting_before(n):
                hit = self.g.get_attr(f"_tp.{name}")
            hit.meta["val"] = _val(b)
            self.attr_nodes[key] = hit
            self.env[hit] = R
        return hit

    def _matmul(self, n):
        a, b = n.args[0], n.args[1]
        pa, pb = self.env.get(a, R), self.env.get(b, R)
        if pa.kind == "P" and pb.kind == "R":
            return P
        if pb.kind == "P" and pa.kind == "R":
            return P
        for x, p in ((a, pa), (b, pb)):
            if p.kind == "P":
                self.materialize(x, n)
        pa, pb = self.env.get(n.args[0], R), self.env.get(n.args[1], R)
        na, nb = _ndim(n.args[0]), _ndim(n.args[1])
        if pa.kind == "M" or pb.kind == "M":
            if n.target is aten.bmm.default and all(p.kind in ("M", "R") for p in (pa, pb)):
                masks = {p.mask for p in (pa, pb) if p.kind == "M"}
                if len(masks) == 1:
                    return pa if pa.kind == "M" else pb
            if n.target is aten.mm.default and pa.kind == "M" and pb.kind == "R":
                return pa
            for x in (n.args[0], n.args[1]):
                if self.env.get(x, R).kind == "M":
                    self.to_partial(x, n)
            return self._matmul(n)
        ka, kb = na - 1, nb - 2  # contraction dims
        if pa.kind == "S" and pb.kind == "S" and pa.dim == ka and pb.dim == kb and pa.blocks == pb.blocks:
            return P
        if pa.kind == "S" and pb.kind == "R" and pa.dim != ka:
            return S(pa.dim + (max(na, nb) - na), pa.blocks)
        if pb.kind == "S" and pa.kind == "R" and pb.dim == nb - 1:
            return S(max(na, nb) - 1, pb.blocks)
        if pa.kind == "S" and pb.kind == "S" and pa.dim == pb.dim == 0 and na == nb == 3:
            return S(0)
        return self.materialize_all(n)

    def _view(self, n):
        x = n.args[0]
        px = self.env.get(x, R)
        if px.kind == "P":
            return P
        ins, outs = _shape(x), _shape(n)
        groups = view_groups(ins, outs) if ins is not None and outs is not None else None
        if px.kind == "M":
            if groups and groups[0][0][:1] == [0] and groups[0][1][:1] == [0] and ins[0] == outs[0]:
                return px
            self.to_partial(x, n)
            return P
        if groups is None:
            return self.materialize_all(n)
        k = px.dim
        for gi, gj in groups:
            if k not in gi:
                continue
            lead_in = [i for i in gi if ins[i] != 1]
            if not lead_in or lead_in[0] != k:
                return self.materialize_all(n)
            if px.blocks > 1 and len([j for j in gj if outs[j] != 1]) != 1:
                return self.materialize_all(n)
            cand = [j for j in gj if outs[j] != 1]
            if not cand or outs[cand[0]] % (self.d * px.blocks):
                return self.materialize_all(n)
            j = cand[0]
            size = list(n.args[1])
            if isinstance(size[j], fx.Node):
                return self.materialize_all(n)
            if size[j] != -1:
                size[j] = size[j] // self.d
            n.args = (n.args[0], size) + tuple(n.args[2:])
            return S(j, px.blocks)
        return self.materialize_all(n)

    def _expand(self, n):
        x = n.args[0]
        px = self.env.get(x, R)
        if px.kind != "S":
            return self.materialize_all(n)
        nd_out, nd_in = _ndim(n), _ndim(x)
        j = px.dim + (nd_out - nd_in)
        size = list(n.args[1])
        if isinstance(size[j], fx.Node):
            return self.materialize_all(n)
        if size[j] != -1:
            size[j] = size[j] // self.d
        n.args = (x, size) + tuple(n.args[2:])
        return S(j, px.blocks)

    def _dims_move(self, n):
        x = n.args[0]
        px = self.env.get(x, R)
        t = n.target
        nd_in = _ndim(x)
        if px.kind == "P":
            return P
        if px.kind == "M":
            touches0 = (t is aten.transpose.int and 0 in {_norm_dim(n.args[1], nd_in), _norm_dim(n.args[2], nd_in)}) \
                or (t is aten.permute.default and _norm_dim(n.args[1][0], nd_in) != 0) \
                or (t is aten.t.default) \
                or (t is aten.unsqueeze.default and _norm_dim(n.args[1], nd_in + 1) == 0) \
                or (t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default))
            if not touches0:
                return px
            if t in (aten.squeeze.dim,) and _norm_dim(n.args[1], nd_in) != 0:
                return px
            self.to_partial(x, n)
            return P
        k = px.dim
        if t is aten.transpose.int:
            d0, d1 = _norm_dim(n.args[1], nd_in), _norm_dim(n.args[2], nd_in)
            return S(d1 if k == d0 else d0 if k == d1 else k, px.blocks)
        if t is aten.t.default:
            return S(1 - k, px.blocks) if nd_in == 2 else px
        if t is aten.permute.default:
            perm = [_norm_dim(p, nd_in) for p in n.args[1]]
            return S(perm.index(k), px.blocks)
        if t is aten.unsqueeze.default:
            u = _norm_dim(n.args[1], nd_in + 1)
            return S(k + 1 if u <= k else k, px.blocks)
        # squeeze: count removed dims before k (shapes from meta)
        ins = _shape(x)
        if t is aten.squeeze.default:
            removed = [i for i, s in enumerate(ins) if s == 1]
        elif t is aten.squeeze.dim:
            dd = _norm_dim(n.args[1], nd_in)
            removed = [dd] if ins[dd] == 1 else []
        else:
            removed = [_norm_dim(dd, nd_in) for dd in n.args[1] if ins[_norm_dim(dd, nd_in)] == 1]
        if k in removed:
            return self.materialize_all(n)
        return S(k - sum(1 for i in removed if i < k), px.blocks)

    def _slice(self, n):
        x = n.args[0]
        px = self.env.get(x, R)
        nd = _ndim(x)
        t = n.target
        dim = _norm_dim(n.args[1] if len(n.args) > 1 else 0, nd)
        if px.kind == "P":
            return P
        if px.kind == "M":
            if dim != 0:
                return px
            self.to_partial(x, n)
            return P
        if dim == px.dim:
            ins, outs = _shape(x), _shape(n)
            if t is aten.slice.Tensor and ins is not None and outs == ins:
                return px  # a full slice
            return self.materialize_all(n)
        if t is aten.select.int:
            return S(px.dim - (1 if dim < px.dim else 0), px.blocks)
        return px

    def _cat(self, n):
        xs = n.args[0]
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        pls = [self.env.get(x, R) for x in xs]
        nd = _ndim(n)
        dim = _norm_dim(dim, nd)
        if all(p.kind == "S" for p in pls) and len({(p.dim, p.blocks) for p in pls}) == 1 and pls[0].dim != dim:
            return pls[0]
        if all(p.kind == "P" for p in pls):
            return P
        return self.materialize_all(n)

    def _split(self, n):
        x = n.args[0]
        px = self.env.get(x, R)
        t = n.target
        nd = _ndim(x)
        outs = _val(n)
        count = len(outs) if isinstance(outs, (list, tuple)) else 0
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
        dim = _norm_dim(dim, nd)
        if px.kind == "P":
            return tuple([P] * count)
        if px.kind == "M":
            if dim != 0:
                return tuple([px] * count)
            self.to_partial(x, n)
            return tuple([P] * count)
        if dim != px.dim:
            return tuple([px] * count)
        if t is aten.chunk.default and n.args[1] == px.blocks:
            return tuple([S(dim)] * count)
        if t is aten.split.Tensor and count == px.blocks and _shape(x)[dim] == n.args[1] * count:
            n.args = (x, n.args[1] // self.d) + tuple(n.args[2:])
            return tuple([S(dim)] * count)
        self.materialize_all(n)
        return tuple([R] * count)

    def _reduce(self, n):
        x = n.args[0]
        px = self.env.get(x, R)
        nd = _ndim(x)
        dims = n.args[1] if len(n.args) > 1 else None
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        red = list(range(nd)) if not dims else [_norm_dim(d, nd) for d in dims]
        if px.kind == "P":
            return P
        if px.kind == "M":
            if 0 not in red:
                return px
            self.to_partial(x, n)
            return P
        k = px.dim
        if k in red:
            if px.blocks > 1:
                return self.materialize_all(n)
            if n.target is aten.mean.dim:
                # the local mean over n/d elements, summed over d ranks, is d times the mean
                with self.g.inserting_after(n):
                    scaled = self.g.call_function(aten.mul.Tensor, (n, 1.0 / self.d))
                n.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
                scaled.meta["val"] = _val(n)
                self.env[scaled] = P
            self.matched += 1
            return P
        return S(k if keep else k - sum(1 for r in red if r < k), px.blocks)

    def _sdpa(self, n):
        q, k, v = n.args[:3]
        pls = [self.env.get(a, R) for a in (q, k, v)]
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        mask_ok = not isinstance(mask, fx.Node) or (self.env.get(mask, R).kind == "R" and
                                                     (_shape(mask) is None or len(_shape(mask)) < 3 or
                                                      _shape(mask)[-3] == 1))
        if all(p.kind == "S" and p.dim == 1 and p.blocks == 1 for p in pls) and mask_ok:
            return S(1)
        return self.materialize_all(n)

    def _index(self, n):
        w, idx = n.args[0], n.args[1]
        pw = self.env.get(w, R)
        if len(idx) != 1 or not isinstance(idx[0], fx.Node):
            return self.materialize_all(n)
        ids = idx[0]
        pi = self.env.get(ids, R)
        if pi.kind != "R":
            self.materialize(ids, n)
        kind = self._weight_kind(w)
        if pw.kind == "R" and kind in ("expert_col", "expert_row"):
            shape = _shape(w)
            inter = self.ctx.expert_intermediate
            if self.ctx.strategy == "tp_ep":
                return self._ep_index(n, w, ids, shape[0])
            transposed = self._experts_transposed(w)
            if kind == "expert_col":  # [E, out, in] (or [E, in, out] when transposed)
                dim = 2 if transposed else 1
                blocks = 2 if shape[dim] == 2 * inter else 1
            else:
                dim = 1 if transposed else 2
                blocks = 1
            if shape[dim] != blocks * inter:
                return self.materialize_all(n)
            n.replace_input_with(w, self.sharded_attr(w, n, S(dim, blocks)))
            self.matched += 1
            return S(dim + _ndim(ids) - 1, blocks)
        if pw.kind == "R":
            return R
        if pw.kind == "P":
            return P
        if pw.kind == "S" and pw.dim >= 1:
            return S(pw.dim + _ndim(ids) - 1, pw.blocks)
        if pw.kind == "M":
            self.to_partial(w, n)
            return P
        return self.materialize_all(n)

    def _experts_transposed(self, w) -> bool:
        obj = self.gm
        for part in w.target.split(".")[:-1]:
            obj = getattr(obj, part, None)
        return bool(getattr(obj, "is_transposed", False))

    def _ep_index(self, n, w, ids, experts):
        """Whole experts per rank: global ids -> local ids, and a mask of pairs this rank owns."""
        per = experts // self.d
        hit = self.ep_masks.get(ids)
        if hit is None:
            before = n
            local = self._call(before, aten.sub.Tensor, [ids, self.ctx.rank * per])
            ge = self._call(before, aten.ge.Scalar, [local, 0])
            lt = self._call(before, aten.lt.Scalar, [local, per])
            mask = self._call(before, aten.logical_and.default, [ge, lt])
            clamped = self._call(before, aten.clamp.default, [local, 0, per - 1])
            hit = (mask, clamped)
            self.ep_masks[ids] = hit
        mask, clamped = hit
        n.replace_input_with(ids, clamped)
        n.replace_input_with(w, self.sharded_attr(w, n, S(0)))
        self.matched += 1
        return M(mask)

    def _mutate(self, n):
        dst = n.args[0]
        src = n.args[3] if n.target in (aten.index_copy_.default, aten.index_copy.default) else \
            n.args[2] if n.target in (aten.index_put_.default, aten.index_put.default) else n.args[1]
        pd, ps = self.env.get(dst, R), self.env.get(src, R) if isinstance(src, fx.Node) else R
        if ps.kind in ("P", "M"):
            self.materialize(src, n)
            ps = R
        if pd == ps:
            return pd
        if pd.kind == "R" and ps.kind == "S":
            origin = self._origin(dst)
            if origin is not None and origin.name not in self.seeds:
                self.pending[origin.name] = S(ps.dim, ps.blocks)
                return ps  # carry on as if it were sharded; the walk restarts with the buffer seeded
        if pd.kind == "S" and ps.kind == "R" and n.target in (aten.index_copy_.default, aten.index_copy.default):
            # a replicated source written into a sharded buffer: write this rank's slice
            if isinstance(src, fx.Node):
                sl = self._local_slice(src, pd, n)
                n.replace_input_with(src, sl)
                return pd
        raise PassError(f"sharding: cannot write a value placed {ps} into a buffer placed {pd} at node "
                        f"{n.name} ({n.target}); the buffer is {dst.name}")

    def _local_slice(self, src, pl, before):
        shape = _shape(src)
        per = shape[pl.dim] // self.d
        return self._call(before, aten.slice.Tensor, [src, pl.dim, self.ctx.rank * per, (self.ctx.rank + 1) * per])

    def _origin(self, node):
        while isinstance(node, fx.Node):
            if node.op == "get_attr" or node.target in _FACTORY:
                return node
            if node.target in _MUTATE_INTO or node.target in _IDENTITY:
                node = node.args[0]
                continue
            return None
        return None

    def _factory(self, n):
        pl = self.seeds[n.name]
        size = list(n.args[0])
        size[pl.dim] = size[pl.dim] // self.d
        n.args = (size,) + tuple(n.args[1:])
        return pl

    def _repeat_interleave(self, n):
        x = n.args[0]
        px = self.env.get(x, R)
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        if dim is None:
            return self.materialize_all(n)
        dim = _norm_dim(dim, _ndim(x))
        if px.kind == "S" and px.dim != dim:
            return px
        if px.kind == "P":
            return P
        return self.materialize_all(n)

    def _pointwise(self, n):
        t = n.target
        nd = _ndim(n)
        tensor_args = [a for a in n.args if isinstance(a, fx.Node)] + \
                      [a for a in n.kwargs.values() if isinstance(a, fx.Node)]
        pls = {a: self.env.get(a, R) for a in tensor_args}
        kinds = {p.kind for p in pls.values()}
        if "P" in kinds:
            if kinds <= {"P"} and t in _PARTIAL_LINEAR_BINARY and all(isinstance(a, fx.Node) for a in n.args[:2]):
                return P
            if t in _PARTIAL_SCALE:
                parts = [a for a in tensor_args if pls[a].kind == "P"]
                if len(parts) == 1 and kinds <= {"P", "R"} and (t is not aten.div.Tensor or n.args[0] is parts[0]):
                    return P
            for a in tensor_args:
                if pls[a].kind == "P":
                    self.materialize(a, n)
            return self._pointwise(n)
        if "M" in kinds:
            masks = {p.mask for p in pls.values() if p.kind == "M"}
            ok = len(masks) == 1 and kinds <= {"M", "R"} and \
                all(_ndim(a) == nd for a in tensor_args if pls[a].kind == "M")
            if ok:
                return next(p for p in pls.values() if p.kind == "M")
            for a in tensor_args:
                if pls[a].kind == "M":
                    self.to_partial(a, n)
            return self._pointwise(n)
        if "S" not in kinds:
            return R
        out_dims = {(p.dim + nd - _ndim(a), p.blocks) for a, p in pls.items() if p.kind == "S"}
        if len(out_dims) != 1:
            return self.materialize_all(n)
        j, blocks = out_dims.pop()
        full = _shape(n)[j]
        for a, p in pls.items():
            if p.kind != "R":
                continue
            aj = j - (nd - _ndim(a))
            if aj < 0 or _shape(a)[aj] == 1:
                continue  # broadcasts along the sharded dim
            if a.op == "get_attr" and _shape(a)[aj] == full:
                n.replace_input_with(a, self.sharded_attr(a, n, S(aj, blocks)))
                continue
            return self.materialize_all(n)
        return S(j, blocks)


def shard_graph_module(gm: fx.GraphModule, ctx: ShardContext, phase: str = "forward",
                       max_restarts: int = 8) -> tuple[fx.GraphModule, int]:
    """This rank's version of ``gm``: sliced weights, fixed shapes, collectives. Returns (gm, ops matched)."""
    seeds: dict[str, Placement] = {}
    for _ in range(max_restarts):
        sharder = GraphSharder(gm, ctx, phase, seeds)
        try:
            out = sharder.run()
        except _Restart as r:
            seeds.update(r.seeds)
            continue
        ctx.collectives.extend(sharder.collectives)
        return out, sharder.matched
    raise PassError(f"sharding {phase}: placements did not settle after {max_restarts} restarts")
