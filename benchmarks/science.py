"""Scientific models on one GPU: eager vs torch.compile (default, max-autotune) vs tkcc (bit-exact).

    python benchmarks/science.py                      # all models, writes benchmarks/results/science.json
    python benchmarks/science.py --models gcn,gin --budget-s 120 --no-max-autotune

Per model and workload bucket, one row: ``model, shape, exact, eager_ms,
compile_ms, compile_max_autotune_ms, tkcc_ms`` (+ exactness of each
torch.compile variant, speedups, what tkcc captured). How it measures:

- latency of one forward: synchronise, record a CUDA event, call, record,
  synchronise; median over at least 30 calls after warm-up, rotating over
  4 fresh inputs of the bucket's shapes (new graphs, positions, images);
- ``exact``: every tkcc output ``torch.equal`` to eager on those inputs, and
  on the compile-time golden inputs; models whose eager forward uses atomics
  (GCN, GIN, e3nn) run eager, tkcc and torch.compile under
  ``torch.use_deterministic_algorithms(True)`` (see docs/science.md);
- torch.compile runs in worker processes (one per model and mode) that
  compile in parallel, wait at a barrier, then time one at a time under a
  file lock, so no compile or autotuning overlaps any timing. A worker that
  is not done compiling when the budget runs out is stopped and its rows say
  so (``compile_ms: null`` with the reason);
- eager and tkcc are timed first in this process, before any worker starts.
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

MODELS = ["latent_ode", "gcn", "gin", "e3nn", "convnext_tiny"]
N_INPUTS = 4


# ------------------------------------------------------------------ timing
def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_forward(fn, inputs, min_reps=30, target_s=0.6, warmup=3) -> dict:
    """Median latency (ms) of one call, sync before each, CUDA events around it, inputs rotated."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        for a in inputs:
            fn(*a)
    _sync()
    t0 = time.perf_counter()
    fn(*inputs[0])
    _sync()
    est = max(time.perf_counter() - t0, 1e-5)
    reps = int(min(400, max(min_reps, target_s / est)))
    times = []
    for i in range(reps):
        a = inputs[i % len(inputs)]
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            fn(*a)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        else:  # CPU smoke run of this script only; not a result
            t1 = time.perf_counter()
            fn(*a)
            times.append((time.perf_counter() - t1) * 1e3)
    times.sort()
    return {"ms": statistics.median(times), "p10": times[len(times) // 10], "p90": times[(9 * len(times)) // 10],
            "reps": reps}


def equal_all(a, b) -> bool:
    import torch.utils._pytree as pytree

    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                      for x, y in zip(la, lb))


def _clone(out):
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)


