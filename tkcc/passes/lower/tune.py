"""Kernel configs of a lowered step, picked by timing on the device; written into the graph's nodes.

- GEMVs: nodes with the same shape and hooks form a group; each config of the GEMV kernel
  (``tkcc.kernels.gemv.CONFIGS``) is timed over the whole group (every layer's own weights, so the L2
  does not serve them), replayed from a CUDA graph as the step runs them; the fastest goes into every
  node of the group.
- MoE blocks: the routed kernels' three configs (router, gate_up, down), one at a time from the defaults
  (coordinate descent), timed over every layer the same way.
- Attention: the (chunk, tile) layout at a context, over every layer's real cache (only the position the
  timing writes is saved and put back), from the chunks below the cache and the tiles the device runs.
- Then, inside the whole step (``refine_in_step``), the attention's fastest layouts and the fastest tile of
  each other chunk, then each GEMV group's three fastest configs: PDL overlap with the neighbouring kernels
  and the L2 state are the step's, which a kernel timed alone misses (llama-1b-16l at 8k on an H200: the
  layout fastest alone, chunk 512, left the lowered step 3% behind the fused step it replaced, which tuned in the step).
- With no context to tune at, one layout for every context the step will serve (``tune_layout_across``): the
  shortlist ranked alone at a middle context, each timed in the whole step at short, middle and long
  contexts, the one least behind each context's fastest kept. One CUDA graph serves every context, so its
  layout is a compromise; the default chunk left olmoe-16l's front door 8% behind a layout tuned at 128.

What is picked lives in the graph (so in the artifact's source), never in a process-global table.
``timer(fn) -> µs`` is ``tkcc.kernels.graph_replay.replay_us`` on a GPU; tests give a fake one.
"""
from __future__ import annotations

import collections
import contextlib
import functools

import torch

from tkcc.passes.lower import space
from tkcc.passes.lower.pattern import set_arg as _set, with_arg as _with_arg

