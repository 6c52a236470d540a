"""Which aten ops a fused Triton kernel computes, how, and which of them keep eager's bits.

One table, one entry per op: its kind (pointwise, row reduction, softmax,
cast), whether it is *exact* (correctly rounded in IEEE arithmetic, so the
kernel gives eager's bits when every op computes in fp32 and rounds to the
op's dtype, as eager's ``opmath`` does; sqrt is not, as eager CPU computes it
with Sleef to 0.5001 ulp) and its lowering to a Triton
expression. Transcendentals (exp, rsqrt, sigmoid, tanh, erf, pow by a
non-integer) and reductions (sum order) are not exact: Triton's fast math and
tree reductions differ from eager in the last bits.

A lowering gets a ``Lowering`` context: ``c.f(arg)`` is the arg as an fp32
tile expression, ``c.raw(arg)`` as held, ``c.line(text)`` adds a statement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
TL_DTYPE = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
            torch.bool: "tl.int1", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.int8: "tl.int8",
            torch.int16: "tl.int16", torch.uint8: "tl.uint8"}


@dataclass(frozen=True)
class OpRule:
    kind: str  # "pointwise" | "reduction" | "softmax" | "cast" | "compare" | "view"
    exact: bool
    lower: Callable  # (Lowering, node) -> expression (fp32 tile, or int1 for compares)


def op_name(target) -> str:
    """``add`` for ``aten.add.Tensor``; '' for non-aten callables."""
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target._schema.name.split("::")
        return name if ns in ("aten", "prims") else ""
    return ""


def _bin(sym):
    return lambda c, n: f"({c.f(n.args[0])} {sym} {c.f(n.args[1])})"


def _div(c, n):
    if c.exact:
        return f"tl.div_rn({c.ft(n.args[0])}, {c.ft(n.args[1])})"
    return f"({c.f(n.args[0])} / {c.f(n.args[1])})"


def _sqrt(c, x):
    return f"tl.sqrt_rn({x})" if c.exact else f"tl.sqrt({x})"


def _pow(c, n):
    x, e = c.f(n.args[0]), float(n.args[1])
    if e == 1.0:
        return x
    if e == 2.0:
        return f"({x} * {x})"
    if e == 3.0:
        return f"({x} * {x} * {x})"
    if e == 0.5:
        return _sqrt(c, x)
    if e == -1.0:
        return f"tl.div_rn({c.ft(1.0)}, {x})" if c.exact else f"(1.0 / {x})"
    if e == -2.0:
        return f"tl.div_rn({c.ft(1.0)}, {x} * {x})" if c.exact else f"(1.0 / ({x} * {x}))"
    if e == -0.5:
        return f"tl.rsqrt({x})"
    return f"tl.exp2({c.lit(e)} * tl.log2({x}))"


def _pow_exact(n) -> bool:
    """Exponents whose eager result is the same on every device. PyTorch's CUDA kernel computes pow by 3
    and by -2 in the storage type (bf16/fp16: ``base * base`` is rounded before the next step) while the CPU
    kernel computes in float, so no single fused expression matches both bit for bit (seen on an H200)."""
    return float(n.args[1]) in (1.0, 2.0, -1.0)


def _pow_ok(n) -> str | None:
    e = n.args[1] if len(n.args) > 1 else None
    if not isinstance(e, (int, float)) or isinstance(e, bool):
        return "pow exponent is not a Python number"
    e = float(e)
    if e in (1.0, 2.0, 3.0, 0.5, -1.0, -2.0, -0.5):
        return None
    if e.is_integer():
        return f"pow by integer {e:g} (exp2/log2 would be wrong for negative bases)"
    return None


def _gelu(c, n):
    x = c.f(n.args[0])
    approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
    if approx == "tanh":
        return f"(0.5 * {x} * (1.0 + _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))))"
    return f"(0.5 * {x} * (1.0 + tl.math.erf({x} * 0.7071067811865476)))"


def _where(c, n):
    return f"tl.where({c.cond(n.args[0])}, {c.f(n.args[1])}, {c.f(n.args[2])})"


def _masked_fill(c, n):
    return f"tl.where({c.cond(n.args[1])}, {c.f(n.args[2])}, {c.f(n.args[0])})"


def _cmp(sym):
    return lambda c, n: f"({c.cmp_arg(n.args[0], n.args[1])} {sym} {c.cmp_arg(n.args[1], n.args[0])})"


def _row_sum(c, n):
    return f"tl.sum(tl.where(mask, {c.f(n.args[0])}, 0.0), axis=1, keep_dims=True)"


def _mean(c, n):
    return f"({_row_sum(c, n)} / n_cols)"


def _amax(c, n):
    return f"tl.max(tl.where(mask, {c.f(n.args[0])}, float('-inf')), axis=1, keep_dims=True)"


def _softmax(c, n):
    x = c.f(n.args[0])
    m = c.tmp("m")
    e = c.tmp("e")
    c.line(f"{m} = tl.max(tl.where(mask, {x}, float('-inf')), axis=1, keep_dims=True)")
    c.line(f"{e} = tl.where(mask, tl.exp({x} - {m}), 0.0)")
    return f"({e} / tl.sum({e}, axis=1, keep_dims=True))"


def _maximum(c, n):
    return f"tl.maximum({c.f(n.args[0])}, {c.f(n.args[1])}, propagate_nan=tl.PropagateNan.ALL)"


def _minimum(c, n):
    return f"tl.minimum({c.f(n.args[0])}, {c.f(n.args[1])}, propagate_nan=tl.PropagateNan.ALL)"


def _unary(fmt):
    return lambda c, n: fmt.format(x=c.f(n.args[0]))


RULES: dict[str, OpRule] = {
    # correctly rounded: eager's bits when computed in fp32 and rounded per op
    "add": OpRule("pointwise", True, _bin("+")),
    "sub": OpRule("pointwise", True, _bin("-")),
    "rsub": OpRule("pointwise", True, lambda c, n: f"({c.f(n.args[1])} - {c.f(n.args[0])})"),
    "mul": OpRule("pointwise", True, _bin("*")),
    "div": OpRule("pointwise", True, _div),
    "neg": OpRule("pointwise", True, _unary("(-{x})")),
    "abs": OpRule("pointwise", True, _unary("tl.abs({x})")),
    # sqrt: IEEE on CUDA, but eager CPU uses Sleef (0.5001 ulp), so not exact
    "sqrt": OpRule("pointwise", False, lambda c, n: _sqrt(c, c.f(n.args[0]))),
    "reciprocal": OpRule("pointwise", True, lambda c, n: f"tl.div_rn({c.ft(1.0)}, {c.f(n.args[0])})" if c.exact
                         else f"(1.0 / {c.f(n.args[0])})"),
    "pow": OpRule("pointwise", True, _pow),  # exactness per exponent: see _pow_exact
    "where": OpRule("pointwise", True, _where),
    "masked_fill": OpRule("pointwise", True, _masked_fill),
    "clone": OpRule("pointwise", True, _unary("{x}")),
    "eq": OpRule("compare", True, _cmp("==")),
    "ne": OpRule("compare", True, _cmp("!=")),
    "lt": OpRule("compare", True, _cmp("<")),
    "le": OpRule("compare", True, _cmp("<=")),
    "gt": OpRule("compare", True, _cmp(">")),
    "ge": OpRule("compare", True, _cmp(">=")),
    # views that only add or drop leading size-1 dims: the same elements in the same order (``leading_ones``)
    "view": OpRule("view", True, lambda c, n: c.f(n.args[0])),
    "reshape": OpRule("view", True, lambda c, n: c.f(n.args[0])),
    "_unsafe_view": OpRule("view", True, lambda c, n: c.f(n.args[0])),
    "unsqueeze": OpRule("view", True, lambda c, n: c.f(n.args[0])),
    "squeeze": OpRule("view", True, lambda c, n: c.f(n.args[0])),
    "to": OpRule("cast", True, lambda c, n: c.f(n.args[0])),
    "_to_copy": OpRule("cast", True, lambda c, n: c.f(n.args[0])),
    "convert_element_type": OpRule("cast", True, lambda c, n: c.f(n.args[0])),
    # not correctly rounded (fast math / different formulas): tolerance variant only
    "exp": OpRule("pointwise", False, _unary("tl.exp({x})")),
    "log": OpRule("pointwise", False, _unary("tl.log({x})")),
    "rsqrt": OpRule("pointwise", False, _unary("tl.rsqrt({x})")),
    "sigmoid": OpRule("pointwise", False, _unary("tl.sigmoid({x})")),
    "silu": OpRule("pointwise", False, _unary("({x} * tl.sigmoid({x}))")),
    "tanh": OpRule("pointwise", False, _unary("_tanh({x})")),
    "gelu": OpRule("pointwise", False, _gelu),
    "relu": OpRule("pointwise", False, _unary("tl.where({x} < 0.0, 0.0, {x})")),
    "sin": OpRule("pointwise", False, _unary("tl.sin({x})")),
    "cos": OpRule("pointwise", False, _unary("tl.cos({x})")),
    "maximum": OpRule("pointwise", False, _maximum),
    "minimum": OpRule("pointwise", False, _minimum),
    # row-wise normalisation pieces: reductions over the last dim
    "mean": OpRule("reduction", False, _mean),
    "sum": OpRule("reduction", False, _row_sum),
    "amax": OpRule("reduction", False, _amax),
    "softmax": OpRule("softmax", False, _softmax),
    "_softmax": OpRule("softmax", False, _softmax),
}

NORM_KINDS = ("reduction", "softmax")


def _val(x):
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else None


def check_node(node: torch.fx.Node, *, exact: bool, include_norms: bool) -> tuple[OpRule | None, str]:
    """The rule for a node a fused kernel can compute, or (None, why not)."""
    if node.op != "call_function":
        return None, "not a call_function"
    name = op_name(node.target)
    rule = RULES.get(name)
    if rule is None:
        return None, f"op {node.target} has no fused lowering"
    val = _val(node)
    if not isinstance(val, torch.Tensor):
        return None, "output is not a single tensor"
    if val.dtype not in FLOATS and not (rule.kind == "compare" and val.dtype == torch.bool):
        return None, f"output dtype {val.dtype}"
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, torch.fx.Node):
            av = _val(a)
            if not isinstance(av, torch.Tensor) or av.dtype not in TL_DTYPE:
                return None, f"input {a.name} is not a supported tensor"
            if av.dtype not in FLOATS and av.dtype != torch.bool and rule.kind not in ("cast", "compare"):
                return None, f"integer input {a.name} to {name}"
        elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a):
            return None, "a list of tensors as argument"
    if rule.kind == "cast":
        why = _cast_ok(node, val, exact)
        if why:
            return None, why
    if rule.kind == "view":
        why = _view_ok(node, name)
        if why:
            return None, why
    if rule.kind in NORM_KINDS:
        if exact:
            return None, f"{name} reduces in a different order than eager (not exact)"
        if not include_norms:
            return None, "normalisations excluded (include_norms=False)"
        why = _reduction_ok(node, name)
        if why:
            return None, why
    if name in ("add", "sub", "rsub") and node.kwargs.get("alpha", 1) != 1:
        return None, "alpha != 1 (eager may contract it into an FMA)"
    if name in ("add", "sub", "rsub") and len(node.args) > 2 and node.args[2] != 1:
        return None, "alpha != 1 (eager may contract it into an FMA)"
    if name == "div" and node.kwargs.get("rounding_mode") is not None:
        return None, "div with a rounding mode"
    if exact and name == "div" and len(node.args) > 1 and not isinstance(node.args[1], torch.fx.Node):
        # PyTorch's CUDA kernel divides by a scalar as a * (1 / b), the CPU kernel as a / b: the two round
        # differently, so no single fused expression is bit-exact on both (seen on an H200, fp32)
        return None, "div by a scalar rounds differently on CPU and CUDA eager"
    if name == "pow":
        if op_overload(node) != "Tensor_Scalar":
            return None, "pow with a tensor exponent"
        why = _pow_ok(node)
        if why:
            return None, why
        if exact and not _pow_exact(node):
            return None, f"pow by {node.args[1]} is not correctly rounded"
    if name == "gelu" and node.kwargs.get("approximate", "none") not in ("none", "tanh"):
        return None, "gelu approximation"
    if exact and not rule.exact:
        return None, f"{name} is not correctly rounded in Triton (tolerance variant only)"
    return rule, ""


def _view_ok(node, name) -> str | None:
    if op_overload(node) not in ("default", "dim", "dims"):
        return f"{name}.{op_overload(node)}"  # view.dtype reinterprets the bits: never fused
    if leading_ones(node) is None:
        return f"{name} changes more than leading size-1 dims"
    if len(node.users) != 1 or not isinstance(node.args[0], torch.fx.Node) or len(node.args[0].users) != 1:
        # only a link of one chain (one value, one reader): a view of a value every layer reads (the rotary table)
        # would join the first layer's group when a tier has one layer and not when it has more, and the two tiers
        # would then run different kernels
        return f"{name} of a value read elsewhere, or read by more than one node"
    return None


def leading_ones(node) -> tuple[int, int] | None:
    """For a view whose input and output differ only in leading size-1 dims: how many the input has before the
    first other dim, and how many the output has (the reference writes the view from these, so that it holds at
    any size of the other dims); else None. Such a view keeps every element in its place, right-aligned, which is
    how a fused kernel indexes every operand."""
    src, out = _val(node.args[0]), _val(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or src.dtype != out.dtype:
        return None
    try:
        a, b = [int(d) for d in src.shape], [int(d) for d in out.shape]
    except (TypeError, ValueError):  # a symbolic size
        return None

    def strip(s):
        k = 0
        while k < len(s) and s[k] == 1:
            k += 1
        return k

    p, q = strip(a), strip(b)
    return (p, q) if a[p:] == b[q:] else None


def op_overload(node) -> str:
    return node.target._overloadname if isinstance(node.target, torch._ops.OpOverload) else ""


def _cast_ok(node, val, exact) -> str | None:
    src = _val(node.args[0])
    name = op_name(node.target)
    allowed_kw = {"dtype", "layout", "device", "non_blocking", "copy", "memory_format", "pin_memory"}
    if set(node.kwargs) - allowed_kw:
        return f"cast keywords {sorted(set(node.kwargs) - allowed_kw)}"
    if name == "to" and op_overload(node) not in ("dtype", "dtype_layout", "device"):
        return f"to.{op_overload(node)}"
    if src is None or src.device != val.device:
        return "cast changes device"
    if src.dtype not in FLOATS and exact and val.dtype != torch.float32:
        return "integer to half/bfloat16 cast rounds twice through fp32"
    return None


def _reduction_ok(node, name) -> str | None:
    x = _val(node.args[0])
    nd = x.dim()
    if nd == 0:
        return "reduction of a 0-d tensor"
    if name in ("softmax", "_softmax"):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if name == "softmax" and (node.kwargs.get("dtype") or (len(node.args) > 2 and node.args[2] is not None)):
            return "softmax with a dtype"
        if name == "_softmax" and len(node.args) > 2 and node.args[2]:
            return "_softmax(half_to_float=True)"
        dims = [dim]
        keep = True
    else:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if node.kwargs.get("dtype") is not None:
            return f"{name} with a dtype"
        if op_overload(node) not in ("dim", "dim_IntList", "default"):
            return f"{name}.{op_overload(node)}"
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not isinstance(dims[0], int):
        return f"{name} over dims {dims!r} (only the last dim fuses)"
    if dims[0] % nd != nd - 1:
        return f"{name} over dim {dims[0]} (only the last dim fuses)"
    if not keep:
        return f"{name} without keepdim"
    return None
