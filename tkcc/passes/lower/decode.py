"""``lowered_decode``: the decode phase rewritten region by region into the kernel ops of ``tkcc.kernels``.

The captured aten decode graph goes through the rewrites of this package, in stages; each stage applies
its rewrites (largest pattern first) until none matches:

1. ``canonicalize``: casts to what a tensor already is, aliases, products by one (bit-exact);
2. what every layer shares: the step's causal mask, its rotary cos/sin table (bit-exact, named ops);
3. MoE blocks: router, top-k, routed experts, with the norm before them when nothing else reads it (before
   packing: the router is a linear that could be packed with a shared expert's);
4. projections that read one activation packed into one (gate|up of a gated MLP first, then q|k|v);
5. GEMVs with what surrounds them: norm prologue, bias, gated epilogue, residual epilogue;
6. attention blocks: q/k norm, rotary, cache write, attention, as one fused launch per layer;
7. whatever norms nothing absorbed;
8. a norm whose every reader is a GEMV or a routed MoE without a norm prologue: into each reader's prologue;

then dead code goes (the mask and the rotary table, once every attention is fused). A region no pattern
matches stays in aten inside the same step, and a pattern that matched a region a kernel cannot take
(a weight layout, a dtype, a shape, a mask that is not causal) is refused with its reason in the pass
log: lowering is per region, never all or nothing, and never a wrong result. The result is an ordinary
graph of aten and ``torch.ops.tkcc`` nodes: codegen writes it as the artifact's forward, and the decode
phase replays from one CUDA graph through the wrapper every compiled forward gets
(``tkcc.kernels.graph_replay.GraphCache``).

Parameters (derived from the ops' own configs, see ``space.py``): ``attn_chunk`` and ``attn_tile`` (the
fused attention's layout), ``gemv_config`` (one config for every GEMV, or ``auto``), ``pdl``
(programmatic dependent launch on Hopper+), ``tune`` (on a GPU, time each GEMV group's and the MoE
kernels' configs over all layers' weights and keep the fastest, ``tune.py``), ``tune_context`` (also time
the attention layouts at this many positions of context: their best moves with the context; 0, with
``attn_chunk`` 0 and ``tune``: one layout judged at short, middle and long contexts of the step's cache,
``tune.tune_layout_across``, over every tile the device runs, or only ``attn_tile`` when the plan names one
other than the default). Whatever is tuned is written into the graph's nodes, so the artifact's source holds it.
"""
from __future__ import annotations

import collections
import time

import torch

from tkcc.errors import PlanError
from tkcc.passes.base import Pass, RewriteInfo, register
from tkcc.passes.lower import pattern_ops, space
from tkcc.passes.lower.pattern import VIEW_OPS, Context, apply as apply_rewrite, canonicalize

# what the pass log's "left in aten" does not count: the views, and a split's outputs
VIEWS = {str(op) for op in VIEW_OPS} | {"aten.split_with_sizes.default", "<built-in function getitem>"}

DEFAULT_TILE = "64x4"  # the fused attention's tile when a plan names none
# what a refused region is, by stage, where it is not aten (a kernel op whose readers could not take it)
KEPT = {"norm_readers": "kept standalone"}


def stages():
    """The rewrites, stage by stage (see the module docstring)."""
    import tkcc.kernels.lowered  # noqa: F401 - registers torch.ops.tkcc (no triton needed until a kernel runs)
    from tkcc.passes.lower import attention, attention_plain, biased_experts, causal_conv, gated_delta, \
        linear_attention, mla, moe, norms, projections, rotary, routed_experts

    return [("shared", attention.MASKS + rotary.REWRITES + rotary.CANONICAL + attention_plain.CANONICAL),
            ("moe", routed_experts.SCALED + moe.REWRITES + routed_experts.REWRITES + biased_experts.REWRITES),
            ("packing", projections.PACK),
            ("gemv", projections.GEMV),
            ("attention", attention.ATTENTION + rotary.ATTENTION + attention_plain.REWRITES + mla.REWRITES),
            ("linear_attention", linear_attention.REWRITES + gated_delta.REWRITES + causal_conv.REWRITES),
            ("norms", norms.REWRITES),
            ("norm_readers", norms.INTO_READERS)]


def _device(program) -> torch.device:
    state = getattr(program, "state", None)
    for b in (state.buffers() if state is not None else ()):
        return b.device
    return torch.device(program.meta.get("device", "cpu"))


