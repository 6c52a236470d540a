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

``target`` picks the one-token kernels: Triton (routing in the expert
kernel's prologue) or CUDA C++ (router logits, the ``router_topk`` kernel with
``cuda_router_threads``, then ``moe_gemv`` with ``cuda_warps`` x
``cuda_rows_per_warp`` rows per block). A CUDA target on a Program that is not
on an NVIDIA GPU is a PlanError.
"""
from __future__ import annotations

import numpy as np
import torch

from tkcc.codegen.targets import OP_TARGETS, check_pass_target, variant_params
from tkcc.passes.base import RewriteInfo, register
from tkcc.passes.decode_regions import (module_paths, param_node, region_io, region_nodes, replace_region,
                                        resolve_module)
from tkcc.passes.graph_pass import GraphPass

MOE_BLOCK = r"\.layers\.\d+\.mlp$"


def is_sparse_moe(module) -> bool:
    return hasattr(module, "experts") and hasattr(module, "gate") and hasattr(module.experts, "gate_up_proj") \
        and hasattr(module.gate, "top_k")


def hot_first_order(probs: np.ndarray) -> torch.Tensor:
    """Expert permutation, most used first (stable for ties)."""
    return torch.from_numpy(np.argsort(-np.asarray(probs), kind="stable").copy())


@register
class MoERegroup(GraphPass):
    name = "moe_regroup"
    version = "2"
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
            nodes = region_nodes(gm, path)
            if not nodes:
                continue
            ins, outs = region_io(nodes)
            if len(ins) != 1 or len(outs) != 1:
                info.notes.append(f"{phase}: {path} has {len(ins)} inputs/{len(outs)} outputs; left as is")
                continue
            w = [param_node(gm, f"{path}.{n}", nodes[0])
                 for n in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")]
            order = self._orders.get(id(mod))
            replace_region(gm, nodes, ops.moe_block,
                           (ins[0], *w, int(mod.gate.top_k), bool(getattr(mod.gate, "norm_topk_prob", False)),
                            fused), phase=phase, info=info,
                           kwargs={"target": target, **(cuda_variant if target == "cuda" else {}),
                                   **({"expert_order": order} if order else {})})
        info.notes.append(f"{phase}: {info.replaced} MoE block(s) regrouped so far (fused={fused}, "
                          f"expert_order={expert_order}, target={target})")
