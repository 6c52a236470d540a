"""moe_regroup: replace each sparse-MoE region of the graph by one op that reads only the selected experts' weights.

transformers' ``batched_mm`` experts path gathers the k selected experts'
weights into a new tensor for every token (``gate_up_proj[expert_ids]``: a
64 MB copy per OLMoE layer per decode token) before two bmm's. The
replacement op (``tkcc.kernels.ops.moe_block``) routes (softmax + top-k in the
kernel prologue) and streams each selected expert's rows once, with the
silu*mul and the weighted sum fused; off the one-token fast path (more tokens,
an unsupported device, ``fused=False``) it runs the same eager arithmetic as the
region it replaced, bit for bit.

The region is found on the aten ops of each phase graph, not on the model's
modules: it is a pattern (``routed_pattern``: the router's linear, a softmax in
fp32, top-k, optionally renormalised, then the experts' gather, bmm, SiLU-gated
product, bmm and weighted sum) matched with the machinery of
``tkcc.passes.lower.pattern`` (same ops, same data flow, then the pattern traced
again at the region's own shapes and compared literal by literal). The
weights are the graph's own ``get_attr`` nodes bound to the pattern's inputs,
and whether the top-k weights are renormalised is which pattern matched, i.e.
whether the graph divides them by their sum (transformers' in-place ``/=``; an
out-of-place ``w / w.sum()`` is another aten op, ``div`` for ``div_``, and does
not match until the shared canonical form treats the two alike). A region starts at the block's
flattened input, so a shared expert that reads the same input (Qwen2-MoE) and
the sum with it stay in the graph, computed as captured.

Every expert gather in the graph (a 3-D weight indexed by the routing's ids
feeding a bmm) that no pattern took is left as is, with the reason in the pass
log: a symbolic size (prefill's length), a router moe_block does not compute
(sigmoid scores, a score bias, grouped top-k, a scale; the ops found are named),
another activation between the expert matmuls, or routing weights that stay
fp32 in a bf16/fp16 graph (Mixtral's router: moe_block rounds them to the dtype).

``expert_order=hot_first`` runs the op on the experts stored most-used first by
the workload's routing (router rows, gate_up, down permuted together: the same
function), from permuted copies made once (``tkcc.kernels.expert_order``),
never by permuting the model's weights in place, which other graphs read; at
batch 1 this changes no byte counts and is offered for batched decode. The
routing comes from the caller, in the PassManager's context (``routing``:
``(layers, experts, k) -> Routing``, anything with per-layer ``probs``;
``tkcc.pipeline.pass_context()`` gives ``tkcc.traffic.routing.Routing.for_model``):
a pass does not import the traffic layer.

``target`` picks the one-token kernels: Triton (routing in the expert
kernel's prologue) or CUDA C++ (router logits, the ``router_topk`` kernel with
``cuda_router_threads``, then ``moe_gemv`` with ``cuda_warps`` x
``cuda_rows_per_warp`` rows per block). A CUDA target on a Program that is not
on an NVIDIA GPU is a PlanError.
"""
from __future__ import annotations

import logging
import operator

import numpy as np
import torch
import torch.fx

from tkcc.errors import PlanError
from tkcc.kernels.targets import OP_TARGETS, check_pass_target, variant_params
from tkcc.passes.base import RewriteInfo, register
from tkcc.passes.graph_pass import GraphPass, origin
from tkcc.passes.lower import moe as lower_moe
from tkcc.passes.lower.moe import TOP_K
from tkcc.passes.lower.pattern import Match, Rewrite, common_stack, canonicalize, find

aten = torch.ops.aten
_log = logging.getLogger(__name__)
# ops named when a region is refused: everything but views, casts and indexing glue
_GLUE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.expand.default, aten.to.dtype, aten._to_copy.default, aten.clone.default,
         aten.contiguous.default, aten.alias.default, aten.clamp.default}


def hot_first_order(probs: np.ndarray) -> torch.Tensor:
    """Expert permutation, most used first (stable for ties)."""
    return torch.from_numpy(np.argsort(-np.asarray(probs), kind="stable").copy())


# ---- the pattern and its replacement ----------------------------------------------------------------

