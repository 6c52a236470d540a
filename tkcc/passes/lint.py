"""Checks the PassManager runs after every pass: graph structure and numerics.

Structure: FX's own ``graph.lint()`` (every use defined before it, no
dangling nodes), a recompile (the graph turns into valid Python), and the
phase's input signature left alone (a pass may not add, drop or rename
placeholders: the engine calls the graph with the same inputs).

Numerics: run a graph on inputs and compare every output tensor with a
reference, bit for bit (``exact``) or within a tolerance. Graphs may write
into state (a static KV cache, buffers updated in place); ``run_graph``
snapshots every tensor the graph mutates and restores it afterwards, so two
runs of two graphs see the same state and leave none behind.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree

from tkcc.errors import PassError

# Default tolerances per dtype for tolerance mode, (rtol, atol): the one table the PassManager, golden
# checks and the engine's validation share. bf16 logits of a 16-layer model whose sums are reordered
# (split-KV attention, fused GEMVs) differ by a few ulps of 2^-8 (seen up to 0.04 on an H200); greedy
# tokens are checked beside these bounds.
TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


def placeholders(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def lint_graph(gm: torch.fx.GraphModule, where: str, signature: list[str] | None = None) -> None:
    """Raise PassError naming ``where`` if the graph is malformed or its inputs changed."""
    try:
        gm.graph.lint()
    except Exception as e:  # FX raises RuntimeError / AssertionError with the bad node in the text
        raise PassError(f"{where}: graph lint failed: {e}") from e
    try:
        gm.recompile()
    except Exception as e:
        raise PassError(f"{where}: graph does not compile to Python: {type(e).__name__}: {e}") from e
    if signature is not None and placeholders(gm) != signature:
        raise PassError(f"{where}: the graph's inputs changed from {signature} to {placeholders(gm)}; "
                        "a pass must keep a phase's placeholders")
    outs = [n for n in gm.graph.nodes if n.op == "output"]
    if len(outs) != 1:
        raise PassError(f"{where}: graph has {len(outs)} output nodes (expected exactly 1)")


# ---- mutated state -----------------------------------------------------------------------------

def _mutated_arg_positions(target) -> list[int]:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """Follow view-like ops back to the node that owns the storage."""
    seen = 0
    while node.op == "call_function" and seen < 1000:
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None or not node.args:
            break
        first = node.args[0]
        if not isinstance(first, torch.fx.Node):
            break
        node, seen = first, seen + 1
    return node


def _fetch_attr(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def mutated_tensors(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Tensors held by the module (``get_attr``) that the graph writes in place."""
    out: dict[int, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            positions = _mutated_arg_positions(node.target)
            args = list(node.args)
            for i in positions:
                a = args[i] if i < len(args) else None
                if isinstance(a, torch.fx.Node):
                    r = _root(a)
                    if r.op == "get_attr":
                        t = _fetch_attr(gm, r.target)
                        if isinstance(t, torch.Tensor):
                            out[id(t)] = t
        elif node.op == "call_module":
            # a submodule may mutate its own buffers; snapshot them all (rare in captured graphs)
            for t in _fetch_attr(gm, node.target).buffers():
                out[id(t)] = t
    return list(out.values())


@contextmanager
def restored(tensors):
    """Snapshot tensors and put their contents back on exit."""
    tensors = list({id(t): t for t in tensors}.values())
    saved = [t.detach().clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, s in zip(tensors, saved):
                t.copy_(s)


def state_tensors(program, gm: torch.fx.GraphModule | None) -> list[torch.Tensor]:
    ts = mutated_tensors(gm) if gm is not None else []
    state = getattr(program, "state", None) if program is not None else None
    if isinstance(state, torch.nn.Module):
        ts += list(state.buffers())
    return ts


def clone_inputs(inputs) -> tuple:
    return tuple(pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tuple(inputs)))


def run_graph(fn, inputs, program=None, gm: torch.fx.GraphModule | None = None):
    """Run ``fn`` (a graph or any callable) on a copy of ``inputs``; state it mutates is restored."""
    gm = gm if gm is not None else (fn if isinstance(fn, torch.fx.GraphModule) else None)
    tensors = state_tensors(program, gm)
    with torch.no_grad(), restored(tensors):
        out = fn(*clone_inputs(inputs))
        return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, out)


