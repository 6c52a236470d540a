"""decode_fused_step: the whole batch-1 decode step as one fused kernel sequence, replayed as one CUDA graph.

Replaces a causal LM's ``decode`` graph by a module that runs
``tkcc.kernels.decoder.FusedDecoder`` over the model's own weights and the
Program's static KV cache (``Program.state``, written in place, shared with the
prefill graph). Per layer: QKV GEMV with the RMSNorm prologue; q/k-norm +
rotary + cache write; split-KV attention; o-proj + residual; MoE (router
GEMV, experts gate_up with routing in the prologue, experts down + residual)
or gated MLP (two GEMVs). With ``cuda_graph`` the step is captured on its
first call and then replayed: inputs are copied on the device, so a decode
loop has no host synchronisation. With ``pdl`` each kernel launches while the
previous one drains (programmatic dependent launch, Hopper and later).
``fused_attention`` (norm + rotary + cache write + split-KV + combine in one
launch), ``routed_moe`` (routing once per layer in the router kernel) and
``fused_ends`` (embedding gather and argmax inside the first and last GEMVs)
are the decoder's options; ``attn_chunk`` (positions per split-KV program) and
``attn_tile`` (positions per loop step x warps of the attention kernels) its
attention layout, which moves with the context the traffic brings, so
``attn_spans`` gives each context span below the cache length its own layout
and CUDA graph, tuned at that span and picked per step by the position the
greedy loop knows on the host (a span picked too short is slower, never
wrong); ``tune``
times each kernel kind alone over all layers and then the whole step per
config (``FusedDecoder.tune_step``).
Anything the fused step does not support (batch > 1, other families, CPU
without the Triton interpreter) runs the original graph, with the reason
logged.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.fx

from tkcc.errors import TkccError
from tkcc.kernels.common import fallback_reason
from tkcc.kernels.fused_step import FusedDecodeStep, decoder_for, parse_spans, parse_tile
from tkcc.passes.base import Pass, RewriteInfo, register

log = logging.getLogger("tkcc.passes.decode_graph")


def _output_like(gm: torch.fx.GraphModule, graph: torch.fx.Graph, value: torch.fx.Node):
    """An output node with the same structure as ``gm``'s (a bare value or a 1-tuple/list)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    a = out.args[0]
    if isinstance(a, (tuple, list)):
        if len(a) != 1:
            raise TkccError(f"decode graph returns {len(a)} values; the fused step returns logits only")
        return graph.output(type(a)([value]))
    return graph.output(value)


def _span_contexts(dec) -> list[int]:
    """The context each span's attention layout is tuned at: the geometric middle of the span."""
    out, lo = [], 64
    for span in dec.spans:
        out.append(max(16, min(span - 1, int((lo * span) ** 0.5))))
        lo = span
    return out


def _tune_spans(dec) -> dict:
    """Each context span's attention layout, tuned by whole-step timing in the span (the best split-KV grid
    moves with the context; the greedy loop picks the span by position)."""
    out = {}
    for span, ctx in zip(dec.spans, _span_contexts(dec)):
        dec.use_span(ctx)
        dec.reset(0, ctx)
        out[f"{span}@ctx{ctx}"] = dec.tune_step(kinds=("attn_chunk", "attn_tile"))
    dec.use_span(None)
    return out


@contextlib.contextmanager
def _cache_rows_kept(caches: list[torch.Tensor], positions: list[int]):
    """Tuning steps write this token's K/V at their position: the cache rows there are put back afterwards,
    so a Program whose cache already holds a sequence keeps it."""
    positions = sorted(set(positions))
    saved = [c[:, positions].clone() for c in caches]
    try:
        yield
    finally:
        with torch.no_grad():
            for c, v in zip(caches, saved):
                c[:, positions] = v


def _tuning_key(dec, opts: dict) -> str:
    """What a decoder's tuned configs depend on: its options, cache length, device, dtype and the shapes of
    one layer's weights (every layer's are the same; a tier with fewer layers has the same ones)."""
    import json

    layer = {k: list(v.shape) for k, v in sorted(dec.layers[0].items()) if isinstance(v, torch.Tensor)}
    return json.dumps({"opts": {k: opts[k] for k in sorted(opts)}, "max_cache_len": int(dec.max_cache_len),
                       "device": (torch.cuda.get_device_name(dec.device) if torch.device(dec.device).type == "cuda"
                                  else str(dec.device)), "dtype": str(dec.dtype),
                       "layer": layer, "lm_head": list(dec.lm_head.shape)}, sort_keys=True, default=str)


def _tuned(program, dec, opts: dict, keys, vals, fused_attention: bool, info):
    """The decoder with its kernel configs tuned on the device: each kernel kind alone, then the whole step
    per config, then each span's attention layout. Configs another tier of the same model tuned already
    (``Program.tuned``: same shapes) are taken instead of timing them again."""
    from tkcc.kernels.discovery import discovering

    memo = getattr(program, "tuned", None)
    key = _tuning_key(dec, opts)
    kept = memo.get(key) if memo is not None else None
    whole = getattr(program, "whole", None)
    if kept is None and memo is not None and whole is not None and whole is not program and not discovering():
        # a tier of a few blocks: their weights can sit in the L2 and their launches are not the model's step
        # (a discovery run lists the same kernels on the tier itself)
        _tuned_on_whole(whole, opts, fused_attention, info)
        kept = memo.get(key)
    if kept is not None:
        info.notes.append(f"tuned: the configs this model's other tier timed at the same shapes: {kept}")
        return decoder_for(program.model, dec.max_cache_len, (keys, vals), opts, {k: tuple(v) for k, v in kept.items()})
    info.notes.append(f"tuned: {dec.tune()}")
    # then the whole step per config, at positions whose cache rows are put back after
    at = min(128, dec.max_cache_len - 1)
    with _cache_rows_kept(keys + vals, [at] + _span_contexts(dec)):
        dec.reset(0, at)
        info.notes.append(f"step-tuned: {dec.tune_step()}")
        if fused_attention:
            info.notes.append(f"attention-tuned: {_tune_spans(dec)}")
    if memo is not None and not discovering():  # a discovery run times nothing (no kernel launches)
        memo[key] = {k: list(v) for k, v in dec.configs.items()}
    return dec


