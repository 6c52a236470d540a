"""Persistent engine vs restarting per candidate: experiments per hour on each tier, and where the time goes.

    PYTHONPATH=. python benchmarks/engine.py --out benchmarks/results/engine.json    # one H200 (olmoe-16l), ~5 min
    PYTHONPATH=. python benchmarks/engine.py --smoke --out /tmp/engine_smoke.json     # CPU (llama-tiny), ~1 min

What it does, all in one run:
1. starts ``tkcc serve`` (a real engine process) with its own kernel cache folder and compile pool;
2. warms the kernel cache: every candidate plan once on each tier (untimed here, but recorded: the cold
   cost of a candidate whose kernels are new, compiled ahead in the pool);
3. per tier, the timed pass, as a campaign runs it: while the engine measures candidate i, the next
   ``--ahead`` candidates are prepared (``prepare``: their kernel compiles listed and queued in the pool).
   Each experiment compiles the plan for the tier (passes + codegen + load), validates it on fresh inputs
   (on a GPU by CUDA-graph replays, against the reference's results kept per draw), swaps it in (reusing
   the graphs validation captured), measures every bucket (warm-up, then 10..reps: adaptive) and swaps it
   back out. Experiments per hour = candidates x 3600 / the pass's wall time (prepares included);
   ``breakdown_s`` splits each experiment per phase (``tkcc.agents.throughput``: the engine's critical path,
   and the pool's work in parallel);
4. submits one candidate that kills its worker (``os._exit``) and records how long the engine takes to
   recover (``--no-recovery`` skips it);
5. stops the engine and, per tier, starts fresh processes that import, build the model, capture, compile
   the same plan and validate + measure it the same way (``--restart-one``: the same EngineCore
   operations, the same kernel cache, warm): the restart baseline, timed for real, not assumed;
6. writes raw JSON to ``--out`` (and ``$OUT`` if set).

Workload: by default the engine's own (a 32-token prompt, 32 new tokens: one prefill bucket and two decode
buckets). ``--trace FILE`` builds it from a real trace instead, clipped to the KV cache length.
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
def experiment_record(res: dict, tier: str, plan, wall: float, prepared: dict | None = None) -> dict:
    """One experiment's time per phase, from the engine's own record of it (``tkcc.agents.throughput``)."""
    from tkcc.agents.throughput import phases_of

    rec = res["tiers"][tier]
    load, val = rec.get("load") or {}, rec.get("validation") or {}
    swap, meas = rec.get("swap") or {}, rec.get("measurement") or {}
    return {"plan": plan, "ok": res["ok"], "reason": res.get("reason"), "client_wall_s": wall,
            "seconds": rec.get("seconds"), "phases": phases_of(rec, None, prepared),
            "compile_phases_s": (load.get("info") or {}).get("phases_s"), "kernels": rec.get("kernels"),
            "jit": {k: (rec.get(k) or {}).get("jit") for k in ("load", "validation", "swap", "measurement")},
            "validation_mode": val.get("mode"), "replays": val.get("replays"),
            "reference": [sh.get("reference") for sh in val.get("shapes") or []],
            "graphs": swap.get("graphs"), "graphs_reused": swap.get("reused"), "eager": swap.get("eager"),
            "objective": meas.get("objective"),
            "buckets": [{k: b.get(k) for k in ("key", "median_s", "iqr_s", "ci_low_s", "ci_high_s", "reps", "stop",
                                              "warmup", "cuda_graph")} for b in meas.get("buckets", [])]}


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def breakdown(records: list[dict]) -> dict:
    """Median seconds per phase over a tier's experiments: the critical path, and the pool's in parallel."""
    from tkcc.agents.throughput import PHASES

    out = {k: med([r["phases"]["critical"].get(k) for r in records]) for k in PHASES}
    out["parallel_compile_s"] = med([r["phases"]["parallel"].get("compile") for r in records])
    out["total_s"] = med([r["client_wall_s"] for r in records])
    reps = [b["reps"] for r in records for b in r["buckets"]]
    out["reps_per_bucket"] = {"median": med(reps), "min": min(reps, default=None), "max": max(reps, default=None)}
    return out


def _serve(args, sock: str, workdir: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tkcc.cli", "serve", "--model", args.model, "--device", args.device, "--dtype",
           args.dtype, "--socket", sock, "--json", "--max-cache-len", str(args.max_cache_len),
           "--state-dir", os.path.join(workdir, "state"), "--kernel-cache", args.kernel_cache]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.fast_blocks:
        cmd += ["--fast-blocks", str(args.fast_blocks)]
    if args.compile_workers is not None:
        cmd += ["--compile-workers", str(args.compile_workers)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def log(msg: str) -> None:
    print(f"[engine bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed_pass(c, plans, tier: str, workload, reps: int, ahead: int) -> tuple[list[dict], float]:
    """The candidates on one tier as a campaign runs them: the next ``ahead`` prepared while one is measured.
    Returns (records, wall seconds of the whole pass, prepares included)."""
    records, prepared = [], {}
    t0 = time.perf_counter()
    for i, plan in enumerate(plans):
        for j in range(i, min(len(plans), i + 1 + ahead)):
            if j not in prepared:
                prepared[j] = (c.prepare({"plan": plans[j]}, tiers=tier) or {}).get(tier) or {}
        s = time.perf_counter()
        res = c.experiment({"plan": plan}, tiers=tier, workload=workload, reps=reps)
        rec = experiment_record(res, tier, plan, time.perf_counter() - s, prepared.get(i))
        records.append(rec)
        crit = rec["phases"]["critical"]
        log(f"{tier} #{i}: {'ok' if res['ok'] else 'FAILED ' + str(res.get('reason'))[:120]} in "
            f"{rec['client_wall_s']:.3f} s ({', '.join(f'{k} {v:.3f}' for k, v in crit.items())}; "
            f"reps {[b['reps'] for b in rec['buckets']]})")
    return records, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default olmoe-16l (llama-tiny with --smoke)")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --smoke)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--max-cache-len", type=int, default=None, help="default 4096 on cuda, 64 on cpu")
    ap.add_argument("--fast-blocks", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--candidates", type=int, default=None, help="candidates per tier (default 8; 3 with --smoke)")
    ap.add_argument("--restarts", type=int, default=1, help="real restart experiments per tier")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ahead", type=int, default=4, help="candidates prepared ahead of the one measured")
    ap.add_argument("--compile-workers", type=int, default=None, help="the engine's compile pool (default: cores)")
    ap.add_argument("--kernel-cache", default=None, help="kernel cache folder (default: a fresh one, warmed here)")
    ap.add_argument("--trace", default=None, help="build the workload from this trace (e.g. "
                    f"{os.path.relpath(TRACE, ROOT)}); default: the engine's own small workload")
    ap.add_argument("--buckets", type=int, default=3, help="workload buckets per phase (with --trace)")
    ap.add_argument("--no-recovery", action="store_true", help="skip the crash-recovery measurement")
    ap.add_argument("--smoke", action="store_true", help="a CPU run on llama-tiny: the script, not the figures")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "engine.json"))
    ap.add_argument("--restart-one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.restart_one:
        restart_one(args)
        return 0
    if args.smoke:
        args.model, args.device = args.model or "llama-tiny", args.device or "cpu"
        args.threads, args.reps = args.threads or 1, min(args.reps, 5)
        args.candidates = args.candidates or 3
    args.model, args.device = args.model or "olmoe-16l", args.device or "cuda"
    args.candidates = args.candidates or 8
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.max_cache_len = args.max_cache_len or (4096 if args.device.startswith("cuda") else 64)

    from tkcc.runtime import EngineClient
    from tkcc.runtime.measurement import commit

    workdir = tempfile.mkdtemp(prefix="tkcc-engine-bench-")
    args.kernel_cache = os.path.abspath(args.kernel_cache or os.path.join(workdir, "kernels"))
    os.environ["TKCC_KERNEL_CACHE"] = os.path.join(workdir, "rendered")  # rendered kernel sources, this run's
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
    results, walls, warm = {"slow": [], "fast": []}, {}, {"slow": [], "fast": []}
    try:
        with EngineClient(socket_path=sock) as c:
            status0 = c.status()
            for tier in ("slow", "fast"):  # warm the kernel cache: every plan once (kernels new: compiled ahead)
                warm[tier], walls[f"warm_{tier}"] = timed_pass(c, plans, tier, workload, args.reps, args.ahead)
            log("kernel cache warm; the timed passes")
            for tier in ("slow", "fast"):
                results[tier], walls[tier] = timed_pass(c, plans, tier, workload, args.reps, args.ahead)
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

    # ----------------------------------------------------------- restarts (the same warm kernel cache)
    restarts = {"slow": [], "fast": []}
    eng_cfg = {"model": args.model, "device": ready["device"], "dtype": args.dtype,
               "max_cache_len": args.max_cache_len, "fast_blocks": args.fast_blocks, "threads": args.threads,
               "state_dir": os.path.join(workdir, "restart"), "kernel_cache": args.kernel_cache}
    for tier in ("slow", "fast"):
        for i, plan in enumerate(plans[:args.restarts]):
            payload = json.dumps({"engine": eng_cfg, "candidate": {"plan": plan}, "tier": tier, "workload": workload,
                                  "reps": args.reps})
            s = time.perf_counter()
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--restart-one", payload],
                                 capture_output=True, text=True, cwd=ROOT)
            wall = time.perf_counter() - s
            if out.returncode != 0:
                raise SystemExit(f"restart experiment failed:\n{out.stderr[-3000:]}")
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            rec.update(wall_s=wall, plan=plan)
            restarts[tier].append(rec)
            log(f"restart {tier} #{i}: {wall:.1f} s (import {rec['import_s']:.1f}, build+capture "
                f"{rec['build_and_capture_s']:.1f}, compile {rec['compile_s']:.2f}, validate {rec['validate_s']:.2f},"
                f" swap+capture {rec['swap_and_capture_s']:.2f}, measure {rec['measure_s']:.2f})")

    # ------------------------------------------------------------ summary
    per_h = {t: 3600.0 * len(results[t]) / walls[t] if results[t] and walls[t] else None for t in results}
    restart_h = {t: 3600.0 / statistics.mean([r["wall_s"] for r in restarts[t]]) if restarts[t] else None
                 for t in restarts}
    ratio = {t: per_h[t] / restart_h[t] if per_h[t] and restart_h[t] else None for t in results}
    cold = {t: {"experiments": len(warm[t]), "wall_s": round(walls[f"warm_{t}"], 2),
                "experiments_per_hour": 3600.0 * len(warm[t]) / walls[f"warm_{t}"] if warm[t] else None,
                "breakdown_s": breakdown(warm[t]) if warm[t] else None} for t in warm}
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
        "experiments_per_hour": per_h, "restart_experiments_per_hour": restart_h,
        "engine_vs_restart": ratio, "goal": {"fast": 300.0, "slow": 30.0},
        "cold_kernels": cold,
        "breakdown_s": {t: breakdown(results[t]) for t in results if results[t]},
        "restart_breakdown_s": {t: {k: med([r.get(k) for r in restarts[t]]) for k in
                                    ("import_s", "build_and_capture_s", "compile_s", "validate_s",
                                     "swap_and_capture_s", "measure_s", "wall_s")} for t in restarts},
        "candidates_ok": {t: sum(r["ok"] for r in results[t]) for t in results},
        "engine_start_s": engine_start_s, "pass_wall_s": walls,
        "recovery_s": (recovery or {}).get("recovery_s"), "recovery": recovery,
        "compile_pool": ((status1.get("engine") or {}).get("compile")),
        "reference_bank": (status1.get("worker") or {}).get("reference_bank"),
        "memory": {"model_bytes": model_bytes, "cache_bytes": mem.get("cache_bytes"),
                   "engine_allocated_bytes": mem.get("allocated_bytes"),
                   "engine_max_allocated_bytes": mem.get("max_allocated_bytes"),
                   "engine_reserved_bytes": mem.get("reserved_bytes"),
                   "device_used_bytes_at_start": mem0.get("device_used_bytes"),
                   "device_used_bytes": mem.get("device_used_bytes"), "rss_bytes": mem.get("rss_bytes")},
        "workload": {"source": args.trace or "engine default",
                     "buckets": [b["key"] for b in results["slow"][0]["buckets"]] if results["slow"] else []},
        "baseline": {t: {"seconds": r["seconds"], "objective": (r.get("measurement") or {}).get("objective")}
                     for t, r in baseline["tiers"].items()},
        "experiments": results, "warm_up": warm, "restarts": restarts,
        "notes": "experiments_per_hour[tier] = candidates x 3600 / wall time of the tier's timed pass (each candidate "
                 "prepared ahead while earlier ones are measured, as tkcc campaign does; the kernel cache is warm "
                 "from the warm-up pass); restart_experiments_per_hour = 3600 / mean wall time of a fresh process "
                 "doing one experiment on that tier (import, build, capture, compile, validate, measure) with the "
                 "same warm kernel cache, timed for real. cold_kernels: the warm-up pass itself (kernels new, "
                 "compiled ahead in the pool). Both measure adaptively: warm-up, then 10 to --reps repetitions per "
                 "bucket, stopping once the median's 95% confidence interval is within +-0.5%.",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    copy = os.path.join(os.environ["OUT"], os.path.basename(args.out)) if os.environ.get("OUT") else None
    if copy and os.path.abspath(copy) != os.path.abspath(args.out):
        shutil.copy(args.out, copy)
    shutil.rmtree(workdir, ignore_errors=True)
    summary = {k: out[k] for k in ("experiments_per_hour", "restart_experiments_per_hour", "engine_vs_restart",
                                   "goal", "engine_start_s", "recovery_s", "breakdown_s", "candidates_ok")}
    summary["cold_kernels"] = {t: {k: v[k] for k in ("experiments", "wall_s", "experiments_per_hour")}
                               for t, v in cold.items()}
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
