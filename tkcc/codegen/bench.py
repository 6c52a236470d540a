"""Fused kernels vs the eager ops they replace, on a GPU: ``python -m tkcc.codegen.bench --out DIR``.

Why: the fusion pass only pays off where a fused kernel beats the chain of
eager kernels it replaces; this measures that per pattern (RMSNorm with the
residual add, SiLU*mul, softmax) at the reference model's widths, for
decode-like and prefill-like row counts, and checks each result against the
reference first. Writes one JSON file with what it ran on.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


class _ResidualRMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x, r):
        h = x + r
        dt = h.dtype
        f = h.to(torch.float32)
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * f.to(dt), h


class _SiluMul(torch.nn.Module):
    def forward(self, g, u):
        return torch.nn.functional.silu(g) * u


class _Softmax(torch.nn.Module):
    def forward(self, s):
        return torch.softmax(s * 0.125, dim=-1)


def _time(fn, args, iters: int) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def run(rows=(1, 64, 4096), hidden: int = 2048, inter: int = 8192, dtype=torch.bfloat16, iters: int = 50) -> dict:
    from tkcc.frontend import capture
    from tkcc.passes.manager import apply_plan
    from tkcc.passes.plan import PassPlan

    dev = "cuda"
    results = []
    for n in rows:
        cases = [("residual_rmsnorm", _ResidualRMSNorm(hidden), (torch.randn(n, hidden), torch.randn(n, hidden))),
                 ("silu_mul", _SiluMul(), (torch.randn(n, inter), torch.randn(n, inter))),
                 ("softmax", _Softmax(), (torch.randn(n, 32, 512),))]
        for name, mod, xs in cases:
            mod = mod.to(dev, dtype).eval()
            xs = tuple(x.to(dev, dtype) for x in xs)
            prog = capture(mod, example_inputs=xs)
            fused, logs = apply_plan(prog, PassPlan.of("fuse_elementwise"))
            eager, gen = prog.graphs["forward"], fused.graphs["forward"]
            with torch.no_grad():
                want, got = eager(*xs), gen(*xs)
                want = want if isinstance(want, tuple) else (want,)
                got = got if isinstance(got, tuple) else (got,)
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(want, got))
                t_eager, t_fused = _time(eager, xs, iters), _time(gen, xs, iters)
            results.append({"pattern": name, "rows": n, "kernels": logs[0].matched, "max_abs_err": err,
                            "eager_us": round(t_eager, 2), "fused_us": round(t_fused, 2),
                            "speedup": round(t_eager / t_fused, 3)})
            print(json.dumps(results[-1]))
    return {"measured_on": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "triton": __import__("triton").__version__, "host": platform.node(),
                            "dtype": str(dtype), "hidden": hidden, "inter": inter, "iters": iters,
                            "statistic": "median of CUDA-event times per call, microseconds",
                            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "results": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for codegen_bench.json")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tkcc.codegen.bench needs an NVIDIA GPU")
    data = run(iters=args.iters)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codegen_bench.json").write_text(json.dumps(data, indent=2))
    print(f"wrote {out / 'codegen_bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
