"""The ``torch.compile`` backend on KernelBench-style problems: eager vs Inductor vs tkcc vs tkcc with search.

Standalone modules of the kinds KernelBench levels 1-3 hold (single ops, fused op chains, small whole
models), fp32, inference (``torch.no_grad()``, ``eval()``). For each problem, in one process:

- eager; Inductor (``torch.compile(m)``, default mode); tkcc (``torch.compile(m, backend=tkcc)``,
  default options); tkcc with a per-graph search budget (``options={"search_s": S}``); optionally
  Inductor's ``reduce-overhead`` mode (``--reduce-overhead``: Inductor's own CUDA graphs, the fair
  reference for the launch elimination tkcc measures);
- correctness: every variant's output against eager on three input sets, the error as a fraction of
  the output's scale (``correct`` when all are within ``--tol``, default 1e-2, KernelBench's own
  atol/rtol; ``max_err`` records the actual error: cuDNN runs fp32 convolutions in TF32 by default, so
  two valid convolution algorithms already differ by ~1e-4 of the scale);
- time: ``tkcc.runtime.timing.time_eager`` (CUDA events around each call, launch overhead included,
  warm-up first; 30 to 200 calls, about 0.2 s per variant, in two interleaved rounds), inputs rotated
  over three fresh sets, the median. Compiles (and tkcc's first-call choice) happen before timing.

Rows go to ``benchmarks/results/backend_suite.json`` (``--smoke``: ``backend_suite_cpu_smoke.json``; and
``$OUT/backend_suite.json`` when $OUT is set),
rewritten after every problem: ``problem``, ``correct``, ``eager_ms``, ``inductor_ms``, ``tkcc_ms``,
``tkcc_search_ms``, ratios and what tkcc chose per graph; the last row is the summary (geomeans vs
Inductor, problems below 0.9x, the goals).

  PYTHONPATH=. python benchmarks/backend_suite.py --out benchmarks/results/backend_suite.json   # H200, <= ~8 min
  PYTHONPATH=. python benchmarks/backend_suite.py --problems relu,mlp,transformer_block         # a subset
  PYTHONPATH=. python benchmarks/backend_suite.py --smoke            # CPU: tiny sizes, 6 problems, ~1 min
  PYTHONPATH=. python benchmarks/backend_suite.py --list
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tkcc.backend import TkccBackend  # noqa: E402
from tkcc.runtime.measurement import environment  # noqa: E402
from tkcc.runtime.timing import time_eager  # noqa: E402

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ---- the problems ---------------------------------------------------------------------------------
@dataclass
class Problem:
    name: str
    level: int
    build: object  # (small: bool) -> (module, [input shapes or callables(gen, device)])


PROBLEMS: dict[str, Problem] = {}


def problem(level: int):
    def deco(fn):
        PROBLEMS[fn.__name__] = Problem(fn.__name__, level, fn)
        return fn
    return deco


class Fn(nn.Module):
    """A module around a function of its inputs (and of the modules it closes over)."""

    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for name, m in modules.items():  # the modules fn closes over, registered so .to() and eval() reach them
            self.add_module(name, m)

    def forward(self, *xs):
        return self.fn(*xs)


def S(small, full, tiny):
    return tiny if small else full


# level 1: single operations
@problem(1)
def matmul_square(small):
    n = S(small, 2048, 32)
    return Fn(torch.matmul), [(n, n), (n, n)]


@problem(1)
def matmul_small(small):
    n = S(small, 256, 16)
    return Fn(torch.matmul), [(n, n), (n, n)]


@problem(1)
def matmul_tall_skinny(small):
    m, k = S(small, (4096, 64), (64, 8))
    return Fn(torch.matmul), [(m, k), (k, m)]


@problem(1)
def matvec(small):
    m, k = S(small, (4096, 8192), (32, 64))
    return Fn(torch.matmul), [(m, k), (k, 1)]


@problem(1)
def batched_matmul(small):
    b, m, k = S(small, (64, 128, 256), (2, 8, 16))
    return Fn(torch.bmm), [(b, m, k), (b, k, m)]


@problem(1)
def conv2d_3x3(small):
    b, c, o, h = S(small, (16, 16, 64, 128), (2, 3, 4, 8))
    return nn.Conv2d(c, o, 3, padding=1), [(b, c, h, h)]


@problem(1)
def conv2d_depthwise(small):
    b, c, h = S(small, (16, 64, 64), (2, 4, 8))
    return nn.Conv2d(c, c, 3, padding=1, groups=c), [(b, c, h, h)]


@problem(1)
def conv1d(small):
    b, c, o, n = S(small, (16, 32, 64, 4096), (2, 3, 4, 16))
    return nn.Conv1d(c, o, 5), [(b, c, n)]


@problem(1)
def conv_transpose2d(small):
    b, c, o, h = S(small, (16, 32, 16, 64), (2, 4, 3, 8))
    return nn.ConvTranspose2d(c, o, 3, stride=2, padding=1, output_padding=1), [(b, c, h, h)]


@problem(1)
def relu(small):
    return nn.ReLU(), [S(small, (64, 16384), (4, 64))]


@problem(1)
def gelu(small):
    return nn.GELU(), [S(small, (64, 16384), (4, 64))]


@problem(1)
def softmax(small):
    return nn.Softmax(dim=-1), [S(small, (256, 4096), (4, 64))]


@problem(1)
def log_softmax(small):
    return nn.LogSoftmax(dim=1), [S(small, (256, 4096), (4, 64))]


@problem(1)
def layer_norm(small):
    d = S(small, 1024, 32)
    return nn.LayerNorm(d), [(S(small, 4096, 8), d)]


@problem(1)
def rms_norm(small):
    d = S(small, 1024, 32)

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
    return RMSNorm(), [(S(small, 4096, 8), d)]


@problem(1)
def batch_norm2d(small):
    b, c, h = S(small, (16, 64, 64), (2, 4, 8))
    bn = nn.BatchNorm2d(c)
    bn.running_mean.normal_()
    bn.running_var.uniform_(0.5, 2.0)
    return bn, [(b, c, h, h)]


@problem(1)
def group_norm(small):
    b, c, h = S(small, (16, 64, 64), (2, 8, 8))
    return nn.GroupNorm(8 if not small else 2, c), [(b, c, h, h)]


@problem(1)
def sum_reduction(small):
    return Fn(lambda x: x.sum(dim=1)), [S(small, (16, 256, 256), (2, 8, 8))]


@problem(1)
def argmax_dim(small):
    return Fn(lambda x: torch.argmax(x, dim=1)), [S(small, (16, 256, 256), (2, 8, 8))]


@problem(1)
def max_pool2d(small):
    return nn.MaxPool2d(2), [S(small, (16, 32, 128, 128), (2, 3, 8, 8))]


@problem(1)
def cumsum(small):
    return Fn(lambda x: torch.cumsum(x, dim=1)), [S(small, (128, 4000), (4, 32))]


@problem(1)
def cross_entropy(small):
    n, c = S(small, (4096, 1000), (8, 10))
    return Fn(lambda x, t: F.cross_entropy(x, t)), [(n, c), lambda g, dev: torch.randint(0, c, (n,), generator=g)
                                                    .to(dev)]


@problem(1)
def cosine_similarity_loss(small):
    n, d = S(small, (128, 4096), (4, 16))
    return Fn(lambda a, b: torch.mean(1 - F.cosine_similarity(a, b, dim=1))), [(n, d), (n, d)]


# level 2: fused operator chains
@problem(2)
def gemm_bias_gelu(small):
    i, o, b = S(small, (1024, 4096, 128), (16, 32, 4))
    lin = nn.Linear(i, o)
    return Fn(lambda x: F.gelu(lin(x)), lin=lin), [(b, i)]


@problem(2)
def gemm_relu_scale_sum(small):
    i, o, b = S(small, (1024, 1024, 128), (16, 16, 4))
    lin = nn.Linear(i, o)
    return Fn(lambda x: (torch.relu(lin(x)) * 0.5).sum(dim=1, keepdim=True), lin=lin), [(b, i)]


@problem(2)
def gemm_sigmoid_scale_residual(small):
    i, o, b = S(small, (1024, 1024, 128), (16, 16, 4))
    lin = nn.Linear(i, o)

    def f(x):
        y = lin(x)
        return torch.sigmoid(y) * 2.0 + y
    return Fn(f, lin=lin), [(b, i)]


@problem(2)
def gemm_groupnorm_swish(small):
    i, o, b = S(small, (512, 1024, 128), (16, 16, 4))
    lin, gn = nn.Linear(i, o), nn.GroupNorm(16 if not small else 4, o)

    def f(x):
        y = gn(lin(x))
        return y * torch.sigmoid(y)
    return Fn(f, lin=lin, gn=gn), [(b, i)]


@problem(2)
def conv_bn_relu(small):
    b, c, o, h = S(small, (16, 3, 64, 128), (2, 3, 4, 8))
    return nn.Sequential(nn.Conv2d(c, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU()), [(b, c, h, h)]


@problem(2)
def conv_relu_maxpool(small):
    b, c, o, h = S(small, (16, 16, 32, 64), (2, 3, 4, 8))
    return nn.Sequential(nn.Conv2d(c, o, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)), [(b, c, h, h)]


@problem(2)
def conv_gelu_global_avgpool(small):
    b, c, o, h = S(small, (16, 16, 64, 32), (2, 3, 4, 8))
    return nn.Sequential(nn.Conv2d(c, o, 3), nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()), [(b, c, h, h)]


@problem(2)
def layer_norm_residual_gelu(small):
    d, n = S(small, (1024, 2048), (32, 8))
    ln = nn.LayerNorm(d)
    return Fn(lambda x, r: F.gelu(ln(x + r)) + r, ln=ln), [(n, d), (n, d)]


@problem(2)
def attention_scores(small):
    b, h, s, d = S(small, (8, 8, 256, 64), (1, 2, 8, 4))

    def f(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v
    return Fn(f), [(b, h, s, d)] * 3


@problem(2)
def sdpa(small):
    b, h, s, d = S(small, (8, 16, 512, 64), (1, 2, 8, 4))
    return Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), [(b, h, s, d)] * 3


# level 3: small whole models
@problem(3)
def mlp(small):
    d, h, b = S(small, (1024, 2048, 128), (16, 32, 4))
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)), [(b, d)]


@problem(3)
def small_cnn(small):
    b = S(small, 64, 2)
    return nn.Sequential(nn.Conv2d(3, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84),
                         nn.ReLU(), nn.Linear(84, 10)), [(b, 3, 32, 32)]


class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + x)


@problem(3)
def resnet_basic_block(small):
    b, c, h = S(small, (8, 64, 56), (1, 4, 8))
    return BasicBlock(c), [(b, c, h, h)]


class InvertedResidual(nn.Module):
    def __init__(self, c, e=4):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c * e, 1, bias=False), nn.BatchNorm2d(c * e), nn.ReLU6(),
                                  nn.Conv2d(c * e, c * e, 3, padding=1, groups=c * e, bias=False),
                                  nn.BatchNorm2d(c * e), nn.ReLU6(), nn.Conv2d(c * e, c, 1, bias=False),
                                  nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.body(x)


@problem(3)
def mobilenet_block(small):
    b, c, h = S(small, (16, 32, 56), (1, 4, 8))
    return InvertedResidual(c), [(b, c, h, h)]


@problem(3)
def transformer_block(small):
    d, heads, ff, b, s = S(small, (256, 8, 1024, 16, 128), (16, 2, 32, 1, 8))
    return nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True), [(b, s, d)]


class LSTMUnrolled(nn.Module):
    """An LSTM over a few steps written with its cell equations (one graph, unrolled by dynamo)."""

    def __init__(self, d, h, steps):
        super().__init__()
        self.x2g, self.h2g, self.hidden, self.steps = nn.Linear(d, 4 * h), nn.Linear(h, 4 * h), h, steps

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1], self.hidden)
        c = torch.zeros_like(h)
        for t in range(self.steps):
            i, f, g, o = (self.x2g(xs[t]) + self.h2g(h)).chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return h


@problem(3)
def lstm_unrolled(small):
    d, h, b, t = S(small, (128, 256, 16, 8), (8, 16, 2, 3))
    return LSTMUnrolled(d, h, t), [(t, b, d)]


class GRUCellLoop(nn.Module):
    def __init__(self, d, h, steps):
        super().__init__()
        self.cell, self.steps, self.hidden = nn.GRUCell(d, h), steps, h

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1], self.hidden)
        for t in range(self.steps):
            h = self.cell(xs[t], h)
        return h


@problem(3)
def gru_cell_loop(small):
    d, h, b, t = S(small, (128, 256, 16, 8), (8, 16, 2, 3))
    return GRUCellLoop(d, h, t), [(t, b, d)]


class VitMLPBlock(nn.Module):
    """Pre-norm transformer MLP sub-block with residual (ViT/GPT style)."""

    def __init__(self, d):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


@problem(3)
def vit_mlp_block(small):
    d, b, s = S(small, (384, 8, 197), (16, 1, 5))
    return VitMLPBlock(d), [(b, s, d)]


# ---- measuring ------------------------------------------------------------------------------------
def make_inputs(specs, gen, device):
    out = []
    for s in specs:
        if callable(s):
            out.append(s(gen, device))
        else:
            out.append(torch.randn(*s, generator=gen).to(device))
    return tuple(out)


def scaled_err(ref, out) -> float:
    refs = [t for t in torch.utils._pytree.tree_leaves(ref) if isinstance(t, torch.Tensor)]
    outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if len(refs) != len(outs):
        return math.inf
    worst = 0.0
    for r, o in zip(refs, outs):
        if r.shape != o.shape:
            return math.inf
        if not r.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(r, o) else math.inf)
            continue
        scale = float(r.abs().max()) or 1.0
        worst = max(worst, float((r.double() - o.double()).abs().max()) / scale if r.numel() else 0.0)
    return worst


def timed(fns: dict, sets, device, target_s: float, reps_max: int, rounds: int = 2) -> dict:
    """Median ms per call of each fn (tkcc's time_eager), rounds interleaved so drift hits all alike."""
    with torch.no_grad():
        per = {}
        for name, fn in fns.items():  # a first estimate sets the number of calls
            t = time_eager(fn, sets, 3, 2, device)
            per[name] = max(30, min(reps_max, int(target_s / max(statistics.median(t), 1e-6))))
        samples = {k: [] for k in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                samples[name] += time_eager(fn, sets, max(15, per[name] // rounds), 3, device)
    return {k: statistics.median(v) * 1e3 for k, v in samples.items()}


def run_problem(p: Problem, args, device) -> dict:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model, specs = p.build(args.smoke)
    model = model.to(device).eval()
    sets = [make_inputs(specs, gen, device) for _ in range(3)]
    row = {"problem": p.name, "level": p.level, "inputs": [list(x.shape) for x in sets[0]]}
    with torch.no_grad():
        ref = [model(*s) for s in sets]
    variants = {"eager": model}
    compile_s, backends = {}, {}

    torch._dynamo.reset()  # once per problem: the variants' compiled code must outlive each other's compiles

    def compiled(name, **kw):
        t0 = time.time()
        fn = torch.compile(model, **kw)
        with torch.no_grad():
            fn(*sets[0])  # compile, and tkcc's first-call choice
            fn(*sets[1])
        if device.type == "cuda":
            torch.cuda.synchronize()
        compile_s[name] = round(time.time() - t0, 2)
        variants[name] = fn

    errors = {}
    for name, kw in [("inductor", {}), ("inductor_ro", {"mode": "reduce-overhead"}),
                     ("tkcc", {"backend": "tkcc"}), ("tkcc_search", {"backend": "tkcc_search"})]:
        if name == "inductor_ro" and not args.reduce_overhead:
            continue
        if kw.get("backend") == "tkcc":
            backends[name] = kw["backend"] = TkccBackend({"search_s": 0})  # whatever $TKCC_BACKEND_SEARCH_S says
        elif kw.get("backend") == "tkcc_search":
            backends[name] = kw["backend"] = TkccBackend({"search_s": args.search_s})
        try:
            compiled(name, **kw)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result, recorded
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"  {p.name}: {name} failed: {errors[name]}")
    errs = {}
    with torch.no_grad():
        for name, fn in variants.items():
            if name == "eager":
                continue
            errs[name] = max(scaled_err(r, fn(*s)) for r, s in zip(ref, sets))
    row["max_err"] = errs
    row["correct"] = not errors and all(e <= args.tol for e in errs.values())
    row["errors"] = errors
    row["compile_s"] = compile_s
    ms = timed(variants, sets, device, args.target_s, args.reps_max)
    for name, v in ms.items():
        row[f"{name}_ms"] = v
    for name in ("tkcc", "tkcc_search", "inductor_ro", "eager"):
        if f"{name}_ms" in row and "inductor_ms" in row:
            row[f"{name}_vs_inductor"] = row["inductor_ms"] / row[f"{name}_ms"]
    row["choices"] = {name: [{"graph": d.graph, "winner": d.winner, "numerics": d.numerics, "why": d.why}
                             for d in be.decisions] for name, be in backends.items()}
    del variants, backends
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def interleaved() -> list[str]:
    """Every problem, levels taken in turn (1, 2, 3, 1, 2, 3, ...): a deadline cut drops a mix, not level 3."""
    by = [[p.name for p in PROBLEMS.values() if p.level == lv] for lv in (1, 2, 3)]
    out = []
    while any(by):
        for names in by:
            if names:
                out.append(names.pop(0))
    return out


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary(rows, args, device, skipped) -> dict:
    done = [r for r in rows if "tkcc_vs_inductor" in r]
    out = {"summary": True, "problems": len(rows), "timed": len(done), "skipped": skipped,
           "all_correct": all(r["correct"] for r in rows),
           "incorrect": [r["problem"] for r in rows if not r["correct"]],
           "search_s": args.search_s, "smoke": args.smoke, "wall_s": round(time.time() - T0, 1),
           "command": " ".join(sys.argv), **environment(device, torch.float32)}
    for name in ("tkcc", "tkcc_search", "inductor_ro", "eager"):
        key = f"{name}_vs_inductor"
        vals = [r[key] for r in done if key in r]
        if vals:
            out[f"geomean_{key}"] = geomean(vals)
            out[f"below_0.9_{name}"] = [r["problem"] for r in done if r.get(key, 1) < 0.9]
            out[f"count_below_0.9_{name}"] = len(out[f"below_0.9_{name}"])
            out[f"beats_inductor_{name}"] = sum(1 for v in vals if v > 1.0)
    g, gs = out.get("geomean_tkcc_vs_inductor"), out.get("geomean_tkcc_search_vs_inductor")
    out["goals"] = {"tkcc_geomean_ge_1.0": g is not None and g >= 1.0,
                    "tkcc_none_below_0.9": out.get("count_below_0.9_tkcc", 1) == 0,
                    "tkcc_search_geomean_ge_1.15": gs is not None and gs >= 1.15}
    return out


def write(rows, summ, paths):
    text = json.dumps(rows + [summ], indent=1, default=str)
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", default=None, help="comma-separated names (default: all; --smoke: six)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, few calls: checks every code path")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--search-s", type=float, default=None, help="tkcc_search's per-graph budget (default 4; smoke 1)")
    ap.add_argument("--reduce-overhead", action="store_true", help="also time Inductor mode='reduce-overhead'")
    ap.add_argument("--tol", type=float, default=1e-2,
                    help="max error vs eager, as a fraction of the output's scale (KernelBench checks atol=rtol=1e-2)")
    ap.add_argument("--target-s", type=float, default=None, help="timed seconds per variant (default 0.2)")
    ap.add_argument("--reps-max", type=int, default=200)
    ap.add_argument("--deadline-s", type=float, default=420.0,
                    help="start no problem after this many seconds (keeps the run inside ~8 minutes)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/backend_suite.json "
                    "(--smoke: backend_suite_cpu_smoke.json, so a smoke run never overwrites a GPU result)")
    args = ap.parse_args(argv)
    if args.list:
        for p in PROBLEMS.values():
            print(f"{p.level} {p.name}")
        return 0
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.search_s is None:
        args.search_s = 1.0 if args.smoke else 4.0
    if args.target_s is None:
        args.target_s = 0.02 if args.smoke else 0.2
    if args.smoke:
        args.reps_max = min(args.reps_max, 30)
    if args.problems:
        names = [n.strip() for n in args.problems.split(",") if n.strip()]
        bad = [n for n in names if n not in PROBLEMS]
        if bad:
            ap.error(f"unknown problem(s) {bad}; --list shows them")
    elif args.smoke:
        names = ["relu", "layer_norm", "gemm_bias_gelu", "conv_bn_relu", "mlp", "lstm_unrolled"]
    else:
        names = interleaved()
    if device.type != "cuda" and not args.smoke:
        log("no CUDA device: running on CPU at full sizes (use --smoke for the quick CPU check)")
    for key in ("cache_size_limit", "recompile_limit"):  # one entry per variant's backend, per problem
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 64))
    if args.out is None:
        args.out = str(ROOT / "benchmarks/results" / ("backend_suite_cpu_smoke.json" if args.smoke
                                                      else "backend_suite.json"))
    paths = [Path(args.out)] + ([Path(os.environ["OUT"]) / "backend_suite.json"] if os.environ.get("OUT") else [])
    log(f"{len(names)} problems on {device}, tkcc_search budget {args.search_s:g} s per graph")
    rows, skipped = [], []
    for name in names:
        if time.time() - T0 > args.deadline_s:
            skipped.append(name)
            continue
        t0 = time.time()
        try:
            row = run_problem(PROBLEMS[name], args, device)
        except Exception as e:  # noqa: BLE001 - a problem that cannot run is a row, not the end of the run
            row = {"problem": name, "correct": False, "errors": {"problem": f"{type(e).__name__}: {str(e)[:300]}"}}
        rows.append(row)
        parts = [f"{k[:-3]} {row[k]:.4g}" for k in ("eager_ms", "inductor_ms", "inductor_ro_ms", "tkcc_ms",
                                                      "tkcc_search_ms") if k in row]
        ratio = " ".join(f"{k.replace('_vs_inductor', '')} x{row[k]:.2f}"
                         for k in ("tkcc_vs_inductor", "tkcc_search_vs_inductor") if k in row)
        log(f"{name:28s} {'ok ' if row['correct'] else 'BAD'} ms: {', '.join(parts)} | {ratio} "
            f"({time.time() - t0:.1f} s)")
        write(rows, summary(rows, args, device, skipped), paths)
    summ = summary(rows, args, device, skipped)
    write(rows, summ, paths)
    log(json.dumps({k: v for k, v in summ.items() if k.startswith(("geomean", "count_below", "goals", "all_correct",
                                                                     "skipped", "wall"))}))
    return 0 if summ["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
