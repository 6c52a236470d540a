"""Tensor-parallel sharding: one rank's slice of every phase graph, collectives in the graph.

Params: ``degree`` (ranks the model is split over) and ``strategy``:

- ``tp``: attention by heads (q/k/v column-parallel, o row-parallel), dense
  MLP column then row, MoE experts split inside each expert (gate|up by
  columns, down by rows), lm_head by vocabulary;
- ``tp_ep``: the same for attention, MoE experts placed whole on ranks
  (expert parallelism; each rank computes the token-expert pairs it owns).

The package: this module (the pass, and what it reads off the graphs), ``layout``
(the layouts and their check), ``graph`` (one graph sharded for one rank) and
``placement`` (how a value lives on the ranks). ``tkcc.parallel`` builds on it
(cost model, rank groups); nothing here imports ``tkcc.parallel``.

The pass runs inside a process group of ``degree`` ranks (``tkcc.parallel.launch``,
``tkcc serve --tp N``): each rank applies it and gets its own Program. The
graph itself calls the collectives (``torch.ops._c10d_functional``), so the
engine runs a sharded candidate like any other. Degree 1 returns the Program
unchanged (bit-exact); degree > 1 reorders sums, so the pass is not exact:
validate in tolerance mode with identical greedy tokens.

What it splits is read off the graphs, not the model's config (``graph_dims``):
head counts from the views that split the q/k/v projections into heads on the
way to attention, the vocabulary from the linear that computes the logits,
the experts' count and width from their gathers. A degree that does not
divide one of them is a LayoutError before any rank starts.

Memory per rank: column slices (q/k/v, gate/up, lm_head rows, whole experts)
are views of the original weights; row slices (o, down) and the fused
gate|up blocks of MoE experts are copies. The rank also keeps the unsharded
model the Program was captured from (the golden reference).
"""
from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.fx

from tkcc.errors import PassError
from tkcc.passes.base import Pass, RewriteInfo, register
from tkcc.passes.moe import expert_shapes, expert_sites
from tkcc.passes.sharding.graph import ShardContext, shard_graph_module
from tkcc.passes.sharding.layout import DEGREES, STRATEGIES, LayoutError, ModelDims, check_layout

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_LINEAR = aten.linear.default


# ---- what the graph says about the layout ---------------------------------------------------------------

def graph_dims(program, where: str = "sharding") -> tuple[ModelDims, torch.Tensor | None]:
    """The dimensions a layout splits, read off the Program's graphs, and the logits' weight (split by vocabulary).

    - heads and KV heads: the views that split a projection's output into [heads, head_dim] on the way to
      ``scaled_dot_product_attention`` (its query, and its key/value through the cache write), with the
      projection's weight shape; the greatest common divisor over layers, so a degree that divides it divides
      every layer's;
    - the lm_head: the linear that computes the logits output (through views, casts and pointwise ops such as
      a softcap); the vocabulary is its rows, and it is tied when the embedding reads the same tensor;
    - the routed experts (``tkcc.passes.moe.expert_sites``): their count, their width (the contraction of
      the down matmul) and k; the dense MLP width (the input width of a linear of ``act(linear) * linear``),
      checked, as before, only in a model without experts (an odd-width shared expert stays replicated).

    Nothing comes from the model's config: the name and family in error messages are the Program's own
    (``meta``)."""
    q_heads, kv_heads, head_dims, mlp, experts, widths, ks = set(), set(), set(), set(), set(), set(), set()
    out_w = embedding = None
    for gm in program.graphs.values():
        for role, h, d in _attention_heads(gm):
            (q_heads if role == "q" else kv_heads).add(h)
            head_dims.add(d)
        mlp |= _gated_mlp_widths(gm)
        for site in expert_sites(gm):
            e, i, k = expert_shapes(site)
            experts.add(e)
            widths.add(i)
            if k:
                ks.add(k)
        if out_w is None:
            out_w, embedding = _logits_weight(gm), _embedding_weight(gm)
    if not (q_heads or kv_heads or out_w is not None or experts):
        raise PassError(f"{where}: nothing in the graphs to split: no projection viewed into attention heads, no "
                        "linear computing the logits, no routed experts (sharding splits Llama/OLMoE/Mixtral/"
                        "Qwen3-MoE style decoders)")
    if len(widths) > 1:
        raise PassError(f"{where}: the routed experts have different widths {sorted(widths)}; the layout splits one")
    gcd = (lambda xs: math.gcd(*xs) if xs else 0)
    dims = ModelDims(
        name=str(program.meta.get("name") or program.meta.get("family") or "the model"),
        family=str(program.meta.get("family") or ""), layers=int(program.num_blocks),
        hidden=int(out_w.shape[1]) if out_w is not None else 0,
        heads=gcd(q_heads), kv_heads=gcd(kv_heads or q_heads), head_dim=max(head_dims, default=0),
        vocab=int(out_w.shape[0]) if out_w is not None else 0,
        intermediate=0 if experts else gcd(mlp), experts=gcd(experts), top_k=max(ks, default=0),
        expert_intermediate=next(iter(widths), 0), tied_embeddings=out_w is not None and embedding is out_w)
    return dims, out_w


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _tensor(gm, node) -> torch.Tensor | None:
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def _projection(node, width: int, depth: int = 16) -> torch.fx.Node | None:
    """The linear of a get_attr weight with ``width`` outputs that ``node`` is computed from through ops of its
    own shape (a cast, a norm over the projected width: OLMoE's q/k norms), or None."""
    want = tuple(str(d) for d in _val(node).shape)
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n.op != "call_function":
                continue
            if n.target is _LINEAR and n.args[1].op == "get_attr" and _val(n.args[1]).shape[0] == width:
                return n
            nxt += [a for a in n.all_input_nodes if isinstance(_val(a), torch.Tensor)
                    and tuple(str(d) for d in _val(a).shape) == want]
        frontier = nxt
    return None