class GpuLock:
    """Exclusive use of the GPU for timing, across this script's processes."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        self.f = open(self.path, "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def bucket_inputs(sm, bucket, n=N_INPUTS, seed=100):
    return [sm.inputs(bucket, seed + i) for i in range(n)]


# ------------------------------------------------------------------ worker: torch.compile
def worker(args) -> None:
    """Compile one model with torch.compile(mode), wait for the go file, time every bucket under the lock."""
    from tkcc.science import build, deterministic_mode

    sm = build(args.model, device=args.device, small=args.small)
    res = {"model": args.model, "mode": args.mode, "buckets": {}}
    kw = {} if args.mode == "default" else {"mode": args.mode}
    t0 = time.perf_counter()
    with torch.no_grad(), deterministic_mode(sm.deterministic):
        compiled = torch.compile(sm.module, **kw)
        data = {}
        for b in sm.workload.buckets:
            ins = bucket_inputs(sm, b)
            refs = [sm.module(*a) for a in ins]
            outs = [_clone(compiled(*a)) for a in ins]  # compiles (per shape) here; cloned: cudagraph outputs
                                                        # of max-autotune are overwritten by the next replay
            data[b.key()] = (ins, refs, outs)
        _sync()
        res["compile_s"] = time.perf_counter() - t0
        open(os.path.join(args.sync_dir, f"ready-{args.model}-{args.mode}"), "w").close()
        while not os.path.exists(os.path.join(args.sync_dir, "go")):
            time.sleep(0.2)
        with GpuLock(os.path.join(args.sync_dir, "gpu.lock")):
            for b in sm.workload.buckets:
                ins, refs, outs = data[b.key()]
                exact = all(equal_all(r, o) for r, o in zip(refs, outs))
                t = time_forward(compiled, ins)
                res["buckets"][b.key()] = {"ms": t["ms"], "exact": exact, "timing": t}
    print("RESULT " + json.dumps(res), flush=True)


# ------------------------------------------------------------------ main
def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    from tkcc.science.compat import import_timm

    for lib in ("triton", "torchdiffeq", "torch_geometric", "e3nn", "timm", "torchvision"):
        try:
            out[lib] = (import_timm() if lib == "timm" else __import__(lib)).__version__
        except Exception as e:  # noqa: BLE001
            out[lib] = f"unavailable ({type(e).__name__})"
    return out


def git_commit() -> str:
    try:
        c = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return c.stdout.strip() + ("+dirty" if dirty else "") if c.returncode == 0 else "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def prepare_tkcc(models, reports, device="cuda", small=False) -> list:
    """Build every model and compile it with tkcc (golden-checked); inputs and eager references ready."""
    from tkcc.science import build, compile_exact, deterministic_mode

    prepared = []
    for name in models:
        print(f"[tkcc] {name}: build + compile_exact", flush=True)
        sm = build(name, device=device, small=small)
        fast = compile_exact(sm.module, sm.workload, inputs=sm.make_inputs, deterministic=sm.deterministic)
        reports[name] = fast.report()
        print(f"[tkcc] {name}: mode={fast.mode} compile_s={reports[name]['compile_s']}", flush=True)
        per_bucket = []
        for b in sm.workload.buckets:
            ins = bucket_inputs(sm, b)
            with torch.no_grad(), deterministic_mode(sm.deterministic):
                refs = [sm.module(*a) for a in ins]
            per_bucket.append((b, ins, refs))
        prepared.append((name, sm, fast, per_bucket))
    return prepared


def time_tkcc(prepared, rows, lock_path) -> None:
    from tkcc.science import deterministic_mode
    from tkcc.science.workloads import bucket_label

    with GpuLock(lock_path):
        for name, sm, fast, per_bucket in prepared:
            def eager(*a, _m=sm.module, _d=sm.deterministic):
                with torch.no_grad(), deterministic_mode(_d):
                    return _m(*a)

            for b, ins, refs in per_bucket:
                exact = fast.mode != "eager" and all(equal_all(r, fast(*a)) for a, r in zip(ins, refs))
                te = time_forward(eager, ins)
                tt = time_forward(fast, ins)
                exact = exact and all(equal_all(r, fast(*a)) for a, r in zip(ins, refs))  # still, after timing
                rows.append({"model": name, "shape": bucket_label(b), "bucket": b.key(), "weight": b.weight,
                             "exact": exact, "eager_ms": te["ms"], "tkcc_ms": tt["ms"], "tkcc_mode": fast.mode,
                             "deterministic_algorithms": sm.deterministic,
                             "compile_ms": None, "compile_exact": None,
                             "compile_max_autotune_ms": None, "compile_max_autotune_exact": None,
                             "timing": {"eager": te, "tkcc": tt}})
                print(f"[tkcc] {name} {bucket_label(b)}: eager {te['ms']:.3f} ms, tkcc {tt['ms']:.3f} ms, "
                      f"exact={exact}", flush=True)
    for name, sm, fast, _ in prepared:  # what the timing runs did to the capture caches
        cap = fast.report().get("capture")
        for r in rows:
            if r["model"] == name:
                r["tkcc_capture_after_timing"] = _capture_summary(cap)


def _capture_summary(cap) -> dict | None:
    if not cap:
        return None
    if "regions" in cap:
        regs = cap["regions"]
        return {"regions": len(regs), "graphs": sum(r["graphs"] for r in regs),
                "replays": sum(r["replays"] for r in regs), "eager_calls": sum(r["eager_calls"] for r in regs),
                "uncaptured_small_pieces": len(cap.get("uncaptured_small_pieces", [])),
                "graph_breaks": sum(cap.get("graph_breaks", {}).values())}
    return {"graphs": cap.get("graphs"), "replays": cap.get("replays"), "eager_calls": cap.get("eager_calls")}


def start_workers(models, modes, sync_dir, extra=()) -> dict:
    """One worker per (model, mode); they compile at once and wait for the go file before timing."""
    procs = {}
    for m in models:
        for mode in modes:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", m, "--mode", mode,
                   "--sync-dir", sync_dir, *extra]
            log = open(os.path.join(sync_dir, f"log-{m}-{mode}.txt"), "w")
            procs[(m, mode)] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT), log)
    return procs


def _ready(sync_dir, k) -> bool:
    return os.path.exists(os.path.join(sync_dir, f"ready-{k[0]}-{k[1]}"))


def wait_compiled(procs, sync_dir, compile_deadline) -> dict:
    """Wait until every worker is ready (or dead) or the deadline; stop the ones still compiling."""
    while time.time() < compile_deadline:
        if all(_ready(sync_dir, k) or p.poll() is not None for k, (p, _) in procs.items()):
            break
        time.sleep(0.5)
    stopped = {}
    for k, (p, _) in procs.items():
        if not _ready(sync_dir, k) and p.poll() is None:
            p.kill()
            p.wait()
            stopped[k] = {"skipped": "compile did not finish within the time budget "
                                     f"({compile_deadline - START:.0f} s after start)"}
    return stopped


def collect_workers(procs, sync_dir, stopped, deadline) -> dict:
    open(os.path.join(sync_dir, "go"), "w").close()
    results = dict(stopped)
    for k, (p, log) in procs.items():
        if k in results:
            continue
        try:
            out, _ = p.communicate(timeout=max(30.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            results[k] = {"skipped": "timing did not finish within the time budget"}
            continue
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if line:
            results[k] = json.loads(line[-1][len("RESULT "):])
        else:
            log.flush()
            tail = open(log.name).read()[-800:]
            results[k] = {"skipped": f"worker failed (exit {p.returncode}): {tail}"}
    return results


START = time.time()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budget-s", type=float, default=270.0, help="wall budget for the whole run (seconds)")
    ap.add_argument("--timing-reserve-s", type=float, default=100.0,
                    help="seconds of the budget kept for timing; compiles still running then are stopped")
    ap.add_argument("--no-max-autotune", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile entirely")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "science.json"))
    ap.add_argument("--device", default="cuda", help="cuda (results) or cpu (a smoke run of the script only)")
    ap.add_argument("--small", action="store_true", help="CPU-test model sizes (smoke runs)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--sync-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/science.py needs a CUDA GPU (or --device cpu --small for a smoke run)", file=sys.stderr)
        return 2
    start = START
    deadline = start + args.budget_s
    models = [m for m in args.models.split(",") if m]
    sync_dir = tempfile.mkdtemp(prefix="tkcc-science-")
    lock_path = os.path.join(sync_dir, "gpu.lock")
    rows, reports = [], {}
    modes = [] if args.no_compile else (["default"] + ([] if args.no_max_autotune else ["max-autotune"]))
    extra = ["--device", args.device] + (["--small"] if args.small else [])
    procs = start_workers(models, modes, sync_dir, extra) if modes else {}
    if procs:
        print(f"[compile] {len(procs)} torch.compile workers started ({modes})", flush=True)
    prepared = prepare_tkcc(models, reports, args.device, args.small)
    # every compile (tkcc's and torch.compile's) is done or stopped before anything is timed
    stopped = wait_compiled(procs, sync_dir, deadline - args.timing_reserve_s) if procs else {}
    time_tkcc(prepared, rows, lock_path)
    skipped = {}
    if procs:
        results = collect_workers(procs, sync_dir, stopped, deadline + 60)
        for (m, mode), r in results.items():
            col = "compile_ms" if mode == "default" else "compile_max_autotune_ms"
            ex = "compile_exact" if mode == "default" else "compile_max_autotune_exact"
            for row in rows:
                if row["model"] != m:
                    continue
                if "skipped" in r:
                    row.setdefault("notes", []).append(f"torch.compile {mode}: {r['skipped']}")
                    skipped[f"{m}/{mode}"] = r["skipped"]
                    continue
                b = r["buckets"].get(row["bucket"])
                if b:
                    row[col], row[ex] = b["ms"], b["exact"]
                    row.setdefault("compile_time_s", {})[mode] = r.get("compile_s")
    for row in rows:
        row["speedup_vs_eager"] = row["eager_ms"] / row["tkcc_ms"]
        row["speedup_vs_compile"] = row["compile_ms"] / row["tkcc_ms"] if row["compile_ms"] else None
        row["speedup_vs_max_autotune"] = (row["compile_max_autotune_ms"] / row["tkcc_ms"]
                                          if row["compile_max_autotune_ms"] else None)
    summary = {
        "rows": len(rows),
        "all_tkcc_exact": all(r["exact"] for r in rows),
        "geomean_speedup_vs_eager": geomean([r["speedup_vs_eager"] for r in rows]),
        "geomean_speedup_vs_compile_default": geomean([r["speedup_vs_compile"] for r in rows]),
        "geomean_speedup_vs_compile_max_autotune": geomean([r["speedup_vs_max_autotune"] for r in rows]),
        "goals": {"every_row_exact": True, "geomean_vs_eager": 2.0, "geomean_vs_compile_default": 1.2},
    }
    doc = {
        "benchmark": "science", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/science.py"] + sys.argv[1:]),
        "commit": git_commit(),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu", "versions": versions(),
        "dtype": "float32", "inputs_per_bucket": N_INPUTS, "wall_s": round(time.time() - start, 1),
        "summary": summary, "skipped": skipped, "rows": rows, "tkcc_reports": reports,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    if os.environ.get("OUT"):  # the device runner brings back what is under $OUT
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "science.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)
    print(f"\n{'model':14s} {'shape':44s} {'exact':5s} {'eager':>9s} {'compile':>9s} {'max-at':>9s} {'tkcc':>9s}")
    for r in rows:
        fmt = lambda v: f"{v:9.3f}" if v else f"{'-':>9s}"  # noqa: E731
        print(f"{r['model']:14s} {r['shape'][:44]:44s} {str(r['exact']):5s} {fmt(r['eager_ms'])} "
              f"{fmt(r['compile_ms'])} {fmt(r['compile_max_autotune_ms'])} {fmt(r['tkcc_ms'])}")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
