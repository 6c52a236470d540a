"""kv_split_attention: decode attention that reads only the valid part of the static KV cache, split over the GPU.

The captured decode step writes the new key/value into the static cache in
place (``index_copy_`` at ``cache_position``), then — in transformers' sdpa
path — expands the cache for grouped-query heads (``repeat_kv``: a copy of
the whole cache, every layer, every token) and attends over all
``max_cache_len`` positions under a mask. This pass rewires each
``scaled_dot_product_attention`` to read the in-place-updated cache buffers
directly: one decode token runs the split-KV kernel over positions
[0, cache_position] only (chunks of ``chunk`` positions spread over the SMs,
merged by a log-sum-exp combine), with no expanded copy; other shapes run the
eager repeat_kv + sdpa (bit-exact).

``target`` picks the one-token kernel: the Triton split-KV kernel (``chunk``
positions per split) or the CUDA C++ one (``cuda_nsplit`` splits, 0 = by the
context; ``cuda_warps`` warps; ``cuda_unroll`` rows in flight per lane group).
A CUDA target on a Program that is not on an NVIDIA GPU is a PlanError.
"""
from __future__ import annotations

import torch

from tkcc.kernels.targets import OP_TARGETS, check_pass_target, variant_params
from tkcc.passes.base import RewriteInfo, register
from tkcc.passes.decode_regions import erase_dead
from tkcc.passes.graph_pass import GraphPass, origin

_VIEWS = {torch.ops.aten.reshape.default, torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default,
          torch.ops.aten.view.default, torch.ops.aten.clone.default, torch.ops.aten.contiguous.default,
          torch.ops.aten._unsafe_view.default}
_SDPA = {torch.ops.aten.scaled_dot_product_attention.default}


def cache_source(node):
    """Walk back through view/expand ops to the updated cache buffer ([B, Hkv, S, D]); (buffer, chain) or None."""
    chain = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        chain.append(node)
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and (node.op == "get_attr" or (
            node.op == "call_function" and node.target == torch.ops.aten.index_copy_.default)):
        return node, chain
    return None


@register
class KVSplitAttention(GraphPass):
    name = "kv_split_attention"
    version = "2"
    exact = False  # the one-token kernel's softmax sums in another order; other shapes stay eager
    description = ("Attention reads the static cache in place: one decode token -> split-KV kernel over positions "
                   "<= cache_position only (no repeat_kv copy, no masked positions); other shapes -> eager sdpa.")
    params = {"chunk": [256, 128, 512, 64], "target": list(OP_TARGETS), **variant_params("decode_attention")}

    def apply(self, program, **params):
        check_pass_target(self.name, params.get("target", "triton"), program)
        return super().apply(program, **params)

    def rewrite(self, gm, info: RewriteInfo, phase: str, chunk=256, target="triton", **cuda_variant):
        from tkcc.kernels import ops  # imported here: the pass registry must load without triton

        pos = [n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "cache_position"]
        if not pos:
            info.notes.append(f"{phase}: no cache_position input; not a causal-LM step graph")
            return
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in _SDPA:
                continue
            q, k, v = node.args[:3]
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            ks, vs = cache_source(k), cache_source(v)
            if ks is None or vs is None:
                info.notes.append(f"{phase}: {node.name}: keys/values do not come from a cache buffer; left as is")
                continue
            qv, kv = q.meta.get("val"), ks[0].meta.get("val")
            if qv is None or kv is None or qv.shape[1] % kv.shape[1]:
                info.notes.append(f"{phase}: {node.name}: head counts unknown or not a multiple; left as is")
                continue
            n_rep = int(qv.shape[1]) // int(kv.shape[1])
            scale = node.kwargs.get("scale")
            if scale is None:
                scale = float(qv.shape[-1]) ** -0.5
            extra = {k2: v2 for k2, v2 in node.kwargs.items() if k2 not in ("scale", "attn_mask")}
            with gm.graph.inserting_before(node):
                kw = {"target": target, **(cuda_variant if target == "cuda" else {})}
                new = gm.graph.call_function(ops.split_kv_attention, (q, ks[0], vs[0], pos[0], mask, float(scale),
                                                                      n_rep, int(chunk), extra or None), kw)
            new.meta["val"] = node.meta.get("val")
            new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
            origin(new, node, *ks[1], *vs[1])
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            erase_dead(gm, ks[1][::-1] + vs[1][::-1])
            info.matched += 1
            info.replaced += 1
            info.provenance[f"{phase}:{new.name}"] = [node.name] + [n.name for n in ks[1] + vs[1]]