def _fetch(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _Inputs:
    """Real tensors for a node's arguments: weights and caches as the graph holds them, activations random."""

    def __init__(self, gm, seed: int = 0, position: int = 0):
        self.gm, self.cache = gm, {}
        self.g = torch.Generator().manual_seed(seed)
        self.position = position

    def value(self, a):
        if not isinstance(a, torch.fx.Node):
            return [self.value(x) for x in a] if isinstance(a, (list, tuple)) else a
        if a in self.cache:
            return self.cache[a]
        if a.op == "get_attr":
            t = _fetch(self.gm, a.target)
        else:
            v = a.meta["val"]
            if v.dtype in (torch.int64, torch.int32):
                fill = self.position if a.op == "placeholder" and a.target == "cache_position" else 0
                t = torch.full(tuple(v.shape), fill, dtype=v.dtype, device=v.device)
            else:
                t = (torch.randn(tuple(v.shape), generator=self.g) * 0.1).to(device=v.device, dtype=v.dtype)
        self.cache[a] = t
        return t

    def args(self, n):
        return [self.value(a) for a in n.args], {k: self.value(v) for k, v in n.kwargs.items()}


def _pick(nodes, ins, index, name, candidates, timer, ranked: list | None = None):
    """The fastest candidate for argument ``index`` over all ``nodes`` (each with its own inputs), or None;
    ``ranked`` gets every candidate that ran, fastest first."""
    calls = [(n, *ins.args(n)) for n in nodes]
    best = None
    times = []
    for cand in candidates:
        def fn(cand=cand):
            for n, args, kwargs in calls:
                a, k = _with_arg(n, args, kwargs, index, name, cand)
                n.target(*a, **k)
        try:
            t = timer(fn)
        except Exception:  # noqa: BLE001 - a config that does not compile or launch here is not a candidate
            continue
        times.append((t, len(times), cand))
        if best is None or t < best[1]:
            best = (cand, t)
    if ranked is not None:
        ranked[:] = [c for _t, _i, c in sorted(times)]
    return best


def tune_gemvs(gm, timer, log=None) -> dict:
    """Pick each GEMV group's config (see the module docstring); returns {group key: (config, µs each, nodes,
    argument index, configs fastest first)}."""
    from tkcc.kernels import gemv as gemv_mod
    from tkcc.passes.lower.projections import gemv_key

    from tkcc.passes.lower.pattern import _all_args

    groups = collections.defaultdict(list)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.ops.tkcc.gemv.default:
            x, w, b, nw, _eps, r, act, _cfg, _pdl, up_act, split_heads, scale, r2 = _all_args(n)
            wv = w.meta["val"]
            groups[(n.target, gemv_key(wv.shape[0], wv.shape[1], nw is not None, act, r is not None,
                                       b is not None, wv.dtype, up_act, bool(split_heads),
                                       r is not None and scale != 1.0, r2 is not None))].append(n)
        elif n.target is torch.ops.tkcc.gemv_gather.default:
            _t, _ids, w, nw, _eps, _cfg, _pdl, b = _all_args(n)
            wv = w.meta["val"]
            groups[(n.target, gemv_key(wv.shape[0], wv.shape[1], nw is not None, False, False, b is not None, wv.dtype)
                    + "+gather")].append(n)
    ins = _Inputs(gm)
    out = {}
    for key, nodes in groups.items():
        index = 7 if key[0] is torch.ops.tkcc.gemv.default else 5
        ranked = []
        best = _pick(nodes, ins, index, "config", [list(c) for c in gemv_mod.CONFIGS], timer, ranked)
        if best is None:
            continue
        for n in nodes:
            _set(n, index, "config", best[0])
        out[key[1]] = (best[0], round(best[1] / len(nodes), 2), nodes, index, ranked)
        if log:
            log(f"decode: tuned GEMV {key[1]} x{len(nodes)}: {'x'.join(map(str, best[0]))} "
                f"({best[1] / len(nodes):.2f} us each)")
    return out


def refine_in_step(gm, timer, tuned: dict, context: int, top: int = 3, log=None, attention: dict | None = None) -> dict:
    """Each GEMV group's ``top`` fastest configs timed again inside the whole step (its neighbours' PDL overlap
    and the L2 as the step leaves it), one group at a time from the configs ``tune_gemvs`` picked: the one
    that makes the step fastest stays. ``attention`` (what ``tune_attention`` returned): each attention op's
    layouts too (``layout_candidates``), first. The step writes one cache position (``context``); it is put
    back. Returns {group: (kept, µs per step)}."""
    groups = []
    for prefix in ("", "mla_"):
        got = (attention or {}).get(f"{prefix}ranked")
        if got:
            nodes, (ci, bi, wi) = attention[f"{prefix}nodes"], attention[f"{prefix}layout_args"]
            first = (attention[f"{prefix}attn_chunk"], attention[f"{prefix}attn_tile"])

            def set_layout(lay, nodes=nodes, where=(ci, bi, wi)):
                _set_layout(nodes, where, lay)
            groups.append((f"{prefix}attention layout", first, layout_candidates(got, top), set_layout))
    for key, (cfg, _us, nodes, index, ranked) in tuned.items():
        def set_config(cand, nodes=nodes, index=index):
            for n in nodes:
                _set(n, index, "config", cand)
        groups.append((f"GEMV {key}", cfg, ranked[:top], set_config))
    out = {}
    if not groups:
        return out
    with _step_at(gm, context) as step:
        if step is None:
            return out
        for name, current, candidates, set_to in groups:
            best = None
            for cand in [current] + [c for c in candidates if c != current]:
                set_to(cand)
                gm.recompile()
                try:
                    t = timer(step)
                except Exception:  # noqa: BLE001 - not a candidate here
                    continue
                if best is None or t < best[1]:
                    best = (cand, t)
            if best is None:
                best = (current, None)
            set_to(best[0])
            gm.recompile()
            out[name.removeprefix("GEMV ")] = best
            if log and best[0] != current:
                what = "x".join(map(str, best[0])) if name.startswith("GEMV") else \
                    f"chunk {chunk_name(best[0][0])}, tile {best[0][1]}"
                log(f"decode: in the whole step {name} runs fastest with {what} ({best[1]:.1f} us per step)")
    return out


def _cached(gm) -> list:
    """The step's cache-reading attention nodes: each holds (k, v) caches at arguments 1 and 2."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.tkcc.attention_rope.default]


def cache_length(gm) -> int | None:
    """Positions of the step's KV cache (its attention nodes' cache), or None with no fused attention."""
    attn = _cached(gm)
    return int(attn[0].args[1].meta["val"].shape[2]) if attn else None


@contextlib.contextmanager
def _step_at(gm, context: int):
    """The whole decode step as a callable at ``context`` positions of cache (random activations, the graph's
    own weights and caches), or None where the step is not a (input_ids, cache_position) step with a fused
    attention. The step writes one cache position; it is put back on leaving. The callable carries
    ``.context`` (what a log or a fake clock may read)."""
    attn = _cached(gm)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not attn or [p.target for p in ph] != ["input_ids", "cache_position"]:
        yield None
        return
    S = attn[0].args[1].meta["val"].shape[2]
    pos = max(0, min(int(context), S - 1))
    ins = _Inputs(gm, position=pos)
    inputs = [ins.value(p) for p in ph]
    caches = [ins.value(a) for n in attn for a in (n.args[1], n.args[2])]
    saved = [c[:, :, pos].clone() for c in caches]
    step = functools.partial(lambda *a: gm(*a), *inputs)
    step.context = pos + 1
    try:
        yield step
    finally:
        with torch.no_grad():
            for c, v in zip(caches, saved):
                c[:, :, pos].copy_(v)


def tune_layout_across(gm, timer, contexts, tiles, log=None) -> dict:
    """One fused-attention layout for every context in ``contexts``: the layouts ranked alone at the middle
    context (``tune_attention``), their ``layout_candidates`` each timed in the whole step at every context,
    and the one whose mean ratio to each context's fastest is lowest written into every attention node.
    Returns {"layout": (chunk, tile), "ratio": mean ratio, "us": {context: µs per step}}, or {} when the
    step has no fused attention or nothing ran."""
    contexts = sorted(set(int(c) for c in contexts))
    if not contexts or not _cached(gm):
        return {}
    alone = tune_attention(gm, timer, contexts[len(contexts) // 2], tiles, log=log)
    ranked = alone.get("ranked")
    if not ranked:
        return {}
    nodes, where = alone["nodes"], alone["layout_args"]
    cands = layout_candidates(ranked)
    times = {c: {} for c in cands}
    for ctx in contexts:
        with _step_at(gm, ctx) as step:
            if step is None:
                return {}
            for cand in cands:
                _set_layout(nodes, where, cand)
                gm.recompile()
                try:
                    times[cand][step.context] = timer(step)
                except Exception:  # noqa: BLE001 - a layout that does not run at this context is out
                    times[cand][step.context] = None
    ran = {c: t for c, t in times.items() if t and all(v is not None for v in t.values())}
    if not ran:
        _set_layout(nodes, where, (alone["attn_chunk"], alone["attn_tile"]))
        gm.recompile()
        return {}
    fastest = {ctx: min(t[ctx] for t in ran.values()) for ctx in next(iter(ran.values()))}
    ratio = {c: sum(t[ctx] / fastest[ctx] for ctx in t) / len(t) for c, t in ran.items()}
    pick = min(ran, key=lambda c: (ratio[c], cands.index(c)))
    _set_layout(nodes, where, pick)
    gm.recompile()
    if log:
        per = ", ".join(f"{ctx}: {us:.1f}" for ctx, us in ran[pick].items())
        log(f"decode: one attention layout for contexts {sorted(fastest)}: chunk {chunk_name(pick[0])}, tile {pick[1]} "
            f"(mean {ratio[pick]:.3f}x each context's fastest of {len(ran)}; us per step {per})")
    return {"layout": pick, "ratio": ratio[pick], "us": ran[pick]}


def _moe_ops() -> dict:
    """Each routed-MoE kernel op: its ``configs`` argument, and its launches' config lists in the order the flat
    ``configs`` holds them (router, gate_up, down)."""
    from tkcc.kernels import moe_gptoss as mg, moe_routed as mr

    return {torch.ops.tkcc.moe.default: ("", 10, (mr.ROUTER_CONFIGS, mr.GATE_UP_CONFIGS, mr.DOWN_CONFIGS)),
            torch.ops.tkcc.moe_gptoss.default: ("gptoss_", 11, (mr.ROUTER_CONFIGS, mg.GATE_UP_CONFIGS,
                                                                mg.DOWN_CONFIGS))}


def tune_moes(gm, timer, log=None) -> dict:
    """Pick the routed-MoE kernels' configs, one launch at a time over every node of each MoE op."""
    out = {}
    for op, (prefix, index, parts) in _moe_ops().items():
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]
        if not nodes:
            continue
        ins = _Inputs(gm)
        cur = [x for cands in parts for x in cands[0]]
        at = 0
        for name, cands in zip(("router", "gate_up", "down"), parts):
            width = len(cands[0])
            trials = [cur[:at] + list(c) + cur[at + width:] for c in cands]
            best = _pick(nodes, ins, index, "configs", trials, timer)
            if best is not None:
                cur = best[0]
                out[prefix + name] = (list(best[0][at:at + width]), round(best[1], 2))
            at += width
        for n in nodes:
            _set(n, index, "configs", cur)
        if log:
            log(f"decode: tuned {op.name().split('::')[-1]} x{len(nodes)}: configs {cur}")
    return out