def cache_tensors(kv) -> tuple[list, list]:
    """Each layer's key and value cache of batch row 0, [H_kv, S, D]: what the fused decoder reads and writes."""
    return [kv.key(i)[0] for i in range(kv.num_layers)], [kv.value(i)[0] for i in range(kv.num_layers)]


def _tuned_on_whole(whole, opts: dict, fused_attention: bool, info) -> None:
    """Time the step's configs on the whole model (its own cache, rows put back), into the shared
    ``Program.tuned``; the decoder built for it goes when this returns."""
    kv = whole.state
    keys, vals = cache_tensors(kv)
    dec = decoder_for(whole.model, kv.max_cache_len, (keys, vals), opts)
    info.notes.append(f"tuned on the whole model ({kv.num_layers} layers), for this tier of its first blocks")
    _tuned(whole, dec, opts, keys, vals, fused_attention, info)


@register
class DecodeFusedStep(Pass):
    name = "decode_fused_step"
    version = "4"
    exact = False
    description = ("Decode phase -> one fused kernel sequence per step (MoE regrouped, KV staged in place, "
                   "norms/rotary/activations fused), captured as one CUDA graph.")
    params = {"cuda_graph": [True, False], "pdl": [True, False], "attn_chunk": [0, 64, 128, 256, 512],
              "tune": [True, False], "fused_attention": [True, False], "routed_moe": [True, False],
              "fused_ends": [True, False], "attn_tile": ["64x4", "32x4", "128x4", "128x8", "256x8"],
              "attn_spans": ["1024,4096", "", "512,2048,8192"]}

    @classmethod
    def space(cls, device=None, program=None) -> tuple[dict, dict]:
        """(params, pruned): the attention tiles ``device`` cannot run at the model's heads (the reference
        models' without a ``program``) leave the space, with the reason; the same facts as ``lowered_decode``'s
        (one fused attention kernel)."""
        from tkcc.passes.lower.decode import tile_pruned_space

        return tile_pruned_space(cls.params, device, program)

    @classmethod
    def accepts(cls, name, value) -> bool:
        parse = {"attn_tile": parse_tile, "attn_spans": parse_spans}.get(name)
        if parse is None or not isinstance(value, str):
            return False
        try:
            parse(value)
        except TkccError:
            return False
        return True

    # The defaults are the options measured fastest together on an H200 (benchmarks/decode.py, variant
    # tkcc_v3: every option, kernel configs tuned, seconds per build); each keeps the path without it as its
    # reference, and the search can turn any of them off.
    def apply(self, program, cuda_graph=True, pdl=True, attn_chunk=0, tune=True, fused_attention=True,
              routed_moe=True, fused_ends=True, attn_tile="64x4", attn_spans="1024,4096"):
        parse_tile(attn_tile)  # a malformed tile or span list fails here, with its format
        parse_spans(attn_spans)
        opts = dict(attn_chunk=attn_chunk, pdl=pdl, fused_attention=fused_attention, routed_moe=routed_moe,
                    fused_ends=fused_ends, attn_tile=attn_tile, attn_spans=attn_spans)
        info = RewriteInfo()
        if "decode" not in program.graphs:
            info.notes.append("no decode phase; nothing to do")
            return program, info
        gm = program.graphs["decode"]
        kv = program.state
        unsupported = None
        dec = None
        if kv is None or not hasattr(kv, "key"):
            unsupported = "the Program has no static KV cache (Program.state)"
        elif kv.batch != 1:
            unsupported = f"batch {kv.batch} (the fused step is batch-1 decode)"
        else:
            keys, vals = cache_tensors(kv)
            unsupported = fallback_reason(keys[0])
            if unsupported is None:
                try:
                    dec = decoder_for(program.model, kv.max_cache_len, (keys, vals), opts)
                    if tune and keys[0].is_cuda:
                        dec = _tuned(program, dec, opts, keys, vals, fused_attention, info)
                except (TkccError, AttributeError) as e:
                    unsupported = f"{type(e).__name__}: {e}"
                    dec = None
        graph = torch.fx.Graph()
        ph = [graph.placeholder(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
        for new, old in zip(ph, [n for n in gm.graph.nodes if n.op == "placeholder"]):
            new.meta = dict(old.meta)
        root = torch.nn.Module()
        root.add_module("fused_decode", FusedDecodeStep(dec, gm, cuda_graph, unsupported, opts))
        call = graph.call_module("fused_decode", tuple(ph))
        call.meta["tkcc_from"] = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        _output_like(gm, graph, call)
        new_gm = torch.fx.GraphModule(root, graph, class_name="FusedDecode")
        info.matched = 1
        info.replaced = 0 if unsupported else 1
        info.provenance[f"decode:{call.name}"] = call.meta["tkcc_from"]
        info.notes.append(f"decode: fused step ({'original graph: ' + unsupported if unsupported else 'kernels'}; "
                          f"cuda_graph={cuda_graph}, pdl={pdl}, attn_chunk={attn_chunk or 'auto'}, attn_tile={attn_tile}, "
                          f"fused_attention={fused_attention}, routed_moe={routed_moe}, fused_ends={fused_ends}, "
                          f"attn_spans={attn_spans or 'none'})")
        return program.with_graphs({"decode": new_gm}), info
