"""Persistent engine vs restarting per candidate: experiments per hour, swap + graph capture, tiers, memory.

    python benchmarks/engine.py --model olmoe-16l --device cuda            # one H200, a few minutes
    python benchmarks/engine.py --model olmoe-tiny --device cpu --threads 1  # CPU smoke test

What it does, all in one run:
1. starts ``tkcc serve`` (a real engine process) and submits the same N
   candidate plans on the slow tier and on the fast tier through
   ``EngineClient``: each experiment compiles the plan for the tier (passes +
   codegen + load), validates it on fresh inputs, swaps it in, re-captures
   CUDA graphs for the workload's shapes, measures every bucket (warm-up,
   then 10..30 reps: adaptive, until the median's 95 % interval is within
   +-0.5 %) and swaps it back out. Per-tier time per experiment is the wall
   time of that whole sequence; ``breakdown_s`` splits it per phase (median
   over the candidates; ``other_s`` is revert, RPC and journaling);
2. submits one candidate that kills its worker (``os._exit``) and records
   how long the engine takes to recover;
3. stops the engine and, per candidate for the first few, starts a fresh
   process that imports, builds the model, captures, compiles the same plan
   and validates + measures it the same way (``--restart-one``: the same
   EngineCore operations, the same measurement rules): the restart baseline,
   timed for real, not assumed. ``speedup_same_candidates`` compares it with
   the engine's slow-tier experiments on those same plans;
4. writes raw JSON to ``benchmarks/results/engine.json`` (and ``$OUT`` if set).

Workload: by default the engine's own (a 32-token prompt, 32 new tokens:
one prefill bucket and two decode buckets). ``--trace FILE`` builds it from
a real trace instead (e.g. the bundled Azure LLM 2023 conv), clipped to the
KV cache length. Not the default on olmoe-16l because the captured baseline
uses transformers' ``batched_mm`` MoE, which gathers every (token, expert)
pair's weights: a prefill of P tokens reads P x 8 x 12 MiB per layer, so a
2.7k-token prompt needs > 200 GB. The measured figure (experiments/hour) is
about the engine, and the same workload is used for both sides.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TRACE = os.path.join(ROOT, "tkcc", "data", "traces", "azure_llm_2023", "AzureLLMInferenceTrace_conv.csv")  # example


def candidate_plans(device: str) -> list[list[dict]]:
    """Distinct plans of the registered passes: general clean-ups, then (on a GPU) fused Triton kernels."""
    from tkcc.passes.base import all_passes

    have = all_passes()
    plans = []
    general = [[("dce", {})], [("dce", {}), ("cse", {})], [("dce", {}), ("noop-elim", {})],
               [("cse", {}), ("dce", {"get_attr": "keep"})], [("noop-elim", {}), ("cse", {}), ("dce", {})]]
    fused = []
    if "fuse_elementwise_exact" in have and device.startswith("cuda"):
        for max_ops in (32, 16):
            for block in (2048, 1024):
                for warps in (4, 2):
                    fused.append([("dce", {}), ("fuse_elementwise_exact",
                                                {"max_ops": max_ops, "block_elems": block, "num_warps": warps})])
    # interleave so a short run still has both kinds
    for i in range(max(len(general), len(fused))):
        for group in (fused, general):
            if i < len(group):
                plans.append(group[i])
    return [[{"name": n, "params": p} for n, p in plan if n in have] for plan in plans]


def make_workload(trace_path: str | None, max_context: int, batch: int, num_buckets: int) -> dict | None:
    """None: the engine's default workload. Else buckets from the trace, clipped to ``max_context``."""
    if not trace_path:
        return None
    from tkcc.runtime.workloads import workload_to_json
    from tkcc.traffic.buckets import workload_from_trace
    from tkcc.traffic.loaders import load_trace

    trace = load_trace(trace_path)
    w = workload_from_trace(trace, max_context=max_context, batch_sizes=(batch,), num_buckets=num_buckets)
    return workload_to_json(w)


