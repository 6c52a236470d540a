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

A discrete choice has no rounding to be close in: where the fp32 reference's top-k (an MoE router) is within
rounding of choosing otherwise, a correct candidate may choose the other way, and then sits far from the fp32
result on that token (on an H200, olmoe-16l's fused step at one decode input: 0.077 of scale from the fp32 graph,
which the bf16 graph was 0.012 from). So the upcast graph's top-k records how near each choice was to the other
way (``Decisions``), and a candidate that is not close to the fp32 result may be close (within the bound itself)
to the fp32 result with the nearest of those choices taken the other way (``alternatives``). A wrong kernel is
far from every one of them; a choice that was not near a tie is never taken the other way.
"""
from __future__ import annotations

import copy

import torch
import torch.fx

LOW = (torch.bfloat16, torch.float16)
TIE_REL = 2.0 ** -6  # a top-k choice is near a tie when its margin is within this of the row's largest |value|
SINGLES, PAIRS_OF = 12, 4  # the nearest ties tried one at a time, and the nearest whose pairs are tried
MAX_NEAR = 24  # more near ties than this (a prefill of many tokens): no alternative is tried, the first opinion stands
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
    out = torch.fx.GraphModule(gm, graph)
    decisions = Decisions()
    for n in list(out.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.topk.default:
            name = f"_tkcc_topk_{len(decisions.nodes)}"
            decisions.nodes.append(name)
            out.add_submodule(name, TopK(name, decisions))
            n.op, n.target = "call_module", name
    out.recompile()
    out._tkcc_decisions = decisions
    return out


class Decisions:
    """The top-k choices of one run of an upcast graph: ``near`` lists those within ``TIE_REL`` of the other way
    as (margin / row scale, node, row); ``flip`` names the (node, row) choices the next run takes the other way."""

    def __init__(self):
        self.nodes: list[str] = []
        self.near: list[tuple[float, str, int]] = []
        self.flip: frozenset = frozenset()


class TopK(torch.nn.Module):
    """``aten.topk`` that records its near ties and, per ``Decisions.flip``, swaps a row's k-th choice for its
    (k+1)-th (values sorted, as a sorted top-k returns them)."""

    def __init__(self, name: str, decisions: Decisions):
        super().__init__()
        self.name, self.decisions = name, decisions

    def forward(self, x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 - aten.topk's own argument names
        if k < 1 or k >= x.shape[dim]:
            return torch.topk(x, k, dim, largest, sorted)
        v, i = torch.topk(x, k + 1, dim, largest, True)
        v, i = v.movedim(dim, -1).contiguous(), i.movedim(dim, -1).contiguous()
        rows_v, rows_i = v.view(-1, k + 1), i.view(-1, k + 1)
        scale = x.detach().abs().movedim(dim, -1).reshape(-1, x.shape[dim]).amax(-1).clamp_min(1e-30)
        margin = ((rows_v[:, k - 1] - rows_v[:, k]).abs() / scale).float()
        for r in (margin <= TIE_REL).nonzero().flatten().tolist():
            self.decisions.near.append((float(margin[r]), self.name, r))
        for node, r in self.decisions.flip:
            if node == self.name and r < rows_v.shape[0]:
                rows_v[r, [k - 1, k]] = rows_v[r, [k, k - 1]]
                rows_i[r, [k - 1, k]] = rows_i[r, [k, k - 1]]
        return v[..., :k].movedim(-1, dim), i[..., :k].movedim(-1, dim)


def decisions_of(exact_fn) -> Decisions | None:
    return getattr(exact_fn, "_tkcc_decisions", None)


def alternatives(near: list[tuple[float, str, int]]) -> list[frozenset]:
    """The runs to try with choices taken the other way, nearest first: each of the ``SINGLES`` nearest ties alone,
    each pair of the ``PAIRS_OF`` nearest, then all of them. On an H200, olmoe-16l's decode step had 6-11 choices
    within ``TIE_REL`` over its 16 routers, its top-2 margins 0.0002-0.004 of scale. None past ``MAX_NEAR``: a
    prefill of many tokens has that many, a candidate takes some of them the other way, and which is not known."""
    if len(near) > MAX_NEAR:
        return []
    keys = [(node, r) for _, node, r in sorted(near)]
    out = [frozenset({k}) for k in keys[:SINGLES]]
    out += [frozenset({a, b}) for i, a in enumerate(keys[:PAIRS_OF]) for b in keys[i + 1:PAIRS_OF]]
    if len(keys) > 1 and frozenset(keys) not in out:
        out.append(frozenset(keys))
    return out


def describe(flip: frozenset, near: list[tuple[float, str, int]]) -> str:
    margins = {(node, r): m for m, node, r in near}
    return ", ".join(f"{node} row {r} (margin {margins.get((node, r), float('nan')):.2g} of its scale)"
                     for node, r in sorted(flip))


def _floating(n: torch.fx.Node) -> bool:
    v = n.meta.get("val", n.meta.get("tensor_meta"))
    dtype = getattr(v, "dtype", None)
    return dtype is not None and dtype.is_floating_point


def closer_to_exact(ref: list[torch.Tensor], out: list[torch.Tensor], exact: list[torch.Tensor],
                    bound: float, strict: bool = False) -> tuple[bool, str]:
    """(ok, what was found): per floating output that is past ``bound`` of the low-precision reference, is the
    candidate within ``bound`` of the fp32 result, or no farther from it than the reference is (scale: the fp32
    result's largest |value|)? ``strict``: within ``bound`` only (an fp32 result with a choice taken the other way,
    which the reference did not take, so its distance from it says nothing)."""
    from tkcc.runtime.validation import scaled_error

    found = []
    for i, (r, o, x) in enumerate(zip(ref, out, exact)):
        if not (o.is_floating_point() and x.is_floating_point()) or scaled_error(r, o)[2] <= bound:
            continue
        cand, own = scaled_error(x, o)[2], scaled_error(x, r)[2]
        found.append(f"output {i}: {cand:.3g} of scale from the fp32 reference, the reference itself {own:.3g}")
        if cand > (bound if strict else max(bound, own)):
            return False, "against the reference run in fp32: " + "; ".join(found)
    return True, "judged against the reference run in fp32: " + "; ".join(found)
