"""FX nodes -> readable Python lines, for generated forwards and kernel references.

In the kernel library because both writers need it: the fused kernels' references (``rowwise``) and
codegen's forwards (``tkcc.codegen.forward_source``).

Why not ``GraphModule.code``: FX's source leans on globals it injects at
run time (its own wrappers, callables it cannot import). Generated source
must import everything it uses, so a fresh process can run it. Each call is
spelled as an importable path (``torch.ops.aten.add.Tensor``,
``operator.getitem``); a callable that cannot be spelled that way and is not
a generated kernel is refused with the node that uses it.
"""
from __future__ import annotations

import builtins
import keyword
import math
import operator
import re

import torch
import torch.fx

from tkcc.errors import ArtifactError

_IMPORTABLE_ROOTS = {"torch", "operator", "math", "builtins", "_operator"}
# tkcc's kernel library: graph-callable ops (fused kernel or eager reference) that a generated forward may
# call; it needs torch and triton, never the compiler (tkcc.passes, tkcc.frontend)
RUNTIME_PACKAGES = ("tkcc.kernels",)


def safe_name(name: str, taken: set[str]) -> str:
    """A Python identifier derived from ``name`` and not in ``taken`` (which it joins)."""
    base = re.sub(r"\W", "_", name) or "v"
    if base[0].isdigit() or keyword.iskeyword(base) or hasattr(builtins, base) or base in ("torch", "triton", "tl"):
        base = f"v_{base}"
    out, i = base, 1
    while out in taken:
        out, i = f"{base}_{i}", i + 1
    taken.add(out)
    return out


def literal(value, names: dict, imports: set[str]) -> str:
    """Python source for one argument value (nodes become their variable names)."""
    if isinstance(value, torch.fx.Node):
        return names[value]
    if isinstance(value, (list, tuple)):
        inner = [literal(v, names, imports) for v in value]
        if isinstance(value, tuple):
            return "(" + ", ".join(inner) + ("," if len(inner) == 1 else "") + ")"
        return "[" + ", ".join(inner) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k, names, imports)}: {literal(v, names, imports)}" for k, v in value.items()) + "}"
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return f"float({str(value)!r})"
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, (torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, slice):
        return f"slice({literal(value.start, names, imports)}, {literal(value.stop, names, imports)}, " \
               f"{literal(value.step, names, imports)})"
    if value is Ellipsis:
        return "..."
    raise ArtifactError(f"cannot write argument {value!r} of type {type(value).__name__} as source")


def target_source(target, imports: set[str], where: str) -> str:
    """The importable spelling of a call_function target; ``imports`` gains what it needs."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        imports.add("torch")
        ns = str(target).split(".")[0]
        if ns not in ("aten", "prims"):
            imports.add(f"#requires torch.ops.{ns}")
        return f"torch.ops.{target}"
    if target.__class__.__name__ == "HigherOrderOperator" or isinstance(target, torch._ops.HigherOrderOperator):
        raise ArtifactError(f"{where}: higher-order operator {target} is not supported by codegen yet")
    module = getattr(target, "__module__", None) or ""
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if module in ("_operator",):
        module = "operator"
    root = module.split(".")[0]
    if qual and any(module == p or module.startswith(p + ".") for p in RUNTIME_PACKAGES):
        import importlib

        if getattr(importlib.import_module(module), qual, None) is target:
            imports.add(module)
            return f"{module}.{qual}"
    if qual and root in _IMPORTABLE_ROOTS:
        path = f"{module}.{qual}" if module != "builtins" else qual
        obj = _lookup(path)
        if obj is target or obj == target:
            if root != "builtins":
                imports.add(root)
            return path
    raise ArtifactError(
        f"{where}: calls {target!r} (module {module or '?'}), which a generated forward cannot import without "
        f"the compiler; only torch/operator/math callables, tkcc generated kernels and {RUNTIME_PACKAGES} can be "
        f"emitted")


def _lookup(path: str):
    parts = path.split(".")
    mods = {"torch": torch, "operator": operator, "math": math}
    if parts[0] not in mods:
        obj = getattr(builtins, parts[0], None)
    else:
        obj = mods[parts[0]]
    try:
        for p in parts[1:]:
            obj = getattr(obj, p)
    except AttributeError:
        return None
    return obj


def call_source(node: torch.fx.Node, fn: str, names: dict, imports: set[str]) -> str:
    """``fn(arg0, ..., key=value)`` for a node's args and kwargs."""
    parts = [literal(a, names, imports) for a in node.args]
    parts += [f"{k}={literal(v, names, imports)}" for k, v in node.kwargs.items()]
    return f"{fn}({', '.join(parts)})"


def import_lines(imports: set[str]) -> list[str]:
    return [f"import {m}" for m in sorted(i for i in imports if not i.startswith("#"))]