# ------------------------------------------------------------------ restart
def restart_one(args) -> None:
    """One experiment from a cold process: import, build + capture, compile, validate, swap + capture, measure."""
    t0 = time.perf_counter()
    import torch  # noqa: F401 - timed: part of what a restart pays

    from tkcc.runtime.engine import EngineCore

    t_import = time.perf_counter() - t0
    cfg = json.loads(args.restart_one)
    core = EngineCore(cfg["engine"])
    t_build = time.perf_counter() - t0 - t_import
    spec, tier, workload = cfg["candidate"], cfg["tier"], cfg["workload"]
    s = time.perf_counter()
    cid = core.op_load(spec, tier)["candidate"]
    t_compile = time.perf_counter() - s
    s = time.perf_counter()
    v = core.op_validate(cid, tier, workload)
    t_validate = time.perf_counter() - s
    s = time.perf_counter()
    sw = core.op_swap(cid, tier, workload) if v["ok"] else {}
    t_swap = time.perf_counter() - s
    s = time.perf_counter()
    m = core.op_measure(tier, workload, reps=cfg["reps"]) if v["ok"] else None
    t_measure = time.perf_counter() - s
    print(json.dumps({"ok": v["ok"], "import_s": t_import, "build_and_capture_s": t_build, "compile_s": t_compile,
                      "validate_s": t_validate, "swap_and_capture_s": t_swap, "measure_s": t_measure,
                      "swap_capture_and_measure_s": t_swap + t_measure,
                      "capture_s": sw.get("capture_s"), "objective": m and m["objective"],
                      "reps": [b["reps"] for b in (m or {}).get("buckets", [])], "startup": core.startup}))


# --------------------------------------------------------------------- main
PHASES = ("compile_s", "validate_s", "swap_s", "capture_s", "measure_wall_s", "other_s")
COMPILE_PHASES = ("passes_s", "codegen_s", "load_s")


def experiment_record(res: dict, tier: str, plan, wall: float) -> dict:
    """One experiment's time per phase, from the engine's own record of it."""
    rec = res["tiers"][tier]
    load, val = rec.get("load") or {}, rec.get("validation") or {}
    swap, meas = rec.get("swap") or {}, rec.get("measurement") or {}
    out = {"plan": plan, "ok": res["ok"], "reason": res.get("reason"), "client_wall_s": wall,
           "seconds": rec["seconds"], "compile_s": load.get("compile_s"),
           "compile_phases_s": (load.get("info") or {}).get("phases_s"),
           "validate_s": val.get("seconds"), "validation_mode": val.get("mode"),
           "swap_s": swap.get("swap_s"), "capture_s": swap.get("capture_s"), "graphs": swap.get("graphs"),
           "eager": swap.get("eager"), "measure_wall_s": meas.get("supervisor_wall_s"),
           "objective": meas.get("objective"),
           "buckets": [{k: b.get(k) for k in ("key", "median_s", "iqr_s", "ci_low_s", "ci_high_s", "reps", "stop",
                                             "warmup", "cuda_graph")} for b in meas.get("buckets", [])]}
    out["other_s"] = rec["seconds"] - sum(out[k] or 0.0 for k in PHASES[:-1])
    return out


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def breakdown(records: list[dict]) -> dict:
    """Median seconds per phase (and per compile phase) over a tier's experiments."""
    out = {k: med([r[k] for r in records]) for k in PHASES}
    out["total_s"] = med([r["seconds"] for r in records])
    out["compile_phases_s"] = {k: med([(r["compile_phases_s"] or {}).get(k) for r in records])
                               for k in COMPILE_PHASES}
    reps = [b["reps"] for r in records for b in r["buckets"]]
    out["reps_per_bucket"] = {"median": med(reps), "min": min(reps, default=None), "max": max(reps, default=None)}
    return out


