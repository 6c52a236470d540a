"""decode_fusion: RMSNorm regions -> one kernel, and the residual add before a norm fused into it.

Every ``*RMSNorm`` module call (input/post-attention norms, the final norm,
OLMoE's q/k norms) is an 8-op region in the aten graph (upcast, square, mean,
add eps, rsqrt, multiply, downcast, weight); it becomes one
``tkcc.kernels.ops.rms_norm``. When the norm's input is a residual add
(``h = residual + out``), the add joins it (``add_rms_norm`` returns the norm
and ``h`` for the next residual). Off the kernel devices both run the eager
arithmetic, so the rewrite is bit-exact there; the kernel rounds where eager
code rounds (rsqrt may differ in the last fp32 bit).

``target`` picks the kernel: Triton or the CUDA C++ ``rmsnorm`` family
(``cuda_threads`` per row). A CUDA target on a Program that is not on an
NVIDIA GPU is a PlanError.
"""
from __future__ import annotations

import operator

import torch

from tkcc.kernels.targets import OP_TARGETS, check_pass_target, variant_params
from tkcc.passes.base import RewriteInfo, register
from tkcc.passes.decode_regions import module_paths, param_node, region_io, region_nodes, replace_region, \
    resolve_module
from tkcc.passes.graph_pass import GraphPass, origin

NORM = r"norm$"


def _unalias(x, outs, nodes):
    """A no-op upcast of the input (``x.to(x.dtype)``, e.g. an fp32 model) that export let other code reuse
    is the input itself: point those outside uses back at ``x``."""
    inside = set(nodes)
    xv = x.meta.get("val")
    for o in outs[:-1]:
        ov = o.meta.get("val")
        if o.op == "call_function" and o.args and o.args[0] is x and xv is not None and ov is not None \
                and ov.dtype == xv.dtype and ov.shape == xv.shape and "to" in str(o.target):
            for u in [u for u in o.users if u not in inside]:
                u.replace_input_with(o, x)


@register
class DecodeFusion(GraphPass):
    name = "decode_fusion"
    version = "2"
    exact = False
    description = "RMSNorm regions -> one kernel each; a residual add feeding a norm fused into it."
    params = {"fuse_residual": [True, False], "fused": [True, False], "target": list(OP_TARGETS),
              **variant_params("rmsnorm")}

    def apply(self, program, **params):
        check_pass_target(self.name, params.get("target", "triton"), program)
        self._model = program.model
        return super().apply(program, **params)

    def rewrite(self, gm, info: RewriteInfo, phase: str, fuse_residual=True, fused=True, target="triton",
                **cuda_variant):
        from tkcc.kernels import ops  # imported here: the pass registry must load without triton

        kw = {"target": target, **(cuda_variant if target == "cuda" else {})}
        for path, typ in module_paths(gm, NORM).items():
            if "RMSNorm" not in str(typ):
                continue
            mod = resolve_module(self._model, path)
            eps = float(getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6)))
            nodes = region_nodes(gm, path)
            if not nodes:
                continue
            ins, outs = region_io(nodes)
            if len(ins) == 1 and len(outs) > 1:
                _unalias(ins[0], outs, nodes)
                ins, outs = region_io(nodes)
            if len(ins) != 1 or len(outs) != 1:
                info.notes.append(f"{phase}: {path}: {len(ins)} inputs/{len(outs)} outputs; left as is")
                continue
            w = param_node(gm, f"{path}.weight", nodes[0])
            x = ins[0]
            if fuse_residual and x.op == "call_function" and x.target == torch.ops.aten.add.Tensor \
                    and all(isinstance(a, torch.fx.Node) for a in x.args[:2]) and len(x.args) == 2 \
                    and not x.kwargs:
                a, b = x.args
                with gm.graph.inserting_before(nodes[0]):
                    pair = gm.graph.call_function(ops.add_rms_norm, (a, b, w, eps, fused), dict(kw))
                    y = gm.graph.call_function(operator.getitem, (pair, 0))
                    h = gm.graph.call_function(operator.getitem, (pair, 1))
                y.meta["val"], h.meta["val"] = outs[0].meta.get("val"), x.meta.get("val")
                for n in (pair, y, h):
                    origin(n, x, *nodes)
                outs[0].replace_all_uses_with(y)
                x.replace_all_uses_with(h)
                for n in reversed(nodes):
                    if not n.users:
                        gm.graph.erase_node(n)
                if not x.users:
                    gm.graph.erase_node(x)
                info.matched += 1
                info.replaced += 1
                info.provenance[f"{phase}:{pair.name}"] = [x.name] + [n.name for n in nodes]
            else:
                replace_region(gm, nodes, ops.rms_norm, (x, w, eps, fused), dict(kw), phase=phase, info=info)
