"""Tensor-parallel sharding: one rank's slice of every phase graph, collectives in the graph.

Params: ``degree`` (ranks the model is split over) and ``strategy``:

- ``tp``: attention by heads (q/k/v column-parallel, o row-parallel), dense
  MLP column then row, MoE experts split inside each expert (gate|up by
  columns, down by rows), lm_head by vocabulary;
- ``tp_ep``: the same for attention, MoE experts placed whole on ranks
  (expert parallelism; each rank computes the token-expert pairs it owns).

The pass runs inside a process group of ``degree`` ranks (``tkcc.parallel.launch``,
``tkcc serve --tp N``): each rank applies it and gets its own Program. The
graph itself calls the collectives (``torch.ops._c10d_functional``), so the
engine runs a sharded candidate like any other. Degree 1 returns the Program
unchanged (bit-exact); degree > 1 reorders sums, so the pass is not exact:
validate in tolerance mode with identical greedy tokens.

Memory per rank: column slices (q/k/v, gate/up, lm_head rows, whole experts)
are views of the original weights; row slices (o, down) and the fused
gate|up blocks of MoE experts are copies. The rank also keeps the unsharded
model the Program was captured from (the golden reference).
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from tkcc.errors import PassError
from tkcc.parallel.layout import DEGREES, STRATEGIES, LayoutError, check_layout, dims_from_config
from tkcc.parallel.shard_graph import ShardContext, shard_graph_module
from tkcc.passes.base import Pass, RewriteInfo, register


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
    cfg = getattr(program.model, "config", None)
    if cfg is None:
        raise PassError(f"{where}: the Program's model has no transformers config; sharding knows Llama/OLMoE/"
                        "Mixtral/Qwen3-MoE style models")
    dims = dims_from_config(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg,
                            program.meta.get("name") or "")
    check_layout(dims, degree, strategy, _devices_present(program), where)
    if degree == 1:
        return program, RewriteInfo(notes=["degree 1: the unsharded program, unchanged (exact)"])
    if ctx is None:
        rank, world, group = _group_info(degree, where)
        out_emb = program.model.get_output_embeddings() if hasattr(program.model, "get_output_embeddings") else None
        ctx = ShardContext(rank=rank, world=world, strategy=strategy, group_name=group,
                           expert_intermediate=dims.expert_intermediate,
                           output_weight=getattr(out_emb, "weight", None))
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
