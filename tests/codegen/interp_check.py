"""Run in a child process with TRITON_INTERPRET=1 (the interpreter must be on before triton is imported).

For each small module, dtype and fusion variant: capture, fuse, then for every generated kernel compare the
Triton kernel (run by the interpreter on CPU) with its reference ops on fresh random inputs of several shapes,
and the whole fused graph with the original graph. Prints one JSON line of results for the parent test.
"""
from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

import torch  # noqa: E402

from codegen_helpers import Block, DecodeTail, Pointwise, RMSNorm, capture, rand_like_meta, same, variant_shapes  # noqa: E402
from tkcc.passes.manager import apply_plan  # noqa: E402
from tkcc.passes.plan import PassPlan  # noqa: E402


def check(model_name, module, inputs, dtype, pass_name, params):
    module = module.to(dtype)
    inputs = tuple(x.to(dtype) for x in inputs)
    prog = capture(module, inputs)
    plan = PassPlan.of((pass_name, params))
    fused, _logs = apply_plan(prog, plan)
    exact = pass_name == "fuse_elementwise_exact"
    gen = torch.Generator().manual_seed(1234)
    res = {"model": model_name, "dtype": str(dtype), "pass": pass_name, "params": params, "kernels": [],
           "graph_ok": None}
    gm = fused.graphs["forward"]
    for node in gm.graph.nodes:
        k = node.target
        if not getattr(k, "__tkcc_kernel__", False):
            continue
        launcher = k.launcher
        entry = {"name": k.name, "ops": len(k.origin), "cases": 0, "ok": 0, "kernel_runs": 0}
        for shapes in variant_shapes(node):
            args = [rand_like_meta(a.meta["val"], s, gen) for a, s in zip(node.args, shapes)]
            before = launcher.stats["kernel"]
            got = launcher(*args)
            entry["kernel_runs"] += launcher.stats["kernel"] - before
            want = launcher.reference(*args)
            entry["cases"] += 1
            entry["ok"] += all(same(w, g, exact) for w, g in zip(want, got))
        res["kernels"].append(entry)
    # whole graph: fused vs original on fresh inputs
    fresh = tuple(rand_like_meta(x, x.shape, gen) for x in inputs)
    want = prog.graphs["forward"](*fresh)
    got = gm(*fresh)
    res["graph_ok"] = all(same(w, g, exact) for w, g in zip(want, got))
    return res


def main():
    torch.manual_seed(0)
    results = []
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(2, 5, 32)
        results.append(check("block", Block().eval(), (x,), dtype, "fuse_elementwise", {}))
        if dtype == torch.float16:  # fp32 intermediates only differ from per-op rounding in half precision
            results.append(check("block", Block().eval(), (x,), dtype, "fuse_elementwise",
                                 {"intermediates": "fp32", "block_elems": 512, "num_warps": 2}))
        else:
            results.append(check("block", Block().eval(), (x,), dtype, "fuse_elementwise_exact", {}))
        results.append(check("rmsnorm", RMSNorm(48).eval(), (torch.randn(3, 48),), dtype, "fuse_elementwise", {}))
        results.append(check("pointwise", Pointwise().eval(), (x, torch.randn(5, 32)), dtype,
                             "fuse_elementwise_exact", {}))
        results.append(check("decode_tail", DecodeTail().eval(), (torch.randn(1, 1, 32), torch.randn(1, 1),
                                                                   torch.randn(1, 32), torch.randn(1, 32)),
                             dtype, "fuse_elementwise", {}))
    results.append(fallbacks())
    results.append(aot_from_interpreter())
    print("RESULTS " + json.dumps(results))


def aot_from_interpreter():
    """AOT compile asked for in an interpreter process goes to a child process with the interpreter off."""
    from tkcc.codegen.aot import compile_kernel

    m = RMSNorm(16).eval()
    fused, _ = apply_plan(capture(m, (torch.randn(4, 16),)), PassPlan.of("fuse_elementwise"))
    (n,) = [n for n in fused.graphs["forward"].graph.nodes if getattr(n.target, "__tkcc_kernel__", False)]
    cfg = n.target.launcher.launch_config([(4, 16), (16,)], ["torch.float32", "torch.float32"])
    blob = compile_kernel(n.target.source, cfg["signature"], "gfx942", kernel_name=f"{n.target.name}_kernel")
    return {"model": "aot_from_interpreter", "bytes": len(blob), "elf": blob[:4] == b"\x7fELF"}


def fallbacks():
    """Cases the kernel must refuse (and the reference answer), under the interpreter."""
    m = RMSNorm(16).eval()
    prog = capture(m, (torch.randn(4, 16),))
    fused, _ = apply_plan(prog, PassPlan.of("fuse_elementwise"))
    (k,) = [n.target for n in fused.graphs["forward"].graph.nodes if getattr(n.target, "__tkcc_kernel__", False)]
    launcher = k.launcher
    out = {"model": "fallbacks", "reasons": {}, "answers_ok": True}
    cases = {"rank": (torch.randn(2, 3, 16), m.weight),
             "bf16": (torch.randn(4, 16, dtype=torch.bfloat16), m.weight.bfloat16()),
             "fp64": (torch.randn(4, 16, dtype=torch.float64), m.weight.double()),
             "ok": (torch.randn(4, 16), m.weight)}
    for name, args in cases.items():
        out["reasons"][name] = launcher.why_not(args)
        got = k(*args)[0]
        out["answers_ok"] &= bool(torch.equal(got, launcher.reference(*args)[0])) or name == "ok"
    return out


if __name__ == "__main__":
    main()
    sys.stdout.flush()