def _attention_ops() -> dict:
    """Each attention kernel op: (its cache arguments, its (chunk, block_s, num_warps) arguments, the tiles to
    time when the caller names none, the chunks it takes beside fixed ones: -N, N splits sized to each step's
    context). The same layout search serves both."""
    return {torch.ops.tkcc.attention_rope.default: ((1, 2), (12, 13, 14), None,
                                                    [-n for n in space.ATTN_DYN_SPLITS]),
            torch.ops.tkcc.mla_attention.default: ((4, 5), (13, 14, 15), space.MLA_TILES, [])}


def chunk_name(chunk: int) -> str:
    """A layout's chunk as a log says it: positions per split, or the splits sized to the context."""
    return f"{-chunk} splits sized to the context" if chunk < 0 else str(chunk)


def tune_attention(gm, timer, context: int, tiles, log=None) -> dict:
    """Pick each attention op's (chunk, tile) at ``context`` positions over every layer's cache: the fused
    attention's (``tiles``: those the device runs) and MLA's (``space.MLA_TILES``)."""
    out = {}
    for op, (cache_args, layout_args, own_tiles, dynamic) in _attention_ops().items():
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]
        if nodes:
            got = _tune_layout(nodes, gm, timer, context, own_tiles or tiles, cache_args, layout_args, dynamic)
            if got and log:
                log(f"decode: tuned {op.name().split('::')[-1]} at context {got['context']}: chunk "
                    f"{chunk_name(got['attn_chunk'])}, tile {got['attn_tile']} ({got['us_per_layer']:.2f} us/layer)")
            out.update({k if op is torch.ops.tkcc.attention_rope.default else f"mla_{k}": v for k, v in got.items()})
    return out


