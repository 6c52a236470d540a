"""Whole-graph capture with ``torch.export`` (non-strict), cleaned into a plain GraphModule.

Why non-strict export: it traces the model by running its Python code on fake
tensors, so it gives one aten-level graph per call whenever the model's tensor
program does not depend on tensor *values*, keeps ``nn_module_stack`` on every
node (the layer map) and reads parameters without copying them. The graph it
returns is cleaned so that other parts of tkcc see a plain ``GraphModule``:

- positional tensor inputs named after the forward's arguments, no pytree
  flattening code and no ``_in_spec``/``_out_spec`` (generated source runs in
  a fresh process without them);
- no ``_guards_fn`` submodule and no input-checking pre-hook (callers build
  inputs through ``Program.make_inputs``);
- no ``aten._assert_tensor_metadata`` / ``aten._assert_scalar`` checks that
  export leaves behind (they check what capture already established).

In-place ops on buffers (the static KV cache writes) stay in the graph: the
graph mutates the very tensors the model holds.
"""
from __future__ import annotations

import contextlib
import io
import operator
import sys

import torch
import torch.fx

# Check-only ops that export inserts; removing them does not change any result.
_CHECK_OPS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "sym_constrain_range"}


def export_graph(module: torch.nn.Module, args: tuple, dynamic_shapes=None, what: str = "model",
                 failure=None) -> tuple[torch.fx.GraphModule, object]:
    """Export ``module(*args)`` as one graph. Returns (graph module, output pytree spec).

    Raises CaptureError listing every graph break when the module cannot be
    captured whole; ``failure(exc) -> CaptureError`` builds the error instead
    (a library model's, which names tkcc's frame rather than lines to rewrite).
    """
    # torch.export prints the partial graph of a failed export to stderr; our error summarises it instead.
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ep = torch.export.export(module, tuple(args), dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:  # noqa: BLE001 - any export failure is turned into a CaptureError
        partial = str(getattr(exc, "partial_fx_graph", "") or "")
        sys.stderr.write(err.getvalue().replace(partial, "") if partial else err.getvalue())
        if failure is not None:
            raise failure(exc) from exc
        from tkcc.frontend.graph_breaks import capture_error_from_failure

        raise capture_error_from_failure(module, tuple(args), exc, what) from exc
    sys.stderr.write(err.getvalue())
    return clean_exported(ep)


def clean_exported(ep) -> tuple[torch.fx.GraphModule, object]:
    """An ExportedProgram -> (plain GraphModule sharing its tensors, output spec)."""
    try:
        unlifted = ep.module(check_guards=False)
    except TypeError:  # older torch: no check_guards argument
        unlifted = ep.module()
    out_spec = getattr(unlifted, "_out_spec", None)
    graph = unlifted.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
        elif node.op == "call_function" and _op_name(node.target) in _CHECK_OPS and not node.users:
            graph.erase_node(node)
    _prune_unused_pure(graph)
    graph._codegen = torch.fx.graph.CodeGen()  # plain positional inputs/outputs
    out = graph.find_nodes(op="output")[0]
    leaves = out.args[0]
    if out_spec is not None and out_spec.is_leaf() and isinstance(leaves, (tuple, list)) and len(leaves) == 1:
        out.args = (leaves[0],)
        out_spec = None
    elif out_spec is not None and _is_flat_tuple(out_spec):
        out.args = (tuple(leaves),)
        out_spec = None
    gm = torch.fx.GraphModule(unlifted, graph, class_name=type(unlifted).__name__.replace("Impl", ""))
    gm.graph.lint()
    return gm, out_spec


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", "")


def _is_flat_tuple(spec) -> bool:
    kids = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    return spec.type in (tuple, list) and all(c.is_leaf() for c in kids)


def _prune_unused_pure(graph: torch.fx.Graph) -> None:
    """Drop nodes left without users by the check removal, keeping every mutation.

    Conservative on purpose (fx's own DCE rules differ between torch versions):
    only symbolic-size arithmetic and functional aten ops are dropped.
    """
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.users or node.op != "call_function":
                continue
            t = node.target
            pure = (t in (operator.add, operator.sub, operator.mul, operator.floordiv, operator.ge, operator.le,
                          operator.gt, operator.lt, operator.eq, operator.ne, operator.and_, operator.getitem)
                    or _op_name(t) in ("sym_size", "sym_numel", "sym_stride"))
            if isinstance(t, torch._ops.OpOverload) and not t._schema.is_mutable and _op_name(t) in (
                    "sym_size", "sym_numel", "sym_stride", "ge", "le", "eq", "ne", "gt", "lt"):
                pure = True
            if pure:
                graph.erase_node(node)
                changed = True
