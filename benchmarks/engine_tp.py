"""`tkcc serve --tp 2` on two GPUs: start, generate, validate and measure a sharded plan, stop.

    python benchmarks/engine_tp.py --model llama-1b-16l            # two GPUs (NCCL)
    python benchmarks/engine_tp.py --model llama-tiny --device cpu  # gloo smoke run

Writes ``benchmarks/results/engine_tp.json`` (and ``$OUT/engine_tp.json``): engine start time, the greedy tokens of
the sharded baseline next to the unsharded model's, each sharded plan's validation (tolerance mode, per-rank
errors, greedy agreement) and measurement per tier, and whether any process was left behind after stop.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b-16l")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--max-cache-len", type=int, default=2048)
    ap.add_argument("--strategies", nargs="*", default=None, help="default: tp, plus tp_ep for MoE models")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "engine_tp.json"))
    args = ap.parse_args(argv)

    from tkcc.runtime import EngineClient
    from tkcc.runtime.workloads import workload_to_json
    from tkcc.traffic import bundled_trace
    from tkcc.traffic.buckets import workload_from_trace
    from tkcc.traffic.loaders import load_trace

    tmp = tempfile.mkdtemp(prefix="tkcc-tp-")
    sock = os.path.join(tmp, "engine.sock")
    cmd = [sys.executable, "-m", "tkcc.cli", "serve", "--model", args.model, "--device", args.device, "--tp",
           str(args.tp), "--max-cache-len", str(args.max_cache_len), "--socket", sock, "--json", "--timeout", "300"]
    doc: dict = {"command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
                 "model": args.model, "device": args.device, "tp": args.tp}
    t0 = time.perf_counter()
    err = open(os.path.join(tmp, "engine.stderr"), "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    ready, stray = None, []
    for line in proc.stdout:  # the ready line; ranks' libraries (NCCL) may print to the same stdout first
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and obj.get("ready"):
            ready = obj
            break
        stray.append(line.rstrip()[:500])
    doc["stdout_before_ready"] = stray[-50:]
    if ready is None:
        proc.wait(60)
        print("\n".join(stray[-20:]), open(os.path.join(tmp, "engine.stderr")).read()[-4000:], file=sys.stderr)
        return 1
    doc["start_s"] = round(time.perf_counter() - t0, 2)
    doc["ready"] = ready
    print(f"engine up in {doc['start_s']} s: ranks {ready.get('rank_pids')}", flush=True)
    pids = [proc.pid] + list(ready.get("rank_pids") or [])
    try:
        with EngineClient(socket_path=sock) as c:
            st = c.status()
            doc["status"] = {"tp": st["worker"].get("tp"), "tiers": st["worker"].get("tiers")}
            prompt = [5, 77, 3, 19, 42, 8, 10, 23]
            doc["generate"] = c.generate(prompt, n=16)
            print("generate:", doc["generate"], flush=True)
            w = workload_from_trace(load_trace(bundled_trace("azure-conv")), max_context=args.max_cache_len,
                                    batch_sizes=(1,))
            if "moe" in args.model:  # eager prefill of long prompts through batched_mm gathers every (token,
                w = w.only("decode")  # expert) pair's weights: 128 GB at 2k tokens on olmoe-16l
            wl = workload_to_json(w)
        strategies = args.strategies or (["tp", "tp_ep"] if "olmoe" in args.model or "moe" in args.model else ["tp"])
        doc["experiments"] = {}
        for s in strategies:
            plan = [{"name": "sharding", "params": {"degree": args.tp, "strategy": s}}]
            t1 = time.perf_counter()
            with EngineClient(socket_path=sock) as c:
                res = c.experiment({"plan": plan}, tiers="both", workload=wl, reps=args.reps)
            res["wall_s"] = round(time.perf_counter() - t1, 2)
            doc["experiments"][s] = res
            print(s, "ok" if res.get("ok") else "FAILED", json.dumps(
                {t: {"validation": {k: r.get("validation", {}).get(k) for k in ("mode", "ok", "greedy")},
                     "objective": (r.get("measurement") or {}).get("objective"), "reason": r.get("reason")}
                 for t, r in res.get("tiers", {}).items()}, default=str)[:2000], flush=True)
        with EngineClient(socket_path=sock) as c:
            c.shutdown()
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        err.close()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    doc["left_behind"] = [p for p in pids if _alive(p)]
    doc["returncode"] = proc.returncode
    doc["engine_stderr_tail"] = open(os.path.join(tmp, "engine.stderr")).read()[-3000:]
    text = json.dumps(doc, indent=1, default=str)
    paths = [args.out] + ([os.path.join(os.environ["OUT"], os.path.basename(args.out))] if os.environ.get("OUT")
                          else [])
    for p in paths:
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        with open(p, "w") as f:
            f.write(text)
    print(f"stopped (rc {proc.returncode}), left behind: {doc['left_behind']}; wrote {', '.join(paths)}")
    return 0 if all(e.get("ok") for e in doc["experiments"].values()) and not doc["left_behind"] else 1


if __name__ == "__main__":
    sys.exit(main())