def _head_split(n) -> tuple[int, int] | None:
    """(heads, head_dim) when ``n`` is a view of a projection's output [..., heads * head_dim] as
    [..., heads, head_dim], else None."""
    if n.op != "call_function" or n.target not in _VIEWS:
        return None
    a, b = _val(n.args[0]), _val(n)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or b.dim() != a.dim() + 1:
        return None
    h, d, f = b.shape[-2], b.shape[-1], a.shape[-1]
    if not all(isinstance(x, int) for x in (h, d, f)) or h * d != f:
        return None
    return (h, d) if _projection(n.args[0], f) is not None else None


def _attention_heads(gm) -> list[tuple[str, int, int]]:
    """("q" | "kv", heads, head_dim) of each attention's query and key/value: walking back from
    ``scaled_dot_product_attention``'s arguments (through the rotary embedding, the cache write, repeat_kv's
    expand) to the view that split a projection into heads."""
    out = []
    for n in gm.graph.nodes:
        if n.target is not aten.scaled_dot_product_attention.default:
            continue
        for role, arg in zip(("q", "kv", "kv"), n.args[:3]):
            seen, todo = set(), [arg]
            while todo and len(seen) < 96:
                m = todo.pop()
                if not isinstance(m, torch.fx.Node) or m in seen or m.op != "call_function":
                    continue
                seen.add(m)
                split = _head_split(m)
                if split is not None:
                    out.append((role, *split))
                elif m.target is not _LINEAR:
                    todo.extend(m.all_input_nodes)
    return out


def _gated_mlp_widths(gm) -> set[int]:
    """The width of every gated MLP ``down(act(gate(x)) * up(x))``: its down projection's input width."""
    def linear(n):
        return isinstance(n, torch.fx.Node) and n.target is _LINEAR and n.args[1].op == "get_attr"

    widths = set()
    for n in gm.graph.nodes:
        x = n.args[0] if linear(n) else None
        if not (isinstance(x, torch.fx.Node) and x.target is aten.mul.Tensor and len(x.all_input_nodes) == 2):
            continue
        a, b = x.args[:2]
        for act, up in ((a, b), (b, a)):
            if linear(up) and isinstance(act, torch.fx.Node) and len(act.all_input_nodes) == 1 \
                    and linear(act.all_input_nodes[0]):
                widths.add(int(_val(n.args[1]).shape[1]))
    return widths


def _logits_weight(gm) -> torch.Tensor | None:
    """The weight of the linear computing the graph's (first) output, through views, casts and one-input ops."""
    out = gm.graph.output_node().args[0]
    n = out[0] if isinstance(out, (tuple, list)) and out else out
    for _ in range(16):
        if not isinstance(n, torch.fx.Node) or n.op != "call_function":
            return None
        if n.target is _LINEAR:
            return _tensor(gm, n.args[1]) if n.args[1].op == "get_attr" else None
        if len(n.all_input_nodes) != 1:
            return None
        n = n.all_input_nodes[0]
    return None


