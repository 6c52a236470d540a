"""A hand-written pass in a user's own file: ``pow(x, 2)`` -> ``x * x``.

Register it by importing this file, then name it in a plan like a built-in:

    tkcc compile --pass-module examples/my_pass.py \
        --plan '[{"name": "pow2-to-mul"}, {"name": "dce"}]'

    tkcc.compile(model, plan=[{"name": "pow2-to-mul"}], pass_modules=["examples/my_pass.py"])

It is bit-exact (``exact = True``): PyTorch computes ``pow(x, 2)`` as
``x * x`` on CPU and GPU, and the PassManager checks that bitwise after the
pass runs. ``exponent=3`` also rewrites cubes as ``(x * x) * x``.
"""
import torch

from tkcc.passes import RewriteInfo, register
from tkcc.passes.graph_pass import GraphPass, origin

aten = torch.ops.aten


@register
class PowToMul(GraphPass):
    name = "pow2-to-mul"
    version = "1"
    exact = True
    description = "strength-reduce pow(x, 2) (and optionally pow(x, 3)) to multiplications"
    params = {"max_exponent": [2, 3]}

    def rewrite(self, gm: torch.fx.GraphModule, info: RewriteInfo, phase: str, max_exponent: int = 2) -> None:
        g = gm.graph
        for node in list(g.nodes):
            if node.op != "call_function" or node.target is not aten.pow.Tensor_Scalar:
                continue
            x, e = node.args[0], node.args[1]
            if not isinstance(e, (int, float)) or e not in (2, 3) or e > max_exponent:
                continue
            info.matched += 1
            with g.inserting_before(node):
                sq = origin(g.call_function(aten.mul.Tensor, (x, x)), node)
                new = sq if e == 2 else origin(g.call_function(aten.mul.Tensor, (sq, x)), node)
            new.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")})
            node.replace_all_uses_with(new)
            g.erase_node(node)
            info.replaced += 1
