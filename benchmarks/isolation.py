"""What isolating candidates costs per experiment: today's engine against this one, side by side, on CPU.

    PYTHONPATH=. python benchmarks/isolation.py --out benchmarks/results/isolation_cpu.json   # ~3 min, 2 cores
    PYTHONPATH=. python benchmarks/isolation.py --smoke                                     # one round

Three engines serve the same model (``llama-tiny`` by default, ``--threads 1``) at once, and the same
candidates go to each in turn (A, B, C, A, B, C, ...), so the machine's load falls on all of them alike:

* ``today``: the engine as it was before candidates were isolated (``--baseline-commit``, checked out with
  ``git archive`` into a temporary folder): candidates run in its worker, unchecked while timed;
* ``process``: this tree's default on a CPU: every candidate in a process forked from the worker, the
  reference in another, the worker's clock and checks, fresh inputs per timed call, sampled output checks;
* ``inprocess``: this tree with ``--isolation inprocess`` (what a GPU engine runs): candidates in the
  worker, its global state audited after each operation, the same fresh inputs and sampled checks.

Each experiment is one candidate on one tier (what a campaign runs): load, validate, swap, measure,
revert, unload, journal. Reported per engine: the median wall time of an experiment seen by the client,
its phases, and the ratio to ``today``; the baseline's measured objective on each engine (timing across
the process boundary adds a round trip per timed call: its cost shows there); the fork time of a trial
process; and start-up time. Raw JSON to ``--out``.
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

BASELINE_COMMIT = "ab5ee64"  # the engine before this isolation work


def _plans():
    from tkcc.compiler import default_plan

    return [None, [], [{"name": "dce"}], [{"name": "cse"}, {"name": "dce"}], default_plan().to_json()]


def _workload():
    import numpy as np

    from tkcc.runtime.workloads import workload_to_json
    from tkcc.traffic.buckets import workload_from_trace
    from tkcc.traffic.trace import Trace

    rng = np.random.default_rng(0)
    trace = Trace(np.arange(60) * 0.5, rng.integers(4, 40, 60), rng.integers(2, 20, 60))
    return workload_to_json(workload_from_trace(trace, max_context=64, batch_sizes=(1,), num_buckets=4))


def _checkout(commit: str, where: str) -> str:
    tree = os.path.join(where, "today")
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "tkcc"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    return tree


def _start(name: str, tree: str, tmp: str, model: str, extra: list[str]):
    sock = os.path.join(tmp, f"{name}.sock")
    cmd = [sys.executable, "-m", "tkcc.cli", "serve", "--model", model, "--device", "cpu", "--socket", sock,
           "--state-dir", os.path.join(tmp, f"{name}.state"), "--json", "--threads", "1", "--max-cache-len", "64",
           *extra]
    err = open(os.path.join(tmp, f"{name}.stderr"), "w")
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"})
    return proc, sock, err


def _ready(proc, sock, name):
    from tkcc.runtime.client import EngineClient

    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"engine {name} did not start")
    ready = json.loads(line)
    return ready, EngineClient(socket_path=sock)


def _experiment(client, plan, tier, workload, reps) -> dict:
    spec = {"baseline": True} if plan is None else {"plan": plan}
    t0 = time.perf_counter()
    res = client.experiment(spec, tiers=tier, workload=workload, reps=reps)
    wall = time.perf_counter() - t0
    rec = res["tiers"][tier]
    m = rec.get("measurement") or {}
    return {"ok": res["ok"], "reason": res.get("reason"), "wall_s": wall, "engine_s": rec.get("seconds"),
            "compile_s": (rec.get("load") or {}).get("compile_s"),
            "validate_s": (rec.get("validation") or {}).get("seconds"),
            "measure_s": m.get("supervisor_wall_s"), "objective": m.get("objective"),
            "checked": sum(b.get("checked", 0) for b in m.get("buckets", [])),
            "reps": sum(b.get("reps", 0) for b in m.get("buckets", []))}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--baseline-commit", default=BASELINE_COMMIT)
    ap.add_argument("--engines", default="today,process,inprocess")
    ap.add_argument("--smoke", action="store_true", help="one round, two candidates")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rounds = 1 if args.smoke else args.rounds
    plans = _plans()[:2] if args.smoke else _plans()
    names = args.engines.split(",")
    tmp = tempfile.mkdtemp(prefix="tkcc-isolation-bench-")
    workload = _workload()
    engines, out = {}, {"engines": {}, "command": " ".join([sys.executable] + sys.argv), "model": args.model}
    try:
        t0 = time.perf_counter()
        for name in names:
            tree = _checkout(args.baseline_commit, tmp) if name == "today" else ROOT
            extra = [] if name == "today" else ["--isolation", name]
            engines[name] = _start(name, tree, tmp, args.model, extra)
        clients = {}
        for name, (proc, sock, _err) in engines.items():
            ready, clients[name] = _ready(proc, sock, name)
            out["engines"][name] = {"startup_s": ready.get("startup_s"), "isolation": ready.get("isolation", "inprocess"),
                                    "tree": args.baseline_commit if name == "today" else "this tree", "runs": []}
        out["startup_wall_s"] = time.perf_counter() - t0
        for r in range(rounds):
            for k, plan in enumerate(plans):
                for tier in ("fast", "slow"):
                    order = names[(r + k) % len(names):] + names[:(r + k) % len(names)]  # rotate who goes first
                    for name in order:
                        row = _experiment(clients[name], plan, tier, workload, args.reps)
                        row.update(round=r, plan=k, tier=tier)
                        out["engines"][name]["runs"].append(row)
                        print(f"{name:10s} round {r} plan {k} {tier}: {row['wall_s']:.3f} s "
                              f"{'ok' if row['ok'] else row['reason']}", file=sys.stderr, flush=True)
        for name, c in clients.items():
            st = c.status()
            out["engines"][name]["worker_isolation"] = (st.get("worker") or {}).get("isolation")
            out["engines"][name]["restarts"] = st["engine"]["restarts"]
    finally:
        for name, (proc, sock, err) in engines.items():
            try:
                from tkcc.runtime.client import EngineClient

                with EngineClient(socket_path=sock) as c:
                    c.shutdown()
                proc.wait(60)
            except Exception:  # noqa: BLE001 - never leave an engine running
                proc.kill()
                proc.wait(30)
            err.close()
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {}
    for name, e in out["engines"].items():
        runs = [x for x in e["runs"] if x["ok"]]
        base = [x["objective"] for x in runs if x["plan"] == 0 and x["tier"] == "slow"]
        summary[name] = {"experiments": len(e["runs"]), "failed": len(e["runs"]) - len(runs),
                         "median_experiment_s": _median(x["wall_s"] for x in runs),
                         "median_fast_s": _median(x["wall_s"] for x in runs if x["tier"] == "fast"),
                         "median_slow_s": _median(x["wall_s"] for x in runs if x["tier"] == "slow"),
                         "median_compile_s": _median(x["compile_s"] for x in runs),
                         "median_validate_s": _median(x["validate_s"] for x in runs),
                         "median_measure_s": _median(x["measure_s"] for x in runs),
                         "baseline_slow_objective": _median(base), "checked_calls": _median(x["checked"] for x in runs),
                         "startup_s": e["startup_s"],
                         "fork_s_median": (e.get("worker_isolation") or {}).get("fork_s_median")}
    ref = summary.get("today", {}).get("median_experiment_s")
    ref_obj = summary.get("today", {}).get("baseline_slow_objective")
    for name, s in summary.items():
        if ref and s["median_experiment_s"]:
            s["cost_ratio_vs_today"] = s["median_experiment_s"] / ref
        if ref_obj and s["baseline_slow_objective"]:
            s["baseline_objective_ratio_vs_today"] = s["baseline_slow_objective"] / ref_obj
    out["summary"] = summary
    import torch

    out["env"] = {"date": datetime.date.today().isoformat(), "host": platform.node(), "cpu": platform.processor(),
                  "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                  "rounds": rounds, "plans": len(plans), "reps": args.reps, "workload_buckets": len(workload["buckets"])}
    print(json.dumps(summary, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
