"""Fusion of elementwise chains and row-wise normalisations into generated Triton kernels.

Two registered passes share one grouping:

- ``fuse_elementwise`` (tolerance): fuses pointwise ops, transcendentals and
  row-wise normalisation (the RMSNorm pattern pow/mean/add/rsqrt/mul, and
  softmax) over the last dim. ``intermediates="per_op"`` computes each op in
  fp32 and rounds to the op's dtype, in eager's order; ``"fp32"`` keeps fp32
  intermediates and rounds only at explicit casts and outputs (fewer roundings,
  different bits from eager for bf16/fp16 chains).
- ``fuse_elementwise_exact`` (exact): fuses only correctly rounded ops (add,
  sub, mul, div, neg, abs, reciprocal, pow by 1/2/3/-1/-2, where,
  masked_fill, comparisons, casts, clone), each computed in fp32 and rounded
  to its dtype, compiled without FMA contraction: the same bits as eager.

Both take views that only add or drop leading size-1 dims inside a group
(the same elements in the same places: a decode step's ``[1, H]`` reshaped
to ``[1, 1, H]`` between two adds), when the view is one link of a chain (its
value read by it alone, it read by one node); a group still needs two ops
that compute.

A group is a set of producer/consumer-connected nodes whose shapes broadcast
to one shape S; reductions reduce S's last dim with keepdim. A node joins a
group only if no node outside the group already consumed a group value and
no in-place op lies between the group's nodes, so the fused node can sit
where the group's last node was (no cycles, no reordering, every read sees
the same tensor state). Each group becomes one ``call_function`` node whose target is a
``tkcc.kernels.rowwise.FusedKernel`` (runs in-process; its module source is
what an artifact ships) followed by ``getitem`` nodes for its outputs.

The kernel is a kernel op like any other: it comes from the kernel library
(``tkcc.kernels.rowwise``, with the op table ``tkcc.kernels.triton_ops``),
imported where it is used so the pass registry loads without jinja2.
"""
from __future__ import annotations

import bisect
import logging
import operator
from collections import Counter

import torch
import torch.fx

from tkcc.passes.base import FUSE, RewriteInfo, register
from tkcc.passes.graph_pass import GraphPass, origin

log = logging.getLogger("tkcc.passes.fusion")


def _contiguous(node: torch.fx.Node) -> bool:
    try:
        return bool(node.meta["val"].is_contiguous())
    except Exception:  # noqa: BLE001 - symbolic strides: be conservative
        return False


def _mutates(node: torch.fx.Node) -> bool:
    """Writes to a tensor (in-place aten op, out= variant, or any non-aten call we cannot see into)."""
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return bool(t._schema.is_mutable)
        return getattr(t, "__name__", "").endswith("_") and not getattr(t, "__tkcc_kernel__", False)
    return node.op in ("call_method", "call_module") and (node.op == "call_module" or str(node.target).endswith("_"))


def find_groups(graph: torch.fx.Graph, *, exact: bool, include_norms: bool, max_ops: int,
                why_not: Counter | None = None) -> list[list[torch.fx.Node]]:
    """Maximal fusible groups, each in graph order. ``why_not`` counts reasons nodes were left out."""
    from tkcc.kernels.rowwise import broadcast_keys, shape_keys
    from tkcc.kernels.triton_ops import RULES, check_node, op_name

    why_not = why_not if why_not is not None else Counter()
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    group_of: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    mutations = [index[n] for n in nodes if _mutates(n)]

    def fits(members: list[torch.fx.Node], n: torch.fx.Node) -> str | None:
        if len(members) > max_ops:
            return f"group would exceed max_ops={max_ops}"
        mset = set(members)
        shapes = []
        for m in members:
            shapes.append(shape_keys(m))
            shapes += [shape_keys(a) for a in m.all_input_nodes if a not in mset]
        S = broadcast_keys(shapes)
        if S is None:
            return "shapes do not broadcast"
        lo = min(index[m] for m in members)
        k = bisect.bisect_right(mutations, lo)
        if k < len(mutations) and mutations[k] < index[n]:
            return f"an in-place op ({nodes[mutations[k]].name}) lies between the group's nodes"
        for m in members:
            if RULES[op_name(m.target)].kind in ("reduction", "softmax") and shape_keys(m.args[0])[-1:] != S[-1:]:
                return "a reduction's row is not the group's last dim"
            for u in m.users:
                if u not in mset and index[u] < index[n]:
                    return f"{m.name} is already used by {u.name} before {n.name}"
        return None

    for n in nodes:
        if n.op != "call_function":
            continue
        rule, why = check_node(n, exact=exact, include_norms=include_norms)
        if rule is None:
            if "has no fused lowering" not in why:
                why_not[why] += 1
            continue
        producers = []
        for a in n.all_input_nodes:
            g = group_of.get(a)
            if g is not None and not any(g is p for p in producers):
                producers.append(g)
        chosen = [n]
        if producers:
            union = sorted({m for g in producers for m in g} | {n}, key=index.__getitem__)
            reason = fits(union, n)
            if reason is None:
                chosen = union
            else:
                why_not[reason] += 1
                best = None
                for g in sorted(producers, key=len, reverse=True):
                    trial = sorted(set(g) | {n}, key=index.__getitem__)
                    if fits(trial, n) is None:
                        best = trial
                        break
                if best is not None:
                    chosen = best
        elif fits(chosen, n) is not None:
            continue
        for m in chosen:
            group_of[m] = chosen

    groups, seen = [], set()
    for n in nodes:
        g = group_of.get(n)
        if g is None or id(g) in seen:
            continue
        seen.add(id(g))
        has_norm = any(RULES[op_name(m.target)].kind in ("reduction", "softmax") for m in g)
        # a view computes nothing: a group needs two ops that compute (or a softmax) to save a launch
        computing = [m for m in g if RULES[op_name(m.target)].kind != "view"]
        if len(computing) < 2 and not any(RULES[op_name(m.target)].kind == "softmax" for m in g):
            continue
        gset = set(g)
        outs = [m for m in g if any(u not in gset for u in m.users)]
        if not all(_contiguous(o) for o in outs):
            why_not["a group output is not contiguous"] += 1
            continue
        if has_norm and not include_norms:
            continue
        groups.append(g)
    return groups


