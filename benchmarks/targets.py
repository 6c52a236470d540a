"""Kernel families at the reference models' shapes: PyTorch reference vs Triton vs CUDA C++ (one H200).

Each row: family, model, shape, target, median ms (triton.testing.do_bench, L2 flushed between runs),
achieved bandwidth (floor bytes / time) as a fraction of the device-to-device copy bandwidth measured
in the same run, and whether the output matched the reference on that input.

    PYTHONPATH=. python benchmarks/targets.py [--out benchmarks/results/targets.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    import triton.testing

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    return 2 * n / (ms * 1e-3)


def shapes() -> list[tuple[str, str, dict]]:
    from tkcc.kernels.targets.families import model_shapes

    out = []
    for model in ("olmoe-16l", "llama-1b-16l"):
        for fam, s in model_shapes(model).items():
            out.append((fam, model, s))
    # the same families where they are memory-bound: prefill rows, long contexts
    out += [("rmsnorm", "olmoe-16l", dict(rows=8192, D=2048)),
            ("router_topk", "olmoe-16l", dict(T=8192, E=64, K=8)),
            ("decode_attention", "olmoe-16l", dict(B=1, HQ=16, HKV=16, D=128, S=32768, L=32768)),
            ("decode_attention", "llama-1b-16l", dict(B=1, HQ=32, HKV=8, D=64, S=32768, L=32768))]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/targets.json")
    args = ap.parse_args()
    import triton
    import triton.testing

    from tkcc.kernels.targets import kernel
    from tkcc.kernels.targets.families import FAMILIES, dtype_name

    bw = copy_bandwidth()
    dtype = torch.bfloat16
    rows = []
    for fam_name, model, shape in shapes():
        fam = FAMILIES[fam_name]
        floor_bytes = fam.bytes_moved(shape, dtype)
        sets = [fam.make_inputs(shape, dtype, "cuda", torch.Generator().manual_seed(s)) for s in range(3)]
        for target in ("torch", "triton", "cuda"):
            row = dict(family=fam_name, model=model, shape=shape, target=target, dtype=dtype_name(dtype))
            try:
                fn = kernel(fam_name, target, dtype, shape)
                want, got = fam.reference(*sets[0]), fn(*sets[0])
                want = want if isinstance(want, tuple) else (want,)
                got = got if isinstance(got, tuple) else (got,)
                rtol, atol = fam.tolerance["bfloat16"]
                ok = all(torch.equal(w.sort(-1).values, g.sort(-1).values) if w.dtype == torch.int64 else
                         torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol) for w, g in zip(want, got))
                i = [0]

                def call():
                    i[0] = (i[0] + 1) % len(sets)
                    return fn(*sets[i[0]])

                ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
                row.update(ms=ms, correct=bool(ok), gbps=floor_bytes / (ms * 1e-3) / 1e9,
                           bandwidth_fraction=floor_bytes / (ms * 1e-3) / bw)
            except Exception as e:  # noqa: BLE001 - a target that cannot run this shape is a result too
                row.update(ms=None, correct=None, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print(f"{fam_name:17s} {model:13s} {target:7s} "
                  + (f"{row['ms'] * 1e3:9.1f} us  {row['bandwidth_fraction'] * 100:5.1f}% of copy bw  ok={row['correct']}"
                     if row.get("ms") else row.get("error", "")), flush=True)
    from provenance import commit as tree

    commit = tree()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_bandwidth_gbps=bw / 1e9, commit=commit,
                command=" ".join([Path(sys.executable).name, *sys.argv]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    for out in [args.out] + ([os.path.join(os.environ["OUT"], "targets.json")] if os.environ.get("OUT") else []):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
