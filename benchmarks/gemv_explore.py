"""Why do tkcc's batch-1 GEMVs stream at ~2.9 TB/s? Kernel designs side by side on the decode step's shapes.

The decode profile (BENCHMARKS.md) shows even the 206 MB lm_head GEMV, where launch ramp is negligible, at
2.9 TB/s, against 4.0 TB/s for a device copy (read + write). This times, on one GPU, each candidate design
of y = W x (bf16, fp32 accumulate) on the step's shapes, each shape as 16 back-to-back calls on distinct
weights (no L2 reuse) replayed from one CUDA graph:

  current   tkcc.kernels.gemv (register tiles, whole-K or a plain K loop), every config in its CONFIGS
  pipe      a K loop software-pipelined by Triton (``tl.range(num_stages=...)``: cp.async into shared memory)
  persist   a persistent grid whose (row tile, K chunk) loop is flattened and pipelined across tile edges
  tma       Hopper TMA block loads (host TensorDescriptor), pipelined
  cublas    torch's F.linear
  read      torch.sum over the same bytes (a read-only streaming reference)

Every kernel's output is checked against an fp32 reference first. Writes one JSON (``--out``).

  python benchmarks/gemv_explore.py --out benchmarks/results/gemv_explore.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@triton.jit
def gemv_pipe(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rows_c = tl.where(rows < N, rows, 0).to(tl.int64)
    offs = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        w = tl.load(w_ptr + rows_c[:, None] * stride_wn + (k0 + offs)[None, :])
        x = tl.load(x_ptr + k0 + offs).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def gemv_persist(x_ptr, w_ptr, y_ptr, N, K, stride_wn, NPROG: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 STAGES: tl.constexpr):
    pid = tl.program_id(0)
    KT = K // BK
    n_tiles = tl.cdiv(N, BN)
    my_tiles = (n_tiles - pid + NPROG - 1) // NPROG
    offs = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], tl.float32)
    for i in tl.range(0, my_tiles * KT, num_stages=STAGES):
        t = pid + (i // KT) * NPROG
        kk = (i % KT) * BK
        rows = t * BN + tl.arange(0, BN)
        rows_c = tl.where(rows < N, rows, 0).to(tl.int64)
        w = tl.load(w_ptr + rows_c[:, None] * stride_wn + (kk + offs)[None, :])
        x = tl.load(x_ptr + kk + offs).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if i % KT == KT - 1:
            tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < N)
            acc = tl.zeros([BN, BK], tl.float32)


@triton.jit
def gemv_tma(x_ptr, w_desc, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    row0 = pid * BN
    offs = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        w = w_desc.load([row0, k0])
        x = tl.load(x_ptr + k0 + offs).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    rows = row0 + tl.arange(0, BN)
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < N)


def graph_us(fns, reps=15):
    """Median µs of all ``fns`` run back to back, replayed from one CUDA graph."""
    from tkcc.parallel.machine import graph_replay_us

    return graph_replay_us(lambda: [f() for f in fns], torch.device("cuda"), reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gemv_explore.json"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from tkcc.kernels import gemv as gm
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev, dt = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # (name, N, K, copies): the step's GEMV shapes; MoE experts as the 8 chosen experts' rows stacked
    shapes = [("lm_head", 50304, 2048, 3), ("qkv", 6144, 2048, 16), ("o_proj", 2048, 2048, 16),
              ("experts_gate_up(8x)", 16384, 2048, 8), ("experts_down(8x, as K)", 2048, 8192, 16),
              ("llama_gate_up", 16384, 2048, 8), ("llama_down", 2048, 8192, 16)]
    if args.quick:
        shapes = shapes[:3]
    pipe_cfgs = [(8, 256, 3, 4), (8, 256, 4, 4), (16, 256, 3, 4), (16, 256, 4, 8), (16, 128, 4, 4), (32, 128, 4, 8),
                 (32, 256, 3, 8), (4, 512, 3, 4), (8, 512, 3, 8), (64, 64, 4, 4), (16, 512, 2, 8), (4, 256, 4, 4)]
    persist_cfgs = [(c, m) for c in [(8, 256, 4, 4), (16, 256, 3, 4), (16, 128, 4, 4), (32, 128, 4, 8)]
                    for m in (2, 4, 8)]
    tma_cfgs = [(16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 3, 8), (16, 256, 4, 4), (32, 256, 3, 8), (64, 64, 4, 4),
                (128, 64, 4, 8), (8, 256, 4, 4), (32, 64, 6, 4)]
    rows = []
    t_all = time.time()
    for name, N, K, copies in shapes:
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        x = torch.randn(K, device=dev, dtype=dt)
        ys = [torch.empty(N, device=dev, dtype=dt) for _ in range(copies)]
        ref = F.linear(x.float(), ws[0].float())
        nbytes = copies * N * K * 2

        def record(kind, cfg, fns_for):
            try:
                fns = fns_for()
                fns[0]()
                torch.cuda.synchronize()
                err = float((ys[0].float() - ref).norm() / ref.norm())
                if err > 2e-2:
                    rows.append(dict(shape=name, kind=kind, config=cfg, error=f"wrong result: rel err {err:.3g}"))
                    return
                us = graph_us(fns)
                rows.append(dict(shape=name, N=N, K=K, kind=kind, config=cfg, us_per_call=us / copies,
                                 TBps=nbytes / us / 1e6, rel_err=err))
            except Exception as e:
                rows.append(dict(shape=name, kind=kind, config=cfg, error=f"{type(e).__name__}: {str(e)[:300]}"))

        red = [torch.empty((), device=dev, dtype=torch.float32) for _ in range(copies)]
        us = graph_us([lambda i=i: torch.sum(ws[i], dim=(0, 1), dtype=torch.float32, out=red[i]) for i in range(copies)])
        rows.append(dict(shape=name, N=N, K=K, kind="read(torch.sum)", us_per_call=us / copies, TBps=nbytes / us / 1e6))
        record("cublas", None, lambda: [lambda i=i: torch.matmul(ws[i], x, out=ys[i]) for i in range(copies)])
        for cfg in gm.CONFIGS:
            for pdl in (False, True):
                record("current" + ("+pdl" if pdl else ""), list(cfg),
                       lambda cfg=cfg, pdl=pdl: [lambda i=i: gm.gemv(x, ws[i], out=ys[i], config=cfg, pdl=pdl)
                                                 for i in range(copies)])
        for bn, bk, st, nw in pipe_cfgs:
            if K % bk:
                continue
            record("pipe", [bn, bk, st, nw], lambda bn=bn, bk=bk, st=st, nw=nw: [
                lambda i=i: gemv_pipe[(triton.cdiv(N, bn),)](x, ws[i], ys[i], N, K, K, BN=bn, BK=bk, STAGES=st,
                                                              num_warps=nw) for i in range(copies)])
        for (bn, bk, st, nw), m in persist_cfgs:
            if K % bk:
                continue
            nprog = min(sms * m, triton.cdiv(N, bn))
            record("persist", [bn, bk, st, nw, m], lambda bn=bn, bk=bk, st=st, nw=nw, nprog=nprog: [
                lambda i=i: gemv_persist[(nprog,)](x, ws[i], ys[i], N, K, K, NPROG=nprog, BN=bn, BK=bk, STAGES=st,
                                                   num_warps=nw) for i in range(copies)])
        for bn, bk, st, nw in tma_cfgs:
            if K % bk:
                continue
            descs = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
            record("tma", [bn, bk, st, nw], lambda bn=bn, bk=bk, st=st, nw=nw, descs=descs: [
                lambda i=i: gemv_tma[(triton.cdiv(N, bn),)](x, descs[i], ys[i], N, K, BN=bn, BK=bk, STAGES=st,
                                                             num_warps=nw) for i in range(copies)])
        best = {}
        for r in rows:
            if r.get("shape") == name and "TBps" in r:
                if r["kind"] not in best or r["TBps"] > best[r["kind"]]["TBps"]:
                    best[r["kind"]] = r
        print(f"[{time.time() - t_all:.0f}s] {name} [{N}x{K}] x{copies}: " + "; ".join(
            f"{k} {v['TBps']:.2f} TB/s {v.get('config')}" for k, v in sorted(best.items(), key=lambda kv: -kv[1]["TBps"])),
            flush=True)
        errs = [r for r in rows if r.get("shape") == name and "error" in r]
        for r in errs[:4]:
            print("   error:", r["kind"], r["config"], r["error"][:200], flush=True)
        ws = ys = None  # free before the next shape
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, sms=sms,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    import os
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], Path(args.out).name).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