def _dtype(program) -> torch.dtype:
    dt = getattr(torch, str(program.meta.get("dtype", "float32")).replace("torch.", ""), None)
    if isinstance(dt, torch.dtype):
        return dt
    return next(program.model.parameters()).dtype


def head_shapes(program) -> list[tuple[int, int, bool]]:
    """(group size, head dim, q/k norm) of the model's attention, from its config (for the tile pruning)."""
    cfg = program.model.config.get_text_config() if hasattr(program.model, "config") else None
    if cfg is None:
        return list(space.DEVICE_SHAPES)
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return [(max(1, hq // hkv), int(D), qk) for qk in (False, True)]


def tile_pruned_space(params: dict, device, program) -> tuple[dict, dict]:
    """``params`` less the ``attn_tile`` values ``device`` cannot run at ``program``'s head shapes (the reference
    models' without one), and why each was pruned: the space of every pass whose step runs the fused attention
    kernel (``lowered_decode``)."""
    limits = space.device_limits(device) if device is not None else None
    bad = space.pruned_tiles(limits, head_shapes(program) if program is not None else space.DEVICE_SHAPES)
    out = dict(params)
    out["attn_tile"] = [t for t in params["attn_tile"] if t not in bad]
    return out, {f"attn_tile={t}": why for t, why in bad.items()}


@register
class LoweredDecode(Pass):
    name = "lowered_decode"
    version = "1"
    exact = False
    description = ("Decode graph -> its regions rewritten by op pattern into fused kernel ops (norm-prologue / "
                   "residual-epilogue GEMVs, packed q|k|v and gate|up, one fused attention per layer, routed "
                   "MoE); unmatched regions stay in aten; replayed as one CUDA graph.")
    params = {"pdl": [True, False], "attn_chunk": list(space.ATTN_CHUNKS), "attn_tile": list(space.ATTN_TILES),
              "gemv_config": list(space.GEMV_CONFIGS), "tune": [True, False],
              "tune_context": [0, 128, 512, 2048, 8192, 32768]}

    @classmethod
    def space(cls, device=None, program=None) -> tuple[dict, dict]:
        """(params, pruned): the space less what ``device`` cannot run, and why each value was pruned. With
        a ``program`` its own head shapes decide; without, the reference models' (``space.DEVICE_SHAPES``)."""
        return tile_pruned_space(cls.params, device, program)

    def apply(self, program, pdl=True, attn_chunk=0, attn_tile=DEFAULT_TILE, gemv_config="auto", tune=True,
              tune_context=0):
        info = RewriteInfo()
        if "decode" not in program.graphs:
            info.notes.append("no decode phase; nothing to do")
            return program, info
        t0 = time.perf_counter()
        block_s, num_warps = space.parse_tile(attn_tile)
        device, dtype = _device(program), _dtype(program)
        limits = space.device_limits(device)
        bad = space.pruned_tiles(limits, head_shapes(program)) if limits is not None else {}
        if limits is not None:
            if attn_tile in bad:
                raise PlanError(f"lowered_decode: attn_tile {attn_tile!r} cannot run on {device}: {bad[attn_tile]} "
                                f"(the space for this device is {[t for t in space.ATTN_TILES if t not in bad]})")
        use_pdl = bool(pdl) and limits is not None and limits[0] >= 90
        pinned = space.parse_gemv(gemv_config)

        def layout(hq, hkv, D, S):
            chunk = attn_chunk or (256 if hkv >= 16 else 128)
            return chunk, (block_s, num_warps)

        gm = program.graphs["decode"]
        before = collections.Counter(_kind(n) for n in gm.graph.nodes if n.op == "call_function")
        lower(gm, dtype, {"pdl": use_pdl, "attention_layout": layout, "gemv_configs": {}}, info, "decode")
        if pinned is not None:
            _set_gemv_configs(gm, pinned)
        if tune and device.type == "cuda":
            from tkcc.kernels.graph_replay import replay_us

            def graph_time(fn):  # median µs of fn's launches replayed from a CUDA graph, as the step runs them
                return replay_us(fn, reps=7, warmup=1)

            from tkcc.passes.lower import tune as tuning

            with torch.no_grad():
                tuned = tuning.tune_gemvs(gm, graph_time, log=info.notes.append) if pinned is None else {}
                tuning.tune_moes(gm, graph_time, log=info.notes.append)
                tiles = [t for t in space.ATTN_TILES if t not in bad]
                if tune_context:
                    layouts = tuning.tune_attention(gm, graph_time, tune_context, tiles, log=info.notes.append)
                else:  # no context named: one layout judged at short, middle and long contexts of this cache
                    layouts = {}
                    if attn_chunk == 0:
                        tiles = tiles if attn_tile == DEFAULT_TILE else [attn_tile]
                        tuning.tune_layout_across(gm, graph_time, span_contexts(tuning.cache_length(gm)), tiles,
                                                  log=info.notes.append)
                tuning.refine_in_step(gm, graph_time, tuned, tune_context or 128, log=info.notes.append,
                                      attention=layouts)
        gm.recompile()
        after = collections.Counter(_kind(n) for n in gm.graph.nodes if n.op == "call_function")
        ops = {k: v for k, v in sorted(after.items()) if k.startswith("tkcc.")}
        aten = {k: v for k, v in sorted(after.items()) if not k.startswith("tkcc.") and k not in VIEWS}
        info.notes.append(f"decode: {sum(before.values())} call nodes -> {sum(after.values())}; kernel ops {ops}; "
                          f"left in aten {aten or 'nothing but views'}; pdl={use_pdl}, attn_chunk={attn_chunk or 'auto'}, "
                          f"attn_tile={attn_tile}, gemv_config={gemv_config} ({time.perf_counter() - t0:.1f}s)")
        return program.with_graphs({"decode": gm}), info


SPAN_CONTEXTS = (128, 2048, 8192)  # short, middle and long: where a layout for every context is judged


def span_contexts(cache_len: int | None) -> list[int]:
    """The contexts (``SPAN_CONTEXTS``) a step with ``cache_len`` positions of cache can reach; its last
    position where the cache is shorter than all of them; none without a cache."""
    if not cache_len:
        return []
    return [c for c in SPAN_CONTEXTS if c < cache_len] or [cache_len - 1]


def lower(gm, dtype: torch.dtype, options: dict, info: RewriteInfo | None = None, phase: str = "decode"):
    """Rewrite ``gm`` in place through every stage (see the module docstring); returns ``info`` with the
    counts, the provenance of every new node and a note per rewrite that lowered or refused regions."""
    info = info if info is not None else RewriteInfo()
    dropped = canonicalize(gm.graph)
    gm.graph.eliminate_dead_code()
    info.notes.append(f"{phase}: canonicalised ({dropped} nodes dropped: no-op casts, whole writes, all-True mask "
                      "terms, equal views)")
    ctx = Context(gm, options=options)
    refusals = []  # (the note's index, the refused regions' nodes)
    for stage, rewrites in stages():
        for rw in rewrites:
            out = apply_rewrite(rw, gm, dtype, ctx)
            info.matched += out.matched
            info.replaced += out.replaced
            for name, srcs in out.new_nodes.items():
                info.provenance[f"{phase}:{name}"] = srcs
            if out.replaced:
                info.notes.append(f"{phase}: {stage}: {rw.name}: {out.replaced} region(s) lowered")
            for why, n in out.refused.items():
                refusals.append((len(info.notes), out.refused_at.get(why, set())))
                kept = KEPT.get(stage, "left in aten")
                info.notes.append(f"{phase}: {stage}: {rw.name}: {n} region(s) {kept}: {why}")
    pattern_ops.flush()
    _drop_refusals_lowered_later(info, refusals, gm)
    gm.graph.eliminate_dead_code()
    _drop_unused_attrs(gm)
    gm.graph.lint()
    gm.recompile()
    return info


def _drop_refusals_lowered_later(info: RewriteInfo, refusals: list, gm) -> None:
    """A rewrite that refused a region logs it as left in aten; a later, other rewrite may lower that same region
    (a GELU with ``approximate='tanh'`` is refused by the exact GELU's pattern and taken by the tanh one's). Such a
    note is dropped: none of its regions' nodes is left in the graph. Where any is, the note stands."""
    alive = set(gm.graph.nodes)
    drop = {i for i, nodes in refusals if nodes and not (nodes & alive)}
    if drop:
        info.notes[:] = [n for i, n in enumerate(info.notes) if i not in drop]


def _kind(n) -> str:
    return str(n.target)


def _drop_unused_attrs(gm) -> None:
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:
            gm.graph.erase_node(n)


def _set_gemv_configs(gm, cfg) -> None:
    """Write one config into every GEMV node (a literal of the graph, so of the artifact's source)."""
    from tkcc.passes.lower.tune import _set

    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.tkcc.gemv.default:
            _set(n, 7, "config", [int(c) for c in cfg])
        elif n.op == "call_function" and n.target is torch.ops.tkcc.gemv_gather.default:
            _set(n, 5, "config", [int(c) for c in cfg])
