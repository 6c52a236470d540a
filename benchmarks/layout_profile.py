"""Where a captured decode step's device time goes, per aten op, next to the bytes each op moves.

    python benchmarks/layout_profile.py            # one GPU: olmoe-16l, llama-1b-16l; batch 1, 8; ctx 2k, 32k

The layout cost model (``tkcc/parallel/cost.py``) predicts a decode step from
bytes and op counts. This script is its check on real kernels: for the
degree-1 graphs the layout benchmark measures, it records per aten op the
count, the bytes its inputs and outputs span (from the graph's fake-tensor
metadata) and the device time CUPTI measured (``torch.profiler``), plus the
CUDA-graph replay time of the whole step. Raw JSON: ``$OUT/layout_profile.json``
(or ``benchmarks/results/layout_profile.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _nbytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_nbytes(x) for x in v)
    return 0


def graph_bytes(gm) -> dict:
    """Per op name: count and bytes of inputs + outputs (views count as ops moving nothing)."""
    from tkcc.parallel.cost import NO_KERNEL

    out = defaultdict(lambda: {"count": 0, "in_bytes": 0, "out_bytes": 0})
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(n.target, "__name__", str(n.target))
        short = name.split(".")[0]
        rec = out[name]
        rec["count"] += 1
        if short in NO_KERNEL:
            continue
        ins = [a.meta.get("val") for a in n.all_input_nodes]
        rec["in_bytes"] += sum(_nbytes(v) for v in ins)
        rec["out_bytes"] += _nbytes(n.meta.get("val"))
    return dict(out)


def profile_ops(gm, ids, pos) -> dict:
    """Per aten op: device microseconds per step (CUPTI), over 3 profiled eager steps."""
    from torch.profiler import ProfilerActivity, profile

    steps = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            gm(ids, pos)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "self_cuda_time_total", 0)
        if dev_us and e.key.startswith("aten::"):
            out[e.key] = {"device_us": dev_us / steps, "calls": e.count / steps}
    kernels = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key[:120]] = {"device_us": e.self_device_time_total / steps, "calls": e.count / steps}
    return {"ops": out, "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["device_us"])[:40])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["olmoe-16l", "llama-1b-16l"])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--contexts", nargs="*", type=int, default=[2048, 32768])
    args = ap.parse_args(argv)
    from tkcc.frontend.hf import capture_hf
    from tkcc.frontend.models import build_model
    from tkcc.parallel.cost import count_ops
    from tkcc.parallel.machine import graph_replay_us

    dev = torch.device("cuda", 0)
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results")
    path = os.path.join(out_dir, "layout_profile.json")
    doc = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": [],
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for name in args.models:
        model = build_model(name, dtype=torch.bfloat16, device=dev,
                            max_position_embeddings=max(args.contexts) + 64)
        for batch in args.batches:
            for ctx in args.contexts:
                prog = capture_hf(model, phases=["decode"], max_cache_len=ctx + 16, batch=batch)
                gm = prog.graphs["decode"]
                ids = torch.randint(0, 1000, (batch, 1), device=dev)
                pos = torch.tensor([ctx], device=dev)
                with torch.no_grad():
                    replay = graph_replay_us(lambda: gm(ids, pos), dev, reps=30) / 1e3
                    prof = profile_ops(gm, ids, pos)
                row = dict(model=name, batch=batch, context=ctx, graph_replay_ms=replay, ops=count_ops(gm),
                           bytes=graph_bytes(gm), profile=prof)
                doc["rows"].append(row)
                tot = sum(v["device_us"] for v in prof["ops"].values())
                print(f"{name} b{batch} ctx{ctx}: replay {replay:.3f} ms, profiled op device sum {tot / 1e3:.3f} ms",
                      flush=True)
                top = sorted(prof["ops"].items(), key=lambda kv: -kv[1]["device_us"])[:8]
                for k, v in top:
                    b = doc["rows"][-1]["bytes"].get(k.replace("aten::", "") + ".default", {})
                    print(f"   {k:<40} {v['device_us']:9.1f} us  x{v['calls']:.0f}  "
                          f"{(b.get('in_bytes', 0) + b.get('out_bytes', 0)) / 1e6:9.1f} MB", flush=True)
                with open(path, "w") as f:
                    json.dump(doc, f, indent=1, default=str)
                del prog, gm
                torch.cuda.empty_cache()
        del model
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