def _embedding_weight(gm) -> torch.Tensor | None:
    for n in gm.graph.nodes:
        if n.target is aten.embedding.default and n.args[0].op == "get_attr":
            return _tensor(gm, n.args[0])
    return None


# ---- the pass ------------------------------------------------------------------------------------------

def _group_info(degree: int, where: str) -> tuple[int, int, str]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise LayoutError(f"{where}: degree={degree} needs a process group of {degree} ranks, but torch.distributed "
                          f"is not initialised in this process; start ranks with tkcc.parallel.launch(...) or "
                          f"`tkcc serve --tp {degree}`")
    world = dist.get_world_size()
    if world != degree:
        raise LayoutError(f"{where}: degree={degree} but the process group has {world} ranks")
    return dist.get_rank(), world, dist.group.WORLD.group_name


def _devices_present(program) -> int | None:
    device = str(program.meta.get("device", "cpu"))
    if device.startswith("cuda"):
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return None  # CPU: any number of gloo processes


def shard_program(program, degree: int, strategy: str, ctx: ShardContext | None = None):
    """(sharded Program, RewriteInfo) for this process's rank. See the module docstring."""
    where = f"pass 'sharding' (degree={degree}, strategy={strategy!r})"
    dims, output_weight = graph_dims(program, where)
    check_layout(dims, degree, strategy, _devices_present(program), where)
    if degree == 1:
        return program, RewriteInfo(notes=["degree 1: the unsharded program, unchanged (exact)"])
    if ctx is None:
        rank, world, group = _group_info(degree, where)
        ctx = ShardContext(rank=rank, world=world, strategy=strategy, group_name=group,
                           expert_intermediate=dims.expert_intermediate, output_weight=output_weight)
    graphs, matched = {}, 0
    for phase, gm in program.graphs.items():
        graphs[phase], m = shard_graph_module(gm, ctx, phase)
        matched += m
    state = _shard_state(program.state, ctx)
    copies = sum(s.numel() * s.element_size() for t, s in ctx.shards.values()
                 if s.untyped_storage().data_ptr() != t.untyped_storage().data_ptr())
    views = sum(s.numel() * s.element_size() for t, s in ctx.shards.values()
                if s.untyped_storage().data_ptr() == t.untyped_storage().data_ptr())
    counts: dict[str, int] = {}
    for phase, kind, _ in ctx.collectives:
        counts[f"{phase}:{kind}"] = counts.get(f"{phase}:{kind}", 0) + 1
    info = RewriteInfo(matched=matched, replaced=len(ctx.sharded_attrs), notes=[
        f"rank {ctx.rank}/{ctx.world}, strategy {strategy}",
        f"collectives per call: {counts}",
        f"shard memory on this rank: {views / 2**20:.1f} MiB as views, {copies / 2**20:.1f} MiB copied",
    ])
    meta = dict(program.meta)
    meta["layout"] = dict(degree=degree, strategy=strategy, rank=ctx.rank, world=ctx.world,
                          collectives=counts, shard_bytes_copied=copies, shard_bytes_viewed=views)
    meta["exact"] = False
    new = dataclasses.replace(program, graphs={**program.graphs, **graphs}, state=state, meta=meta)
    parent_recapture = program.recapture
    if parent_recapture is not None:
        new.recapture = lambda k: shard_program(parent_recapture(k), degree, strategy, ctx)[0]
    return new, info


def _shard_state(state, ctx: ShardContext):
    """The state module with every buffer the graphs now use sharded replaced by its shard."""
    if state is None:
        return None
    by_id = {}
    for (tid, *_), (t, s) in ctx.shards.items():
        by_id[tid] = s
    memo = {}
    for t in list(state.buffers()) + list(state.parameters()):
        memo[id(t)] = by_id.get(id(t), t)
    return copy.deepcopy(state, memo)


@register
class ShardingPass(Pass):
    name = "sharding"
    version = "1"
    exact = False  # degree 1 is exact (the program is returned unchanged); degree > 1 reorders sums
    description = ("tensor-parallel layout: attention by heads, MLP column|row, MoE experts within (tp) or "
                   "whole per rank (tp_ep); collectives in the graph")
    params = {"degree": list(DEGREES), "strategy": list(STRATEGIES)}

    def apply(self, program, degree: int = 1, strategy: str = "tp"):
        return shard_program(program, degree, strategy)
