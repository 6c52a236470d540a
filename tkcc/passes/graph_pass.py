"""GraphPass: a Pass written as a rewrite of one FX graph, applied to every phase.

Most passes look at one graph at a time; subclass this, implement
``rewrite(gm, info, phase, **params)`` and edit ``gm.graph`` in place. The
PassManager hands every pass graphs that are already copies (parameters
shared, graph structure fresh), so editing in place never touches the
Program the pass was given by its caller.

``clone_graph_module`` is that copy: a new GraphModule over a deep copy of
the graph, reaching the very same parameter and buffer tensors.
"""
from __future__ import annotations

import copy

import torch
import torch.fx

from tkcc.passes.base import Pass, RewriteInfo

# Attributes of GraphModule subclasses (torch.export's unlifted module) that
# generated code or callers read; carried over to the copy.
_CARRY = ("_in_spec", "_out_spec", "range_constraints", "shape_env", "validate_inputs")


def clone_graph_module(gm: torch.fx.GraphModule, cls=torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Same tensors, same submodules, fresh graph: safe to edit in place. ``cls``: the GraphModule class of the
    copy (the PassManager's is lazy: no Python generated until it is run or read)."""
    graph = copy.deepcopy(gm.graph)
    new = cls(gm, graph, class_name=type(gm).__name__)
    for name in _CARRY:
        if name in gm.__dict__ and name not in new.__dict__:
            new.__dict__[name] = gm.__dict__[name]
    # submodules referenced by call_module (and anything else on the root) stay reachable
    for name, child in gm.named_children():
        if not hasattr(new, name):
            new.add_module(name, child)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


def origin(node: torch.fx.Node, *sources: torch.fx.Node) -> torch.fx.Node:
    """Record on a new node the node(s) it came from (read by the PassManager into the log)."""
    names = list(node.meta.get("tkcc_from", []))
    for s in sources:
        for n in s.meta.get("tkcc_from", []) or [s.name]:
            if n not in names:
                names.append(n)
    node.meta["tkcc_from"] = names
    return node


class GraphPass(Pass):
    """A Pass that rewrites each phase graph independently."""

    def rewrite(self, gm: torch.fx.GraphModule, info: RewriteInfo, phase: str, **params) -> None:
        raise NotImplementedError

    def apply(self, program, **params):
        info = RewriteInfo()
        graphs = {}
        for phase, gm in program.graphs.items():
            self.rewrite(gm, info, phase, **params)
            gm.recompile()
            graphs[phase] = gm
        return program.with_graphs(graphs), info
