"""A second opinion for tolerance mode: the reference run in fp32, and whether a candidate is as close to it.

In bf16 a correct candidate and the captured graph both round, each its own way, and their distance is the sum
of two rounding errors. On a random-weight MoE that sum sits at the dtype's floor: on an H200, olmoe-16l's fused
decode step, which matches the fp32 computation as closely as the bf16 captured graph does (0.017 against 0.016 of
the logits' norm at 8k), was 0.0531 of scale from the bf16 graph at one fresh input against a bound of 0.05, at an
input where the graph itself was stable under a one-rounding-step perturbation. Once it shipped, that one draw
ended the compile. So where a candidate exceeds the bound against the low-precision reference, the reference is
run again with every floating value in fp32 (``upcast``), and the candidate passes if it is within the bound of
that exact result, or no farther from it than the low-precision reference itself is (``closer_to_exact``). A wrong
kernel is far from both. This runs only after a failure, so a passing candidate pays nothing for it.
"""
from __future__ import annotations

import copy

import torch
import torch.fx

LOW = (torch.bfloat16, torch.float16)
_REINTERPRETING = {torch.ops.aten.view.dtype}  # a bitcast's meaning changes with its dtype: no fp32 twin


def _value(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _low(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype in LOW


def _in_place(n: torch.fx.Node) -> bool:
    """An aten op that writes its first argument (``index_copy_``, ``copy_``, ...)."""
    if n.op != "call_function" or not hasattr(n.target, "_schema"):
        return False
    args = n.target._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def upcast(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A copy of ``gm`` that computes in fp32 on the same parameters and state: every low-precision weight is read
    through an fp32 copy made where it is used (freed after; nothing resident is copied), every dtype argument
    that names bf16/fp16 names fp32, and a write into a low-precision buffer (the KV cache) stores its value
    rounded to that buffer's dtype and hands fp32 on. None when the graph has an op with no fp32 twin."""
    graph = copy.deepcopy(gm.graph)
    to = torch.ops.aten._to_copy.default
    f32 = torch.float32

    def swap(a):
        return f32 if isinstance(a, torch.dtype) and a in LOW else a

    for n in list(graph.nodes):
        if n.op == "call_function" and n.target in _REINTERPRETING:
            return None
        if n.op == "call_function":
            n.args = torch.fx.node.map_aggregate(n.args, swap)
            n.kwargs = torch.fx.node.map_aggregate(n.kwargs, swap)
        if n.op == "get_attr" and _low(_value(gm, n.target)):
            dtype = _value(gm, n.target).dtype
            readers = [u for u in n.users if not (_in_place(u) and u.args and u.args[0] is n)]
            if readers:
                with graph.inserting_after(n):
                    up = graph.call_function(to, (n,), {"dtype": f32})
                for u in readers:
                    u.replace_input_with(n, up)
            for w in [u for u in n.users if _in_place(u) and u.args and u.args[0] is n]:
                with graph.inserting_before(w):
                    w.args = (n,) + tuple(graph.call_function(to, (a,), {"dtype": dtype})
                                          if isinstance(a, torch.fx.Node) and _floating(a) else a for a in w.args[1:])
                users = list(w.users)
                if users:
                    with graph.inserting_after(w):
                        up = graph.call_function(to, (w,), {"dtype": f32})
                    for u in users:
                        u.replace_input_with(w, up)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


def _floating(n: torch.fx.Node) -> bool:
    v = n.meta.get("val", n.meta.get("tensor_meta"))
    dtype = getattr(v, "dtype", None)
    return dtype is not None and dtype.is_floating_point


def closer_to_exact(ref: list[torch.Tensor], out: list[torch.Tensor], exact: list[torch.Tensor],
                    bound: float) -> tuple[bool, str]:
    """(ok, what was found): per floating output that is past ``bound`` of the low-precision reference, is the
    candidate within ``bound`` of the fp32 result, or no farther from it than the reference is (scale: the fp32
    result's largest |value|)?"""
    from tkcc.runtime.validation import scaled_error

    found = []
    for i, (r, o, x) in enumerate(zip(ref, out, exact)):
        if not (o.is_floating_point() and x.is_floating_point()) or scaled_error(r, o)[2] <= bound:
            continue
        cand, own = scaled_error(x, o)[2], scaled_error(x, r)[2]
        found.append(f"output {i}: {cand:.3g} of scale from the fp32 reference, the reference itself {own:.3g}")
        if cand > max(bound, own):
            return False, "against the reference run in fp32: " + "; ".join(found)
    return True, "judged against the reference run in fp32: " + "; ".join(found)