class _FuseBase(GraphPass):
    exact_variant = False
    stage = FUSE  # after the lowering rewrites: it would merge the ops their patterns match

    def rewrite(self, gm: torch.fx.GraphModule, info: RewriteInfo, phase: str, **params) -> None:
        from tkcc.kernels.rowwise import build_kernel

        exact = self.exact_variant
        why_not: Counter = Counter()
        groups = find_groups(gm.graph, exact=exact, include_norms=params.get("include_norms", False) and not exact,
                             max_ops=params["max_ops"], why_not=why_not)
        graph = gm.graph
        index = {n: i for i, n in enumerate(graph.nodes)}
        for g in groups:
            gset = set(g)
            inputs: list[torch.fx.Node] = []
            for m in g:
                for a in m.all_input_nodes:
                    if a not in gset and a not in inputs:
                        inputs.append(a)
            outputs = [m for m in g if any(u not in gset for u in m.users)]
            if not outputs:
                continue
            try:
                kernel = build_kernel(g, inputs, outputs, exact=exact,
                                      fp32_intermediates=params.get("intermediates") == "fp32",
                                      block_elems=params["block_elems"], num_warps=params["num_warps"])
            except Exception as exc:  # noqa: BLE001 - a group we cannot write stays as reference ops
                msg = f"{phase}: kept {len(g)} ops starting at {g[0].name} unfused: {exc}"
                log.info(msg)
                info.notes.append(msg)
                continue
            last = max(g, key=index.__getitem__)
            with graph.inserting_before(last):
                fused = graph.call_function(kernel, tuple(inputs))
                fused.meta["val"] = tuple(o.meta["val"] for o in outputs)
                fused.meta["tkcc_kernel"] = kernel.name
                for key in ("nn_module_stack", "stack_trace"):
                    if key in g[0].meta:
                        fused.meta[key] = g[0].meta[key]
                origin(fused, *g)
                info.provenance[f"{phase}:{fused.name}"] = [f"{phase}:{m.name}" for m in g]
                for k, o in enumerate(outputs):
                    item = graph.call_function(operator.getitem, (fused, k))
                    item.meta = {key: v for key, v in o.meta.items() if key in ("val", "nn_module_stack", "stack_trace",
                                                                                  "tensor_meta")}
                    origin(item, o)
                    info.provenance[f"{phase}:{item.name}"] = [f"{phase}:{o.name}"]
                    o.replace_all_uses_with(item, delete_user_cb=lambda u, gset=gset: u not in gset)
            for m in sorted(g, key=index.__getitem__, reverse=True):
                graph.erase_node(m)
            info.matched += 1
            info.replaced += len(g)
            info.kernels[kernel.name] = kernel.source
            info.notes.append(f"{phase}: {kernel.name} <- {len(g)} ops ({', '.join(m.name for m in g)})")
        for reason, count in sorted(why_not.items()):
            info.notes.append(f"{phase}: not fused ({count}x): {reason}")
            log.info("%s: not fused (%dx): %s", phase, count, reason)


_SPACE = {"max_ops": [32, 8, 16, 64, 128], "block_elems": [2048, 512, 1024, 4096, 8192], "num_warps": [4, 1, 2, 8]}


@register
class FuseElementwise(_FuseBase):
    """Tolerance variant: pointwise chains, transcendentals, RMSNorm and softmax rows in one kernel each."""

    name = "fuse_elementwise"
    version = "1"
    exact = False
    description = ("fuse chains of elementwise ops and last-dim normalisations (RMSNorm, softmax) into generated "
                   "Triton kernels; fp32 math, fast transcendentals and tree reductions (tolerance)")
    params = {**_SPACE, "include_norms": [True, False], "intermediates": ["per_op", "fp32"]}


@register
class FuseElementwiseExact(_FuseBase):
    """Exact variant: only correctly rounded ops, rounded per op as eager does, no FMA contraction."""

    name = "fuse_elementwise_exact"
    version = "1"
    exact = True
    exact_variant = True
    description = ("fuse chains of correctly rounded elementwise ops (add/sub/mul/div/neg/abs/where/casts/...) "
                   "into generated Triton kernels computing each op in fp32 rounded to its dtype: eager's bits")
    params = dict(_SPACE)