def _tune_layout(nodes, gm, timer, context, tiles, cache_args, layout_args, dynamic=(), dynamic_tiles: int = 2) -> dict:
    """Every fixed chunk below the cache (and the cache whole) with every tile, then the ``dynamic`` chunks (-N:
    N splits sized to the context, where the cache holds N chunks of 16) with the ``dynamic_tiles`` tiles that
    ranked fastest among the fixed layouts (a dynamic layout compiles kernels of its own: not every tile's)."""
    S = nodes[0].args[cache_args[0]].meta["val"].shape[2]
    pos = max(0, min(int(context), S - 1))
    ins = _Inputs(gm, position=pos)
    caches = [ins.value(n.args[i]) for n in nodes for i in cache_args]
    saved = [c[:, :, pos].clone() for c in caches]
    chunks = [c for c in space.ATTN_CHUNKS if c and c < S] + ([S] if S <= 8192 else [])
    calls = [(n, *ins.args(n)) for n in nodes]
    ci, bi, wi = layout_args
    times = []

    def time_all(layouts):
        for chunk, tile in layouts:
            bs, nw = space.parse_tile(tile)

            def fn(chunk=chunk, bs=bs, nw=nw):
                for n, args, kwargs in calls:
                    a = list(args)
                    a[ci], a[bi], a[wi] = chunk, bs, nw
                    n.target(*a, **kwargs)
            try:
                t = timer(fn)
            except Exception:  # noqa: BLE001 - a layout that does not compile or launch here is not a candidate
                continue
            times.append((t, len(times), (chunk, tile)))
    try:
        time_all([(c, t) for c in chunks for t in tiles])
        best_tiles = list(dict.fromkeys(lay[1] for _t, _i, lay in sorted(times)))[:dynamic_tiles]
        time_all([(c, t) for c in dynamic if -c * 16 <= S for t in best_tiles])
    finally:
        with torch.no_grad():
            for c, s in zip(caches, saved):
                c[:, :, pos].copy_(s)
    if not times:
        return {}
    ranked = [lay for _t, _i, lay in sorted(times)]
    t, _i, (chunk, tile) = min(times)
    _set_layout(nodes, layout_args, (chunk, tile))
    return {"attn_chunk": chunk, "attn_tile": tile, "us_per_layer": round(t / len(nodes), 2), "context": pos + 1,
            "ranked": ranked, "nodes": nodes, "layout_args": layout_args}


def _set_layout(nodes, layout_args, layout) -> None:
    """Write ``layout`` (chunk, tile) into each attention node's (chunk, block, warps) arguments."""
    ci, bi, wi = layout_args
    bs, nw = space.parse_tile(layout[1])
    for n in nodes:
        args = list(n.args)
        args[ci], args[bi], args[wi] = layout[0], bs, nw
        n.args = tuple(args)


def layout_candidates(ranked: list, top: int = 3) -> list:
    """What the whole step times of an attention's layouts timed alone: the ``top`` fastest, and the fastest
    tile of every other chunk (a chunk decides the splits, and so how the attention overlaps its neighbours,
    which the attention timed alone does not see)."""
    out = list(ranked[:top])
    for chunk, tile in ranked:
        if all(c != chunk for c, _t in out):
            out.append((chunk, tile))
    return out
