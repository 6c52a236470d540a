"""Find a module's region in an exported aten graph and replace it with one call.

torch.export records on every node the stack of modules it ran under
(``nn_module_stack``), so "every node of ``lm.model.layers.3.mlp``" is a
well-defined region. A region of a module call is contiguous, takes its inputs
from nodes defined before it and parameters through ``get_attr``; replacing it
by one ``call_function`` that takes those inputs and the module's weights is
a robust rewrite that needs no pattern for each model family's aten spelling.
"""
from __future__ import annotations

import re

import torch
import torch.fx

from tkcc.errors import PassError
from tkcc.passes.graph_pass import origin


def module_paths(gm: torch.fx.GraphModule, pattern: str) -> dict[str, str]:
    """{module path: module type name} of every module in the stacks matching the regex ``pattern``."""
    rx = re.compile(pattern)
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        for path, typ in (n.meta.get("nn_module_stack") or {}).values():
            if rx.search(path) and path not in out:
                out[path] = typ if isinstance(typ, str) else getattr(typ, "__qualname__", str(typ))
    return out


def region_nodes(gm: torch.fx.GraphModule, path: str) -> list[torch.fx.Node]:
    """Nodes run under module ``path`` (or below it), in graph order."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")
            and any(p == path for p, _t in (n.meta.get("nn_module_stack") or {}).values())]


def region_io(nodes: list[torch.fx.Node]) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """(inputs: outside nodes the region reads, excluding parameters; outputs: region nodes read outside)."""
    inside = set(nodes)
    ins: list[torch.fx.Node] = []
    outs: list[torch.fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a.op != "get_attr" and a not in ins:
                ins.append(a)
        if any(u not in inside for u in n.users):
            outs.append(n)
    return ins, outs


def resolve_module(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """The module at an exported path such as ``lm.model.layers.0.mlp`` (prefixes the wrapper added are dropped)."""
    parts = path.split(".")
    for i in range(len(parts)):
        try:
            return model.get_submodule(".".join(parts[i:]))
        except AttributeError:
            continue
    raise PassError(f"module {path!r} from the graph's nn_module_stack is not in {type(model).__name__}")


def param_node(gm: torch.fx.GraphModule, target: str, before: torch.fx.Node) -> torch.fx.Node:
    """A get_attr node for ``target`` (reusing an existing one that comes before ``before``)."""
    for n in gm.graph.nodes:
        if n is before:
            break
        if n.op == "get_attr" and n.target == target:
            return n
    try:
        obj = gm
        for part in target.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise PassError(f"the graph has no attribute {target!r} to read the weight from") from None
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(target)


def weight_target(module_path: str, name: str) -> str:
    """The get_attr target of parameter ``name`` of the module at ``module_path`` (export keeps qualified names)."""
    return f"{module_path}.{name}"


def replace_region(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], fn, args: tuple, kwargs=None,
                   phase: str = "", info=None) -> torch.fx.Node:
    """Replace a one-output region by ``fn(*args, **kwargs)`` inserted where the region began."""
    ins, outs = region_io(nodes)
    if len(outs) != 1:
        raise PassError(f"region starting at {nodes[0].name} has {len(outs)} outputs; expected 1")
    with gm.graph.inserting_before(nodes[0]):
        new = gm.graph.call_function(fn, tuple(args), dict(kwargs or {}))
    new.meta["val"] = outs[0].meta.get("val")
    new.meta["nn_module_stack"] = dict(nodes[0].meta.get("nn_module_stack") or {})
    origin(new, *nodes)
    outs[0].replace_all_uses_with(new)
    erase_dead(gm, nodes)
    if info is not None:
        info.matched += 1
        info.replaced += 1
        info.provenance[f"{phase}:{new.name}" if phase else new.name] = [n.name for n in nodes]
    return new


def erase_dead(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> None:
    """Erase the given nodes (and get_attr nodes left unused), last first; nodes still used are kept."""
    for n in reversed(nodes):
        if not n.users:
            gm.graph.erase_node(n)
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:
            gm.graph.erase_node(n)