def routed_pattern(router: str, norm_topk: bool):
    """The routed part of a sparse-MoE block as transformers writes it, on the block's flattened input
    xs [T, H] to its [T, H] output: the top-k router (``tkcc.passes.lower.moe.topk_router``: "softmax" in
    fp32 with the weights rounded to the dtype, OLMoE / Qwen; "softmax_fp32" of the upcast logits with the
    weights kept fp32, Mixtral / MiniMax; renormalised with ``norm_topk``) and the ``batched_mm`` experts."""
    pattern = lower_moe.routed_pattern(router, norm_topk)
    pattern.__qualname__ = f"moe_regroup.pattern[{router}{'+renorm' if norm_topk else ''}]"
    return pattern


def replacement(norm_topk: bool):
    """What a matched region becomes: ``moe_block`` on the region's own input and weights (its eager path is
    the pattern's arithmetic, so the two are compared bit for bit in the tests)."""

    def moe_block(xs, router_w, gate_up, down, *, top_k, fused=False, **options):
        from tkcc.kernels import ops  # imported here: the pass registry must load without triton

        return ops.moe_block(xs, router_w, gate_up, down, top_k, norm_topk, fused, **options)

    return moe_block


def _example(dt):
    E, H, I = 12, 48, 20  # noqa: E741 - the experts' width
    return ((torch.empty(1, H, dtype=dt), torch.empty(E, H, dtype=dt), torch.empty(E, 2 * I, H, dtype=dt),
             torch.empty(E, H, I, dtype=dt)), {"top_k": TOP_K})


# router, renormalised: every router moe_block computes (largest pattern first)
VARIANTS = (("softmax", True), ("softmax_fp32", True), ("softmax", False), ("softmax_fp32", False))
REWRITES = [Rewrite(f"moe_regroup[{router}{'+renorm' if norm else ''}-top-k]", routed_pattern(router, norm),
                    replacement(norm), _example, region="moe")
            for router, norm in VARIANTS]
_VARIANT = {id(rw): v for rw, v in zip(REWRITES, VARIANTS)}


