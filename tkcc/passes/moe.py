"""moe_regroup: replace each sparse-MoE block by one op that reads only the selected experts' weights.

transformers' ``batched_mm`` experts path gathers the k selected experts'
weights into a new tensor for every token (``gate_up_proj[expert_ids]``: a
64 MB copy per OLMoE layer per decode token) before two bmm's. The
replacement op (``tkcc.kernels.ops.moe_block``) routes (softmax + top-k in the
kernel prologue) and streams each selected expert's rows once, with the
silu*mul and the weighted sum fused; prefill and unsupported devices run the
same eager arithmetic (bit-exact). ``expert_order=hot_first`` runs the op on
the experts stored most-used first by the workload's routing (router rows,
gate_up, down permuted together: the same function), from permuted copies
made once (``tkcc.kernels.expert_order``), never by permuting the model's
weights in place, which other graphs read; at batch 1 this changes no byte
counts and is offered for batched decode.

The region replaced is a block's *routed* part: the router (``gate``), the
experts and the glue between them. A shared expert (Qwen2-MoE's sigmoid-gated
one, DeepSeek's ``shared_experts``) and the sum with it stay in the graph,
computed as captured. Before a region is replaced, the op's reference path is
run beside the captured region on a random input; a region it does not
reproduce (another router: sigmoid scores, grouped top-k, a score bias; another
activation) is left as is, with the reason in the pass log. Whether the top-k
weights are renormalised comes from the router's ``norm_topk_prob`` or, for a
router without one (Mixtral, MiniMax), from that same check.

``target`` picks the one-token kernels: Triton (routing in the expert
kernel's prologue) or CUDA C++ (router logits, the ``router_topk`` kernel with
``cuda_router_threads``, then ``moe_gemv`` with ``cuda_warps`` x
``cuda_rows_per_warp`` rows per block). A CUDA target on a Program that is not
on an NVIDIA GPU is a PlanError.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.fx

from tkcc.codegen.targets import OP_TARGETS, check_pass_target, variant_params
from tkcc.passes.base import RewriteInfo, register
from tkcc.passes.decode_regions import (module_paths, param_node, region_io, region_nodes, replace_region,
                                        resolve_module)
from tkcc.passes.graph_pass import GraphPass, origin

MOE_BLOCK = r"\.layers\.\d+\.mlp$"
ROUTED = ("gate", "experts")  # the children of an MoE block the op computes; any other child stays in the graph
_CHECK_DRAWS = 3  # random inputs the op's reference must reproduce the region on
_log = logging.getLogger(__name__)


def is_sparse_moe(module) -> bool:
    return hasattr(module, "experts") and hasattr(module, "gate") and hasattr(module.experts, "gate_up_proj") \
        and hasattr(module.gate, "top_k")


def hot_first_order(probs: np.ndarray) -> torch.Tensor:
    """Expert permutation, most used first (stable for ties)."""
    return torch.from_numpy(np.argsort(-np.asarray(probs), kind="stable").copy())


@register
class MoERegroup(GraphPass):
    name = "moe_regroup"
    version = "3"
    exact = False  # the fused one-token path reorders fp32 sums; prefill keeps the eager arithmetic
    description = ("Sparse-MoE blocks -> one op: routing in the kernel prologue, only the k selected experts' "
                   "weights read, once, silu*mul and weighted sum fused (eager arithmetic off the fast path).")
    params = {"fused": [True, False], "expert_order": ["none", "hot_first"], "target": list(OP_TARGETS),
              **variant_params("moe_gemv"), **variant_params("router_topk", "cuda_router_")}

    def apply(self, program, **params):
        check_pass_target(self.name, params.get("target", "triton"), program)
        self._model = program.model
        self._orders = self._hot_first(program) if params.get("expert_order", "none") == "hot_first" else {}
        return super().apply(program, **params)

    @staticmethod
    def _hot_first(program) -> dict:
        """{id(MoE block): expert order, most used first} from the routing distribution (tkcc.traffic.routing)."""
        from tkcc.traffic.routing import Routing

        layers = [m for _p, m in program.model.named_modules() if is_sparse_moe(m)]
        if not layers:
            return {}
        g = layers[0].gate
        r = Routing.for_model(len(layers), g.num_experts, g.top_k)
        return {id(m): tuple(hot_first_order(r.probs[i]).tolist()) for i, m in enumerate(layers)}

    def rewrite(self, gm, info: RewriteInfo, phase: str, fused=True, expert_order="none", target="triton",
                **cuda_variant):
        from tkcc.kernels import ops  # imported here: the pass registry must load without triton

        for path in module_paths(gm, MOE_BLOCK):
            mod = resolve_module(self._model, path)
            if not is_sparse_moe(mod):
                continue
            nodes = routed_nodes(gm, path)
            if not nodes:
                continue
            ins, outs = region_io(nodes)
            if any(not isinstance(a.meta.get("val"), torch.Tensor) for a in ins):
                self._refuse(info, phase, path, "its routed part reads a symbolic size (the step's length); the op "
                                                "replaces static-shape regions only")
                continue
            if len(ins) != 1 or len(outs) != 1:
                self._refuse(info, phase, path, f"its routed part has {len(ins)} inputs/{len(outs)} outputs")
                continue
            w = [param_node(gm, f"{path}.{n}", nodes[0])
                 for n in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")]
            top_k = int(mod.gate.top_k)
            norm, why = _matching_norm(gm, nodes, ins[0], outs[0], mod, top_k)
            if why:
                self._refuse(info, phase, path, why)
                continue
            order = self._orders.get(id(mod))
            new = replace_region(gm, nodes, ops.moe_block, (ins[0], *w, top_k, norm, fused), phase=phase, info=info,
                                 kwargs={"target": target, **(cuda_variant if target == "cuda" else {}),
                                         **({"expert_order": order} if order else {})})
            _match_rank(gm, new, ins[0], outs[0])
        info.notes.append(f"{phase}: {info.replaced} MoE block(s) regrouped so far (fused={fused}, "
                          f"expert_order={expert_order}, target={target})")

    @staticmethod
    def _refuse(info: RewriteInfo, phase: str, path: str, why: str) -> None:
        note = f"{phase}: {path} left as is: {why}"
        info.notes.append(note)
        _log.info("moe_regroup: %s", note)


def routed_nodes(gm: torch.fx.GraphModule, path: str) -> list[torch.fx.Node]:
    """The nodes of MoE block ``path`` the op replaces: its router and experts, and the block's own glue
    (views) that only feeds them. Nodes of other children (a shared expert, its gate) and what reads them
    are not among them."""
    block = region_nodes(gm, path)
    core = {n for child in ROUTED for n in region_nodes(gm, f"{path}.{child}")}
    own = [n for n in block if n not in core and _innermost(n) == path]
    changed = True
    while changed:
        changed = False
        for n in own:
            if n not in core and n.users and all(u in core for u in n.users):
                core.add(n)
                changed = True
    return [n for n in block if n in core]


def _innermost(node: torch.fx.Node) -> str | None:
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    return stack[-1][0] if stack else None


def _matching_norm(gm, nodes, x_node, out_node, mod, top_k) -> tuple[bool, str | None]:
    """(norm_topk_prob, None) under which the op's reference path reproduces the captured region on a random
    input, else (False, why not)."""
    from tkcc.kernels import ops

    val = x_node.meta.get("val")
    if not isinstance(val, torch.Tensor) or any(not isinstance(d, int) for d in val.shape):
        return False, "its input has no static shape to check the region on"
    region = _region_module(gm, nodes, x_node, out_node)
    w = (mod.gate.weight, mod.experts.gate_up_proj, mod.experts.down_proj)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(tuple(val.shape), generator=g).to(dtype=val.dtype, device=w[0].device)
          for _ in range(_CHECK_DRAWS)]
    declared = getattr(mod.gate, "norm_topk_prob", None)
    tol = 1e-4 if val.dtype == torch.float32 else 2e-2
    worst = None
    with torch.no_grad():
        want = [region(x).float() for x in xs]
        for norm in ([bool(declared)] if declared is not None else [False, True]):
            err = max(float((ops.moe_block(x, *w, top_k, norm, False).reshape(r.shape).float() - r).abs().max()
                            / r.abs().max().clamp_min(1e-30)) for x, r in zip(xs, want))
            if err <= tol:
                return norm, None
            worst = err if worst is None else min(worst, err)
    return False, (f"the region is not a softmax top-{top_k} router with SiLU-gated experts (moe_block's reference "
                   f"differs from the captured region by {worst:.3g} of its scale on a random input)")


def _region_module(gm, nodes, x_node, out_node) -> torch.fx.GraphModule:
    """The region as a GraphModule of its one input (weights reached through ``gm``)."""
    graph = torch.fx.Graph()
    env = {x_node: graph.placeholder("x")}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and any(n in m.all_input_nodes for m in nodes):
            env[n] = graph.get_attr(n.target)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[out_node])
    return torch.fx.GraphModule(gm, graph)


def _match_rank(gm, new: torch.fx.Node, x_node, out_node) -> None:
    """moe_block returns its input's shape; where the region's output was flattened to [tokens, H], so is it."""
    want, have = out_node.meta.get("val"), x_node.meta.get("val")
    if not isinstance(want, torch.Tensor) or not isinstance(have, torch.Tensor) or want.dim() == have.dim():
        return
    with gm.graph.inserting_after(new):
        flat = gm.graph.call_function(torch.ops.aten.reshape.default, (new, [-1, want.shape[-1]]))
    new.replace_all_uses_with(flat, delete_user_cb=lambda u: u is not flat)
    flat.meta["val"] = want
    flat.meta["nn_module_stack"] = dict(new.meta.get("nn_module_stack") or {})
    origin(flat, new)
    new.meta["val"] = have
