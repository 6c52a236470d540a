"""A group of fused FX nodes -> one generated row-wise Triton kernel module, callable in-process.

The fusion pass (``tkcc/passes/fusion.py``) decides *which* nodes form a
group; this module writes the kernel: it lowers each node with the op table in
``triton_ops.py``, renders ``templates/rowwise/rowwise.py.jinja`` inside
``kernel_module.py.jinja`` (kernel + reference + launcher), and returns a
``FusedKernel``: the callable an FX node targets. The same module text is
what an artifact ships, so in-process numerics checks run the very code that
ships. It is part of the kernel library (a kernel beside its reference), so
the pass calls it as it calls any kernel op, and codegen only writes it out.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import jinja2
import torch
import torch.fx

from tkcc.kernels import emit
from tkcc.kernels.triton_ops import FLOATS, RULES, TL_DTYPE, leading_ones, op_name

TEMPLATES = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                          trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def load_source(name: str, src: str):
    """Import generated module text once per process (file named by its content hash)."""
    from tkcc.kernels.render import import_source

    return import_source(f"tkcc_gen_{name}", src)


class FusedKernel:
    """The target of a fused FX node: ``kernel(*inputs) -> tuple of outputs``.

    Carries its module source (``source``), so codegen can write it into an
    artifact; imports it lazily in-process. ``__tkcc_kernel__`` marks the
    protocol codegen looks for: any callable with ``name``, ``source`` and a
    module-level ``launch`` in that source can be emitted the same way.
    """

    __tkcc_kernel__ = True

    def __init__(self, name: str, source: str, spec: dict, origin: list[str]):
        self.name = self.__name__ = self.__qualname__ = name
        self.__module__ = "tkcc.kernels.rowwise"
        self.source, self.spec, self.origin = source, spec, origin
        self._module = None

    @property
    def module(self):
        if self._module is None:
            self._module = load_source(self.name, self.source)
        return self._module

    @property
    def launcher(self):
        return self.module.launch

    def __call__(self, *args):
        return self.module.launch(*args)

    def __repr__(self):
        return f"FusedKernel({self.name})"

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (FusedKernel, (self.name, self.source, self.spec, self.origin))


# ---- shapes ---------------------------------------------------------------------------
def dim_key(d):
    """A dim as something comparable across nodes: an int, or the text of a symbolic size."""
    return int(d) if isinstance(d, int) else str(d)


def shape_keys(node_or_val) -> tuple:
    val = node_or_val.meta["val"] if isinstance(node_or_val, torch.fx.Node) else node_or_val
    return tuple(dim_key(d) for d in val.shape)


def broadcast_keys(shapes) -> tuple | None:
    """Broadcast shape of right-aligned dim keys, or None when they do not broadcast."""
    shapes = list(shapes)
    nd = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(nd):
        ks = {s[len(s) - nd + i] for s in shapes if len(s) - nd + i >= 0} - {1}
        if len(ks) > 1:
            return None
        out.append(ks.pop() if ks else 1)
    return tuple(out)


# ---- lowering ---------------------------------------------------------------------------
class Lowering:
    """State while lowering one group: held variable and dtype per node, emitted lines."""

    def __init__(self, exact: bool, fp32_intermediates: bool):
        self.exact, self.fp32 = exact, fp32_intermediates
        self.lines: list[str] = []
        self.held: dict[torch.fx.Node, tuple[str, torch.dtype]] = {}
        self._tmp = 0
        # eager casts every tensor operand to the op's (common) dtype before computing in fp32: a wider
        # operand (an fp32 0-d tensor in a bf16 op) is rounded first; Python scalars are not (opmath)
        self.round_to: torch.dtype | None = None

    def lit(self, v) -> str:
        if isinstance(v, bool):
            return "1.0" if v else "0.0"
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            return f"float({str(v)!r})"
        return repr(float(v)) if isinstance(v, float) else repr(v)

    def f(self, a) -> str:
        """The arg as an fp32 tile (or a Python scalar literal)."""
        if isinstance(a, torch.fx.Node):
            var, dt = self.held[a]
            if self.round_to is not None and dt == torch.float32:
                return f"{var}.to({TL_DTYPE[self.round_to]}).to(tl.float32)"
            return var if dt == torch.float32 else f"{var}.to(tl.float32)"
        return self.lit(a)

    def ft(self, a) -> str:
        """Like ``f`` but a scalar becomes a (1, 1) fp32 tile (for functions that want tensors)."""
        if isinstance(a, torch.fx.Node):
            return self.f(a)
        return f"tl.full((1, 1), {self.lit(a)}, tl.float32)"

    def cond(self, a) -> str:
        if isinstance(a, torch.fx.Node):
            var, dt = self.held[a]
            return var if dt == torch.bool else f"({var} != 0)"
        return "True" if a else "False"

    def cmp_arg(self, a, other) -> str:
        """A comparison operand; a scalar is first rounded to the tensor's dtype (as eager's type promotion does)."""
        if isinstance(a, torch.fx.Node):
            var, dt = self.held[a]
            return self.f(a) if dt in FLOATS else var
        odt = self.held[other][1] if isinstance(other, torch.fx.Node) else torch.float32
        if isinstance(a, float) and odt in (torch.float16, torch.bfloat16):
            return f"tl.full((1, 1), {self.lit(a)}, tl.float32).to({TL_DTYPE[odt]}).to(tl.float32)"
        return self.lit(a)

    def tmp(self, base: str) -> str:
        self._tmp += 1
        return f"_t{self._tmp}_{base}"

    def line(self, text: str) -> None:
        self.lines.append(text)

    def node(self, n: torch.fx.Node, var: str) -> None:
        rule = RULES[op_name(n.target)]
        dt = n.meta["val"].dtype
        per_op = not self.fp32 and rule.kind in ("pointwise", "reduction", "softmax")
        self.round_to = dt if per_op and dt in (torch.float16, torch.bfloat16) else None
        try:
            expr = rule.lower(self, n)
        finally:
            self.round_to = None
        if rule.kind == "compare":
            self.line(f"{var} = {expr}")
            self.held[n] = (var, torch.bool)
        elif dt == torch.float32 or (self.fp32 and rule.kind != "cast"):
            self.line(f"{var} = {expr}")
            self.held[n] = (var, torch.float32)
        else:
            self.line(f"{var} = ({expr}).to({TL_DTYPE[dt]})")
            self.held[n] = (var, dt)


# ---- the kernel module ------------------------------------------------------------------
def build_kernel(nodes: list[torch.fx.Node], inputs: list[torch.fx.Node], outputs: list[torch.fx.Node], *,
                 exact: bool, fp32_intermediates: bool, block_elems: int, num_warps: int) -> FusedKernel:
    """Write the kernel module for a group: ``nodes`` in graph order, ``inputs`` from outside, ``outputs`` escaping."""
    shapes = [shape_keys(n) for n in nodes] + [shape_keys(i) for i in inputs]
    S = broadcast_keys(shapes)
    if S is None:
        raise ValueError(f"group shapes do not broadcast: {shapes}")
    nd = len(S)
    taken: set[str] = {"rows", "cols", "mask", "r", "c", "n_rows", "n_cols", "reference", "launch", "SPEC", "BLOCK_R",
                       "BLOCK_C", "_rt", "_tanh"}
    taken |= {f"i{d}" for d in range(8)} | {f"size{d}" for d in range(8)} | {f"out{k}" for k in range(len(outputs))}
    # positional names, not node names: the same computation in every layer is one kernel (one JIT compile)
    in_names = [emit.safe_name(f"in{k}", taken) for k in range(len(inputs))]
    var = {n: emit.safe_name(f"v{k}", taken) for k, n in enumerate(nodes)}
    ptr_args = [f"{a}_ptr" for a in in_names] + [f"out{k}_ptr" for k in range(len(outputs))]
    stride_args = [f"{a}_s{d}" for a in in_names for d in range(nd)]
    stride_args += [f"out{k}_s{d}" for k in range(len(outputs)) for d in range(nd)]

    low = Lowering(exact, fp32_intermediates)
    loads = []
    for node, a in zip(inputs, in_names):
        roff = " + ".join(f"i{d} * {a}_s{d}" for d in range(nd - 1)) if nd > 1 else "rows * 0"
        loads.append(f"{a} = tl.load({a}_ptr + ({roff})[:, None] + c * {a}_s{nd - 1}, mask=mask, other=0)")
        low.held[node] = (a, node.meta["val"].dtype)
    for n in nodes:
        low.node(n, var[n])
        low.lines[-1] += f"  # {n.target}"

    stores, out_spec = [], []
    for k, o in enumerate(outputs):
        oshape = shape_keys(o)
        dims: list = []
        for j, sz in enumerate(oshape):
            kdim = nd - len(oshape) + j
            dims.append(None if (sz == 1 and S[kdim] != 1) else kdim)
        bcast = [d for d in range(nd) if d < nd - len(oshape) or dims[d - (nd - len(oshape))] is None]
        if any(S[d] == 1 for d in bcast):
            bcast = [d for d in bcast if S[d] != 1]
        dt = o.meta["val"].dtype
        v, held = low.held[o]
        val = v if held == dt else f"{v}.to({TL_DTYPE[dt]})"
        roff = " + ".join(f"i{d} * out{k}_s{d}" for d in range(nd - 1)) if nd > 1 else "rows * 0"
        m = "mask"
        row_b = [d for d in bcast if d < nd - 1]
        if row_b:
            m += " & (" + " & ".join(f"(i{d} == 0)" for d in row_b) + ")[:, None]"
        if nd - 1 in bcast:
            m += " & (cols == 0)[None, :]"
        stores.append(f"tl.store(out{k}_ptr + ({roff})[:, None] + c * out{k}_s{nd - 1}, "
                      f"tl.broadcast_to({val}, (BLOCK_R, BLOCK_C)), mask={m})")
        out_spec.append({"dtype": str(dt), "dims": dims})

    kinds = {RULES[op_name(n.target)].kind for n in nodes}
    reduction = bool(kinds & {"reduction", "softmax"})
    family = "softmax" if "softmax" in kinds else "norm" if reduction else "pointwise"
    numerics = ("exact: correctly rounded ops in fp32, rounded to each op's dtype; no FMA contraction" if exact
                else "tolerance: fp32 intermediates, rounded only at explicit casts and outputs" if fp32_intermediates
                else "tolerance: fp32 compute rounded to each op's dtype (eager's order), fast-math transcendentals")

    # reference: the original ops, readable
    ref_names = {i: a for i, a in zip(inputs, in_names)}
    ref_names.update({n: var[n] for n in nodes})
    imports: set[str] = {"torch"}
    ref_lines = [f"{var[n]} = " + _ref_call(n, ref_names, imports) for n in nodes]
    ref_lines.append("return (" + "".join(f"{var[o]}, " for o in outputs) + ")")

    spec = {"ndim": nd, "outputs": out_spec, "reduction": reduction, "exact": exact, "block_elems": block_elems,
            "num_warps": num_warps,
            "arg_names": ptr_args + ["n_rows", "n_cols"] + [f"size{d}" for d in range(nd - 1)] + stride_args}

    def render(name: str) -> str:
        kernel_name = f"{name}_kernel"
        kernel = _ENV.get_template("rowwise/rowwise.py.jinja").render(
            kernel_name=kernel_name, ptr_args=ptr_args, stride_args=stride_args, ndim=nd, loads=loads,
            body=low.lines, stores=stores)
        return _ENV.get_template("rowwise/kernel_module.py.jinja").render(
            name=name, kernel_name=kernel_name, kernel=kernel, ops=[str(n.target) for n in nodes],
            numerics=numerics, imports=[x for x in emit.import_lines(imports) if x != "import torch"],
            ref_args=in_names, ref_lines=ref_lines, spec=repr(spec))

    digest = hashlib.sha256(render("KERNEL").encode()).hexdigest()[:10]
    name = f"fused_{family}_{digest}"
    return FusedKernel(name, render(name), spec, [n.name for n in nodes])


def _ref_call(n: torch.fx.Node, names: dict, imports: set[str]) -> str:
    """The reference's line for a node: its op as captured; a view by its leading size-1 dims (``leading_ones``),
    so that the reference holds at every shape the kernel is launched at, as the kernel does."""
    if RULES[op_name(n.target)].kind == "view":
        p, q = leading_ones(n)
        return f"{names[n.args[0]]}.reshape((1,) * {q} + tuple({names[n.args[0]]}.shape)[{p}:])"
    return emit.call_source(n, emit.target_source(n.target, imports, n.name), names, imports)


def dtype_ok(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in TL_DTYPE