def _refusal(match: Match, router: str) -> str | None:
    """Why a matched region must stay as captured, or None."""
    xs, r, gu, dn = (match.val(i) for i in range(4))
    if any(match.tensor(i) is None for i in (1, 2, 3)):
        return "its router or expert weights are computed in the graph, not read from parameters"
    E, I2, H = gu.shape
    if xs.dim() != 2 or tuple(r.shape) != (E, H) or tuple(dn.shape) != (E, H, I2 // 2):
        return (f"input {tuple(xs.shape)}, router {tuple(r.shape)}, experts {tuple(gu.shape)} / {tuple(dn.shape)} "
                f"are not one [T, H] / [E, H] / [E, 2I, H] / [E, H, I] layout")
    if router == "softmax_fp32" and xs.dtype != torch.float32:
        return (f"its routing weights stay fp32 (softmax of the upcast logits, never rounded); moe_block rounds "
                f"them to {str(xs.dtype).replace('torch.', '')}: not the captured arithmetic")
    return None


# ---- the regions: expert gathers ----------------------------------------------------------------------

def _is_weight(n) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "get_attr"


def expert_sites(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The routing ids of every routed-experts region, in graph order: the index node that gathers 3-D weights
    (``gate_up[ids]``, ``down[ids]``) for a bmm. One per MoE block, whatever its router."""
    sites = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.index.Tensor or not _is_weight(n.args[0]):
            continue
        w, idx = n.meta.get("val"), n.args[1]
        if not (isinstance(w, torch.Tensor) and w.dim() == 3 and len(idx) == 1 and isinstance(idx[0], torch.fx.Node)):
            continue
        if any(u.target is aten.bmm.default for u in n.users) and idx[0] not in sites:
            sites.append(idx[0])
    return sites


def expert_shapes(site: torch.fx.Node) -> tuple[int, int, int | None]:
    """(experts, intermediate width, k) of the routed-experts region whose routing ids are ``site``, read off the
    graph: the gathered weights' expert count, the contraction of its last expert matmul (the down projection's
    input width, whatever the weights' layout) and the k of the nearest top-k (None when there is none)."""
    gathers = [u for u in site.users if u.target is aten.index.Tensor and _is_weight(u.args[0])]
    order = {n: i for i, n in enumerate(site.graph.nodes)}
    bmms = sorted((b for g in gathers for b in g.users if b.target is aten.bmm.default), key=order.get)
    experts = int(gathers[0].args[0].meta["val"].shape[0])
    inter = int(bmms[-1].args[0].meta["val"].shape[-1])
    topk = [n for n in _backward(site, 8) if n.target is aten.topk.default]
    return experts, inter, (int(topk[0].args[1]) if topk else None)


def _symbolic(node) -> bool:
    v = node.meta.get("val")
    return not isinstance(v, torch.Tensor) or any(not isinstance(d, int) for d in v.shape)


def _where(node) -> str:
    paths = [p for p, _t in (node.meta.get("nn_module_stack") or {}).values() if p]
    return f"{paths[-1]} ({node.name})" if paths else node.name


def _slice_ops(start, stop) -> list[str]:
    """Names of the ops computing ``start`` back to the first nodes ``stop`` accepts (those included), in graph
    order, glue left out: what a refused region computes, for its reason."""
    seen, todo, found = set(), [start], []
    while todo and len(seen) < 96:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or n.op != "call_function":
            continue
        seen.add(n)
        found.append(n)
        if not stop(n):
            todo.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(start.graph.nodes)}
    return [getattr(n.target, "__name__", str(n.target)).split(".")[0] for n in sorted(found, key=order.get)
            if n.target not in _GLUE and n.target is not operator.getitem]


def _diagnosis(ids: torch.fx.Node) -> str:
    """What the region around ``ids`` computes where moe_block's differs: its router ops (back to the router's
    linear) and the ops between its two expert matmuls."""
    router = _slice_ops(ids, lambda n: n.target in (aten.linear.default, aten.mm.default, aten.addmm.default))
    acts = []
    gathers = [u for u in ids.users if u.target is aten.index.Tensor]
    bmms = [b for g in gathers for b in g.users if b.target is aten.bmm.default]
    if len(bmms) == 2:
        first, second = sorted(bmms, key=lambda b: list(ids.graph.nodes).index(b))
        acts = _slice_ops(second.args[1], lambda n: n is first)
        acts = [a for a in acts if a != "bmm"]
    k = expert_shapes(ids)[2] or "k"
    return (f"its ops are not a softmax top-{k} router with SiLU-gated experts, the one moe_block computes "
            f"(router: {', '.join(router) or 'none found'}; between the expert matmuls: {', '.join(acts) or '?'})")


def _backward(node, depth: int) -> list[torch.fx.Node]:
    """The ops up to ``depth`` steps before ``node``, nearest first."""
    out, frontier = [], [node]
    for _ in range(depth):
        frontier = list(dict.fromkeys(a for n in frontier for a in n.all_input_nodes
                                      if a.op == "call_function" and a not in out))
        out.extend(frontier)
    return out


# ---- the pass -----------------------------------------------------------------------------------------

@register
class MoERegroup(GraphPass):
    name = "moe_regroup"
    version = "4"
    exact = False  # the fused one-token path reorders fp32 sums; every other path keeps the eager arithmetic
    description = ("Sparse-MoE regions (softmax top-k router + SiLU-gated batched_mm experts, matched on the graph's "
                   "ops) -> one op: routing in the kernel prologue, only the k selected experts' weights read, once, "
                   "silu*mul and weighted sum fused (eager arithmetic off the fast path).")
    params = {"fused": [True, False], "expert_order": ["none", "hot_first"], "target": list(OP_TARGETS),
              **variant_params("moe_gemv"), **variant_params("router_topk", "cuda_router_")}
    context_keys = ("routing",)

    def apply(self, program, routing=None, **params):
        """``routing``: ``(layers, experts, k) -> Routing`` (per-layer ``probs``), which ``hot_first`` orders by."""
        check_pass_target(self.name, params.get("target", "triton"), program)
        if params.get("expert_order") == "hot_first" and routing is None:
            raise PlanError(f"pass {self.name!r}: expert_order='hot_first' orders experts by a routing "
                            "distribution and none was given: PassManager(context={'routing': ...}) "
                            "(tkcc.pipeline.pass_context() has the default)")
        self._routing, self._routings = routing, {}
        return super().apply(program, **params)

    def rewrite(self, gm, info: RewriteInfo, phase: str, fused=True, expert_order="none", target="triton",
                **cuda_variant):
        from tkcc.kernels import ops  # imported here: the pass registry must load without triton

        sites = expert_sites(gm)
        if not sites:
            return
        if any(_symbolic(s) for s in sites):
            for s in sites:
                self._refuse(info, phase, s, "its routing reads a symbolic size (the step's length); the op "
                                             "replaces static-shape regions only")
            return
        canonicalize(gm.graph)
        pending = {s: None for s in sites}  # site -> why it was refused once matched
        done: dict[str, int] = {}
        near: dict[str, int] = {}  # structural matches that were not the pattern's program, by why
        for rw in REWRITES:
            router, norm = _VARIANT[id(rw)]
            for dtype in sorted({_dtype_of(s) for s in pending}, key=str):
                matches, why_not = find(rw, gm, dtype)
                for why, count in why_not.items():
                    near[f"{rw.name}: {why}"] = near.get(f"{rw.name}: {why}", 0) + count
                for m in matches:
                    site = next((n for n in m.nodes if n in pending), None)
                    if site is None:
                        continue
                    why = _refusal(m, router)
                    if why:
                        pending[site] = why
                        continue
                    top_k = int(m.scalars["top_k"])
                    order = self._order(sites.index(site), len(sites), m, top_k) \
                        if expert_order == "hot_first" else None
                    kwargs = {"target": target, **(cuda_variant if target == "cuda" else {}),
                              **({"expert_order": order} if order else {})}
                    _replace(gm, m, ops.moe_block, (*m.inputs, top_k, norm, fused), kwargs, phase, info)
                    del pending[site]
                    done[rw.name] = done.get(rw.name, 0) + 1
        for site, why in pending.items():
            self._refuse(info, phase, site, why or _diagnosis(site))
        if pending and near:
            info.notes.append(f"{phase}: regions with a pattern's structure but not its program: {near}")
        info.notes.append(f"{phase}: {info.replaced} MoE region(s) regrouped so far ({done or 'none here'}; "
                          f"fused={fused}, expert_order={expert_order}, target={target})")

    def _order(self, layer: int, layers: int, m: Match, top_k: int) -> tuple:
        """Layer ``layer``'s expert order, most used first, from the caller's routing distribution for this
        graph's count of MoE regions, experts and k."""
        key = (layers, int(m.val(2).shape[0]), top_k)
        if key not in self._routings:
            self._routings[key] = self._routing(*key)
        return tuple(hot_first_order(self._routings[key].probs[layer]).tolist())

    @staticmethod
    def _refuse(info: RewriteInfo, phase: str, site: torch.fx.Node, why: str) -> None:
        note = f"{phase}: the MoE region at {_where(site)} left as is: {why}"
        info.notes.append(note)
        _log.info("moe_regroup: %s", note)


def _dtype_of(site: torch.fx.Node) -> torch.dtype:
    """The dtype the region computes in: its gathered expert weights'."""
    g = next(u for u in site.users if u.target is aten.index.Tensor)
    return g.meta["val"].dtype


def _replace(gm, m: Match, fn, args: tuple, kwargs: dict, phase: str, info: RewriteInfo) -> torch.fx.Node:
    """``fn(*args, **kwargs)`` in place of the matched region (inserted before its output, which follows every
    input of the region); the region's nodes go, each new node records the nodes it came from."""
    out = m.outputs[0]
    with gm.graph.inserting_before(out):
        new = gm.graph.call_function(fn, tuple(args), dict(kwargs))
    new.meta["val"] = out.meta.get("val")
    new.meta["nn_module_stack"] = common_stack(m.nodes)
    origin(new, *m.nodes)
    out.replace_all_uses_with(new)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in sorted(m.nodes, key=lambda n: -order[n]):
        if not n.users:
            gm.graph.erase_node(n)
    info.matched += 1
    info.replaced += 1
    info.provenance[f"{phase}:{new.name}"] = [n.name for n in m.nodes]
    return new


