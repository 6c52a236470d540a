"""One phase graph -> the readable Python module an artifact ships for it.

The module has one function, ``bind(model, state, constants) -> forward``:
``bind`` looks every parameter and buffer up by qualified name on the
resident model (or the state holding the KV cache), once; ``forward(*inputs)``
is the graph, one line per node, calling aten ops and the artifact's own
kernel modules. No weight is embedded; small tensor constants that belong to
neither model nor state go to ``constants.pt``.

Calls to the decode ops (``tkcc.kernels.ops``: MoE block, RMSNorm, split-KV
attention) are written as ``_ops.<name>(...)``: the generated module then
imports ``tkcc.kernels.ops`` (the kernel runtime, not the compiler), and each
call's ``target`` keyword is recorded so the manifest can name the targets.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from tkcc.kernels import emit
from tkcc.errors import ArtifactError

# Tensors the graph holds that are not parameters/buffers of the model or state
# are embedded only while this small: anything larger is a weight we failed to find.
MAX_CONSTANT_ELEMS = 1 << 16


@dataclass
class ForwardSource:
    source: str
    bindings: list[dict] = field(default_factory=list)  # {var, root, name, shape, dtype, device}
    kernels: dict[str, object] = field(default_factory=dict)  # kernel name -> FusedKernel
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    kernel_calls: list[dict] = field(default_factory=list)  # {kernel, node, shapes, dtypes, strides}: AOT, discovery
    op_calls: list[dict] = field(default_factory=list)  # {op, node, target}: calls to tkcc.kernels.ops
    runtime: list[str] = field(default_factory=list)  # kernel-library modules the forward imports

    @property
    def targets(self) -> set[str]:
        """Kernel targets this forward runs: triton for generated kernels, each op call's own target."""
        return ({"triton"} if self.kernels else set()) | {c["target"] for c in self.op_calls}


OPS_MODULE = "tkcc.kernels.ops"
# registers the ``torch.ops.tkcc`` ops of the lowered decode step (tkcc.passes.lower) and packs weights at bind
LOWERED_MODULE = "tkcc.kernels.lowered"


def _decode_op(t) -> str | None:
    """The name of ``t`` in tkcc.kernels.ops if it is one of the decode ops there, else None."""
    if getattr(t, "__module__", None) != OPS_MODULE:
        return None
    import importlib

    ops = importlib.import_module(OPS_MODULE)
    name = getattr(t, "__name__", "")
    return name if t in ops.OPS and getattr(ops, name, None) is t else None


def _tensor_names(module) -> dict[int, str]:
    out: dict[int, str] = {}
    if module is None:
        return out
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(
            remove_duplicate=False)):
        out.setdefault(id(t), name)
    return out


def _hint(d) -> int:
    """A dim's example value (symbolic dims of dynamic-shape graphs have one)."""
    if isinstance(d, int):
        return d
    node = getattr(d, "node", None)
    hint = getattr(node, "hint", None)
    if hint is not None:
        return int(hint)
    return int(node.shape_env.size_hint(node.expr))