# ---- comparison --------------------------------------------------------------------------------

@dataclass
class Comparison:
    """Result of comparing two output structures."""

    ok: bool
    exact: bool  # bitwise equal everywhere
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    first_diff: str | None = None  # "output[2] index (0, 3, 17): 0.125 vs 0.126"
    reason: str = ""


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    eq = a == b
    if a.is_floating_point() or a.is_complex():
        eq = eq | (a.isnan() & b.isnan())
    return eq


def compare(ref, got, exact: bool = True, rtol: float | None = None, atol: float | None = None) -> Comparison:
    """Compare two (nested) outputs; ``exact`` asks for bitwise equality."""
    ref_leaves, ref_spec = pytree.tree_flatten(ref)
    got_leaves, got_spec = pytree.tree_flatten(got)
    if ref_spec != got_spec:
        return Comparison(False, False, math.inf, math.inf, "output structure",
                          f"output structure changed: {ref_spec} vs {got_spec}")
    all_exact, ok, max_abs, max_rel, first = True, True, 0.0, 0.0, None
    scale = 0.0
    reason = ""
    for i, (r, g) in enumerate(zip(ref_leaves, got_leaves)):
        if not isinstance(r, torch.Tensor) or not isinstance(g, torch.Tensor):
            if r != g:
                all_exact = ok = False
                first = first or f"output[{i}]: {r!r} vs {g!r}"
                reason = reason or f"non-tensor output {i} differs"
            continue
        if r.shape != g.shape or r.dtype != g.dtype:
            all_exact = ok = False
            first = first or f"output[{i}]: shape/dtype {tuple(r.shape)}/{r.dtype} vs {tuple(g.shape)}/{g.dtype}"
            reason = reason or f"output {i} shape or dtype changed"
            max_abs = max_rel = math.inf
            continue
        r_, g_ = r.detach().cpu(), g.detach().cpu()
        eq = _bitwise_equal(r_, g_)
        if bool(eq.all()):
            continue
        all_exact = False
        idx = tuple(int(v) for v in (~eq).nonzero()[0].tolist()) if r_.dim() else ()
        if r_.is_floating_point() or r_.is_complex():
            rd, gd = r_.double(), g_.double()
            diff = (rd - gd).abs()
            diff = torch.where(eq, torch.zeros_like(diff), diff)
            diff = torch.nan_to_num(diff, nan=math.inf)
            abs_err = float(diff.max())
            rel_err = float((diff / rd.abs().clamp_min(1e-30)).max())
            rt, at = TOLERANCES.get(r_.dtype, (1e-5, 1e-8))
            rt = rtol if rtol is not None else rt
            at = atol if atol is not None else at
            # Scale-aware, as the engine's validation judges (tkcc.runtime.determinism.ScaledTolerance): the
            # largest difference against the output's own scale. An element-wise relative error means nothing
            # at a bf16 logit near zero; each element within rtol/atol passes as well.
            finite = rd[torch.isfinite(rd)]
            scale = float(finite.abs().max()) if finite.numel() else 0.0
            scaled = abs_err / scale if scale > 0 else math.inf
            close = scaled <= rt or bool(torch.isclose(gd, rd, rtol=rt, atol=at, equal_nan=True).all())
        else:
            abs_err = float((r_.long() - g_.long()).abs().max())
            rel_err = math.inf
            close = False
        max_abs, max_rel = max(max_abs, abs_err), max(max_rel, rel_err)
        if first is None:
            first = f"output[{i}] index {idx}: {r_[idx].item()!r} vs {g_[idx].item()!r}"
        if exact or not close:
            ok = False
            scaled_txt = f"{abs_err / scale:.3g} of the output's scale {scale:.3g}" if r_.is_floating_point() and \
                scale > 0 else "no finite scale"
            reason = reason or (f"output {i} is not bitwise equal (max abs err {abs_err:.3g})" if exact and close
                                else f"output {i} differs beyond tolerance (max abs err {abs_err:.3g} = "
                                     f"{scaled_txt}, bound {rt:g}; max element-wise rel err {rel_err:.3g})")
    return Comparison(ok, all_exact, max_abs, max_rel, first, reason)