def _serve(args, sock: str, workdir: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tkcc.cli", "serve", "--model", args.model, "--device", args.device, "--dtype",
           args.dtype, "--socket", sock, "--json", "--max-cache-len", str(args.max_cache_len),
           "--state-dir", os.path.join(workdir, "state")]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.fast_blocks:
        cmd += ["--fast-blocks", str(args.fast_blocks)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def log(msg: str) -> None:
    print(f"[engine bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-16l")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--max-cache-len", type=int, default=None, help="default 4096 on cuda, 256 on cpu")
    ap.add_argument("--fast-blocks", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--candidates", type=int, default=6, help="candidates per tier in the engine")
    ap.add_argument("--restarts", type=int, default=2, help="real restart experiments to time")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--trace", default=None, help="build the workload from this trace (e.g. "
                    f"{os.path.relpath(TRACE, ROOT)}); default: the engine's own small workload")
    ap.add_argument("--buckets", type=int, default=3, help="workload buckets per phase (with --trace)")
    ap.add_argument("--no-recovery", action="store_true", help="skip the crash-recovery measurement")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "engine.json"))
    ap.add_argument("--restart-one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.restart_one:
        restart_one(args)
        return 0
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.max_cache_len = args.max_cache_len or (4096 if args.device.startswith("cuda") else 256)

    from tkcc.runtime import EngineClient
    from tkcc.runtime.measurement import commit

    workdir = tempfile.mkdtemp(prefix="tkcc-engine-bench-")
    sock = os.path.join(workdir, "engine.sock")
    workload = make_workload(args.trace, args.max_cache_len, 1, args.buckets)
    plans = candidate_plans(args.device)[:args.candidates]
    log(f"{len(plans)} candidate plans, workload: {'engine default' if workload is None else args.trace}; "
        "starting the engine")

    t0 = time.perf_counter()
    proc = _serve(args, sock, workdir)
    ready = json.loads(proc.stdout.readline() or "{}")
    if not ready.get("ready"):
        proc.wait(60)
        raise SystemExit("engine did not start")
    engine_start_s = time.perf_counter() - t0
    log(f"engine ready in {engine_start_s:.1f} s: tiers {ready['tiers']}")
    results = {"slow": [], "fast": []}
    try:
        with EngineClient(socket_path=sock) as c:
            status0 = c.status()
            for tier in ("slow", "fast"):
                for i, plan in enumerate(plans):
                    s = time.perf_counter()
                    res = c.experiment({"plan": plan}, tiers=tier, workload=workload, reps=args.reps)
                    wall = time.perf_counter() - s
                    rec = experiment_record(res, tier, plan, wall)
                    results[tier].append(rec)
                    log(f"{tier} #{i}: {'ok' if res['ok'] else 'FAILED ' + str(res.get('reason'))[:120]} "
                        f"in {wall:.2f} s ({', '.join(f'{k[:-2]} {rec[k]:.2f}' for k in PHASES if rec[k] is not None)}"
                        f"; reps {[b['reps'] for b in rec['buckets']]})")
            baseline = c.experiment({"baseline": True}, tiers="both", workload=workload, reps=args.reps)
            status1 = c.status()
            recovery = None
            if not args.no_recovery:
                crash = os.path.join(workdir, "crash.py")
                with open(crash, "w") as f:
                    f.write("import os\ndef build(program):\n    return {p: (lambda *a: os._exit(7)) "
                            "for p in program.phases}\n")
                r = c.experiment({"source": crash}, tiers="fast", workload=workload, reps=3)
                recovery = (r["tiers"]["fast"].get("recovery") or {})
                log(f"crash candidate: {r['tiers']['fast'].get('failure')}; recovered in "
                    f"{recovery.get('recovery_s', float('nan')):.1f} s")
                after = c.experiment({"baseline": True}, tiers="fast", workload=workload, reps=3)
                recovery["next_experiment_ok"] = after["ok"]
            c.shutdown()
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()

    # ----------------------------------------------------------- restarts
    restarts = []
    eng_cfg = {"model": args.model, "device": ready["device"], "dtype": args.dtype,
               "max_cache_len": args.max_cache_len, "fast_blocks": args.fast_blocks, "threads": args.threads,
               "state_dir": os.path.join(workdir, "restart")}
    for i, plan in enumerate(plans[:args.restarts]):
        payload = json.dumps({"engine": eng_cfg, "candidate": {"plan": plan}, "tier": "slow", "workload": workload,
                              "reps": args.reps})
        s = time.perf_counter()
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--restart-one", payload],
                             capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - s
        if out.returncode != 0:
            raise SystemExit(f"restart experiment failed:\n{out.stderr[-3000:]}")
        rec = json.loads(out.stdout.strip().splitlines()[-1])
        rec["wall_s"] = wall
        rec["plan"] = plan
        restarts.append(rec)
        log(f"restart #{i}: {wall:.1f} s (import {rec['import_s']:.1f}, build+capture {rec['build_and_capture_s']:.1f},"
            f" compile {rec['compile_s']:.2f}, validate {rec['validate_s']:.2f}, "
            f"swap+capture {rec['swap_and_capture_s']:.2f}, measure {rec['measure_s']:.2f}; reps {rec['reps']})")

    # ------------------------------------------------------------ summary
    slow_s = [r["seconds"] for r in results["slow"]]
    fast_s = [r["seconds"] for r in results["fast"]]
    restart_s = [r["wall_s"] for r in restarts]
    persistent_per_h = 3600.0 / statistics.mean(slow_s) if slow_s else None
    restart_per_h = 3600.0 / statistics.mean(restart_s) if restart_s else None
    same = slow_s[:len(restart_s)]  # the engine's slow-tier experiments on the plans the restarts ran
    speedup_same = (statistics.mean(restart_s) / statistics.mean(same)) if same and restart_s else None
    mem = (status1.get("worker") or {}).get("memory", {})
    mem0 = (status0.get("worker") or {}).get("memory", {})
    model_bytes = mem.get("model_bytes", 0)
    env = (status1.get("worker") or {}).get("env", {})
    out = {
        "benchmark": "engine",
        "model": args.model, "device": env.get("device_name"), "dtype": args.dtype,
        "max_cache_len": args.max_cache_len, "tiers": ready["tiers"],
        "versions": {"torch": env.get("torch"), "triton": env.get("triton"), "cuda": env.get("cuda"),
                     "python": platform.python_version()},
        "commit": commit(), "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "persistent_experiments_per_hour": persistent_per_h,
        "restart_experiments_per_hour": restart_per_h,
        "speedup": (persistent_per_h / restart_per_h) if persistent_per_h and restart_per_h else None,
        "speedup_same_candidates": speedup_same,
        "fast_experiments_per_hour": 3600.0 / statistics.mean(fast_s) if fast_s else None,
        "swap_and_capture_s": med([(r["swap_s"] or 0) + (r["capture_s"] or 0) for r in results["slow"]
                                   if r["swap_s"] is not None]),
        "fast_tier_s": med(fast_s), "slow_tier_s": med(slow_s),
        "breakdown_s": {t: breakdown(results[t]) for t in results},
        "restart_breakdown_s": {k: med([r.get(k) for r in restarts]) for k in
                                ("import_s", "build_and_capture_s", "compile_s", "validate_s", "swap_and_capture_s",
                                 "measure_s", "wall_s")},
        "candidates_ok": {t: sum(r["ok"] for r in results[t]) for t in results},
        "restart_s": restart_s, "engine_start_s": engine_start_s,
        "recovery_s": (recovery or {}).get("recovery_s"), "recovery": recovery,
        "memory": {"model_bytes": model_bytes, "cache_bytes": mem.get("cache_bytes"),
                   "engine_allocated_bytes": mem.get("allocated_bytes"),
                   "engine_max_allocated_bytes": mem.get("max_allocated_bytes"),
                   "engine_reserved_bytes": mem.get("reserved_bytes"),
                   "device_used_bytes_at_start": mem0.get("device_used_bytes"),
                   "device_used_bytes": mem.get("device_used_bytes"),
                   "rss_bytes": mem.get("rss_bytes"),
                   "overhead_over_model_bytes": (mem.get("max_allocated_bytes") or 0) - model_bytes
                   if mem.get("max_allocated_bytes") else None,
                   "overhead_over_model_ratio": (mem.get("max_allocated_bytes") / model_bytes)
                   if mem.get("max_allocated_bytes") and model_bytes else None},
        "workload": {"source": args.trace or "engine default",
                     "buckets": [b["key"] for b in results["slow"][0]["buckets"]] if results["slow"] else []},
        "baseline": {t: {"seconds": r["seconds"], "objective": (r.get("measurement") or {}).get("objective")}
                     for t, r in baseline["tiers"].items()},
        "experiments": results, "restarts": restarts,
        "notes": "persistent_experiments_per_hour = 3600 / mean slow-tier experiment time in the engine "
                 "(compile + validate + swap + graph capture + measure + swap back); restart_experiments_per_hour = "
                 "3600 / mean wall time of a fresh process doing the same on the slow tier (import, build, capture, "
                 "compile, validate, measure), timed for real. Both measure adaptively: warm-up, then 10 to --reps "
                 "repetitions per bucket, stopping once the median's 95% confidence interval is within +-0.5%.",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    copy = os.path.join(os.environ["OUT"], "engine.json") if os.environ.get("OUT") else None
    if copy and os.path.abspath(copy) != os.path.abspath(args.out):
        shutil.copy(args.out, copy)
    shutil.rmtree(workdir, ignore_errors=True)
    summary = {k: out[k] for k in ("persistent_experiments_per_hour", "restart_experiments_per_hour", "speedup",
                                   "speedup_same_candidates", "swap_and_capture_s", "fast_tier_s", "slow_tier_s",
                                   "engine_start_s", "recovery_s", "breakdown_s", "restart_breakdown_s",
                                   "candidates_ok")}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