def _fetch(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def emit_forward(gm: torch.fx.GraphModule, phase: str, model, state, header: str) -> ForwardSource:
    """Write ``gm`` as a module with ``bind(model, state, constants) -> forward``.

    Every node is a call of a function (aten, operator, the kernel library's ops and generated kernels):
    a pass lowers to ops, never to an opaque module, so the artifact's source is the whole computation."""
    if type(gm.graph._codegen) is not torch.fx.graph.CodeGen:
        raise ArtifactError(f"phase {phase!r}: graph uses {type(gm.graph._codegen).__name__} (pytree inputs); "
                            "capture through tkcc.frontend, which gives plain positional graphs")
    model_names, state_names = _tensor_names(model), _tensor_names(state)
    out = ForwardSource(source="")
    imports: set[str] = {"torch"}
    taken = {"torch", "operator", "math", "_rt", "_ops", "model", "state", "constants", "bind", "forward"}
    names: dict[torch.fx.Node, str] = {}
    bind_lines: list[str] = []
    body: list[str] = []
    kernel_alias: dict[str, str] = {}
    nodes = list(gm.graph.nodes)
    last_use: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            last_use[a] = n
    freeable: set[torch.fx.Node] = set()
    sig: list[str] = []

    for n in nodes:
        where = f"phase {phase!r}, node {n.name!r}"
        if n.op == "placeholder":
            names[n] = emit.safe_name(str(n.target), taken)
            out.inputs.append(names[n])
            default = f"={emit.literal(n.args[0], names, imports)}" if n.args else ""
            sig.append(names[n] + default)
            freeable.add(n)
            continue
        if n.op == "get_attr" and n.meta.get("tkcc_packed_from"):
            names[n] = emit.safe_name(n.name, taken)
            _packed_binding(gm, n, names[n], model_names, state_names, bind_lines, out, where)
            continue
        if n.op == "get_attr":
            names[n] = emit.safe_name(n.name, taken)
            obj = _fetch(gm, n.target)
            if not isinstance(obj, torch.Tensor):
                raise ArtifactError(f"{where}: get_attr {n.target!r} is a {type(obj).__name__}, not a tensor; "
                                    "codegen does not support submodules (higher-order ops) yet")
            if id(obj) in model_names:
                root, qual = "model", model_names[id(obj)]
            elif id(obj) in state_names:
                root, qual = "state", state_names[id(obj)]
            else:
                if obj.numel() > MAX_CONSTANT_ELEMS:
                    raise ArtifactError(f"{where}: tensor {n.target!r} ({obj.numel()} elements) is not a parameter "
                                        "or buffer of the model or its state; refusing to embed weights")
                root, qual = "constants", n.target
                out.constants[qual] = obj.detach().cpu().clone()
            if root == "constants":
                bind_lines.append(f"{names[n]} = constants[{qual!r}].to({emit.literal(obj.device, names, imports)})")
            else:
                bind_lines.append(f"{names[n]} = _rt.resolve({root}, {qual!r})")
            out.bindings.append({"var": names[n], "root": root, "name": qual, "shape": list(obj.shape),
                                 "dtype": str(obj.dtype), "device": obj.device.type})
            continue
        if n.op == "output":
            body.append(f"return {emit.literal(n.args[0], names, imports)}")
            continue
        names[n] = emit.safe_name(n.name, taken)
        if n.op == "call_function":
            t = n.target
            if getattr(t, "__tkcc_kernel__", False):
                alias = kernel_alias.get(t.name)
                if alias is None:
                    alias = kernel_alias[t.name] = emit.safe_name(f"k_{t.name}", taken)
                    out.kernels[t.name] = t
                call = emit.call_source(n, f"{alias}.launch", names, imports)
                out.kernel_calls.append({"kernel": t.name, "node": n.name, "origin": list(t.origin),
                                         "shapes": [[_hint(d) for d in a.meta["val"].shape] for a in n.args],
                                         "dtypes": [str(a.meta["val"].dtype) for a in n.args],
                                         "strides": [[_hint(d) for d in a.meta["val"].stride()] for a in n.args]})
            elif _decode_op(t):
                call = emit.call_source(n, f"_ops.{_decode_op(t)}", names, imports)
                out.op_calls.append({"op": _decode_op(t), "node": n.name, "target": n.kwargs.get("target", "triton")})
            else:
                call = emit.call_source(n, emit.target_source(t, imports, where), names, imports)
        elif n.op == "call_method":
            self_arg = emit.literal(n.args[0], names, imports)
            rest = [emit.literal(a, names, imports) for a in n.args[1:]]
            rest += [f"{k}={emit.literal(v, names, imports)}" for k, v in n.kwargs.items()]
            call = f"{self_arg}.{n.target}({', '.join(rest)})"
        elif n.op == "call_module":
            if n.target == "_guards_fn" and not n.users:
                body.append("# (export input guard _guards_fn omitted: inputs come from Program.make_inputs)")
                continue
            raise ArtifactError(f"{where}: call_module {n.target!r} ({type(_fetch(gm, n.target)).__name__}) is not "
                                "supported by codegen: a pass lowers a region to function calls (torch.ops, the "
                                "kernel library's ops), not to a module")
        else:
            raise ArtifactError(f"{where}: unknown node kind {n.op!r}")
        body.append(f"{names[n]} = {call}")
        freeable.add(n)
        dead = [names[a] for a in n.all_input_nodes if last_use.get(a) is n and a in freeable]
        if dead:
            body.append(" = ".join(dead) + " = None")

    if "#requires torch.ops.tkcc" in imports:  # the kernel library's own ops: importing it registers them
        imports.discard("#requires torch.ops.tkcc")
        if LOWERED_MODULE not in out.runtime:
            out.runtime.append(LOWERED_MODULE)
    requires = sorted(i[len("#requires "):] for i in imports if i.startswith("#requires "))
    lines = [f'"""{header}"""', "# Generated by tkcc codegen (tkcc/codegen/forward_source.py). Do not edit: the",
             "# artifact manifest holds this file's SHA-256."]
    if requires:
        lines.append(f"# Needs custom ops registered before loading: {', '.join(requires)}")
    lines += emit.import_lines(imports)
    lines.append("")
    lines.append("from . import _rt")
    if out.op_calls:
        lines.append(f"from {OPS_MODULE.rpartition('.')[0]} import ops as _ops  # the decode ops' kernel runtime")
    for line in module_imports(out):
        lines.append(line)
    for kname, alias in sorted(kernel_alias.items()):
        lines.append(f"from .kernels import {kname} as {alias}")
    lines += ["", "", "def bind(model, state, constants):",
              '    """Look up parameters and buffers once; return the forward."""']
    lines += [f"    {x}" for x in bind_lines]
    lines += ["", f"    def forward({', '.join(sig)}):"]
    lines += [f"        {x}" for x in body]
    lines += ["", "    return forward", ""]
    out.source = "\n".join(lines)
    return out


def _packed_binding(gm, n, var: str, model_names: dict, state_names: dict, bind_lines: list, out: ForwardSource,
                    where: str) -> None:
    """A weight the graph holds packed (``tkcc_packed_from``: the get_attr targets of the parameters it stacks
    row-wise, q|k|v or gate|up): rebuilt from the resident model's own parameters when the artifact binds
    (a view when they are packed already), never embedded."""
    srcs = []
    for i, target in enumerate(n.meta["tkcc_packed_from"]):
        t = _fetch(gm, target)
        if id(t) in model_names:
            root, qual = "model", model_names[id(t)]
        elif id(t) in state_names:
            root, qual = "state", state_names[id(t)]
        else:
            raise ArtifactError(f"{where}: packed weight {n.target!r} stacks {target!r}, which is not a parameter of "
                                "the model or its state")
        srcs.append(f"_rt.resolve({root}, {qual!r})")
        out.bindings.append({"var": f"{var}[{i}]", "root": root, "name": qual, "shape": list(t.shape),
                             "dtype": str(t.dtype), "device": t.device.type})
    if LOWERED_MODULE not in out.runtime:
        out.runtime.append(LOWERED_MODULE)
    bind_lines.append(f"{var} = _rt_{LOWERED_MODULE.rsplit('.', 1)[1]}.pack_rows([{', '.join(srcs)}])")


def module_imports(out: ForwardSource) -> list[str]:
    lines = [f"from {m.rpartition('.')[0]} import {m.rpartition('.')[2]} as _rt_{m.rpartition('.')[2]}"
             f"  # kernel library" for m in out.runtime]
    return lines
