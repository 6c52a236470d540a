"""Experiments per hour of one campaign on 1, 2 and 4 engine actors on Ray (issue 22's scaling figure).

Each setting runs the same campaign (same model, trace, seed, tiers, repetitions and loop budget) through
``tkcc.agents.ray_pool.RayEvaluator`` on one local Ray cluster, and counts the experiments recorded while
the loop ran (engine start-up is reported beside, not counted: it is paid once per campaign). Rows are
counted from the store, per engine.

  PYTHONPATH=. python benchmarks/ray_scaling.py --out benchmarks/results/ray_scaling.json     # CPU, ~3 min
  PYTHONPATH=. python benchmarks/ray_scaling.py --device cuda --model olmoe-16l --engines 1,2 --budget 120
  PYTHONPATH=. python benchmarks/ray_scaling.py --device cuda --model olmoe-16l --tp 2 --engines 1,2 --budget 90  # 4 GPUs

On CPU the engines share the machine's cores, so the figure is a stand-in for separate GPUs: K engines on
fewer than K free cores cannot scale.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path


def run_one(k: int, args, trace, tmp: Path) -> dict:
    from tkcc.agents.campaign import CampaignConfig, run_campaign
    from tkcc.commands.campaign_cmd import _workload_for
    from tkcc.agents.ray_pool import RayEvaluator
    from tkcc.agents.search import BayesianSearch, SearchSpace
    from tkcc.agents.store import ExperimentStore

    t0 = time.monotonic()
    ev = RayEvaluator(args.model, k, lambda c: _workload_for(c, trace), device=args.device, reps=args.reps,
                      gpus_per_engine=0.0 if args.device == "cpu" else 1.0, tp=args.tp)
    startup = time.monotonic() - t0
    import ray

    h = ev._handles[ev.engine]
    ray.get(h.info.remote())
    t2 = time.perf_counter()
    for _ in range(20):  # a round trip to an engine actor (driver -> actor -> driver), no engine work
        ray.get(h.info.remote())
    call_ms = round((time.perf_counter() - t2) / 20 * 1000, 2)
    try:
        store = ExperimentStore(tmp / f"k{k}.db")
        cfg = CampaignConfig(name=f"k{k}", model=args.model, budget_s=args.budget, batch=max(4, k))
        load0, t1 = os.getloadavg()[0], time.monotonic()
        state = run_campaign(cfg, store, BayesianSearch(SearchSpace.from_registry(exact_only=True,
                                                                                  device=ev.device_type),
                                                        seed=0), ev, progress=False)
        loop = time.monotonic() - t1
    finally:
        ev.close()
    rows = store.experiments(state.campaign_id)
    per_engine: dict[str, int] = {}
    for r in rows:
        per_engine[r.engine] = per_engine.get(r.engine, 0) + 1
    screened = sum(r.proposer == "search" and r.tier == cfg.tiers[0] for r in rows)
    cores = os.cpu_count() or 1
    by_kind: dict[str, int] = {}
    for r in rows:
        by_kind[r.proposer] = by_kind.get(r.proposer, 0) + 1
    return {"engines": k, "experiments": len(rows), "screened_candidates": screened, "rows_by_proposer": by_kind,
            "ships": sum(s["action"] == "ship" for s in store.ships(state.campaign_id)) - 1,
            # CPU stand-in: K engines get at most min(K, cores) cores, so this is the figure that can stay flat
            "experiments_per_hour_per_engine_core": round(len(rows) / loop * 3600 / min(k, cores)),
            "load_average_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "per_engine": per_engine, "loop_s": round(loop, 1), "startup_s": round(startup, 1),
            "experiments_per_hour": round(len(rows) / loop * 3600),
            "screened_per_hour": round(screened / loop * 3600),
            "mean_step_s": _mean_steps(rows), "actor_call_ms": call_ms, "stopped": state.stopped,
            # seconds each engine spent on its experiments over the loop's: 1.0 is an engine that never waited
            "busy_share": {e: round(sum(r.finished - r.started for r in rows if r.engine == e) / loop, 2)
                           for e in sorted(per_engine)},
            "row_bytes_mean": round(sum(len(json.dumps(r.measurement or {})) for r in rows) / max(1, len(rows))),
            "budget": state.budget}


def _commit() -> str:
    from provenance import commit

    return commit()


def _mean_steps(rows) -> dict:
    """Mean seconds of one experiment (build + validate + measure on its engine), per tier."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r.tier, []).append(r.finished - r.started)
    return {t: round(sum(v) / len(v), 3) for t, v in by.items()}


def _store_write_ms(tmp: Path, n: int = 200) -> float:
    """Driver cost of one row: an fsync'd SQLite insert of a typical measurement."""
    from tkcc.agents.store import ExperimentStore

    store = ExperimentStore(tmp / "write.db")
    cid = store.open_campaign("w", "m", {}, resume=False)
    meas = {"objective": 1.0, "buckets": [{"tokens_per_s": 1.0, "p50_ms": 1.0, "reps": 30}] * 8}
    t0 = time.perf_counter()
    for i in range(n):
        store.record(cid, candidate=f"c{i}", plan=[], proposer="search", workload_fp="w", tier="fast",
                     verdict="measured", objective=1.0, measurement=meas, engine="engine-0")
    ms = (time.perf_counter() - t0) / n * 1000
    store.close()
    return round(ms, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engines", default="1,2,4", help="engine counts to run (default 1,2,4)")
    ap.add_argument("--budget", type=float, default=25.0, help="loop budget of each campaign, seconds")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of each engine (GPUs per engine)")
    ap.add_argument("--out", default="benchmarks/results/ray_scaling.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from tkcc.agents.ray_pool import init_ray
    from tkcc.traffic.names import load_named_trace

    ks = [int(k) for k in args.engines.split(",")]
    trace = load_named_trace(args.trace)
    init_ray(None, num_cpus=max(ks) * args.tp + 1)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="tkcc-ray-scaling-") as tmp:
            for k in ks:
                r = run_one(k, args, trace, Path(tmp))
                rows.append(r)
                print(f"{k} engine(s): {r['experiments']} experiments in {r['loop_s']} s of loop "
                      f"({r['experiments_per_hour']}/h; {r['screened_per_hour']} screened candidates/h); "
                      f"start-up {r['startup_s']} s; per engine {r['per_engine']}, busy {r['busy_share']}; "
                      f"load {r['load_average_1m']}; stopped: {r['stopped']}",
                      flush=True)
    finally:
        ray.shutdown()
    with tempfile.TemporaryDirectory(prefix="tkcc-ray-store-") as tmp:
        store_ms = _store_write_ms(Path(tmp))
    base = rows[0]["experiments_per_hour"] if rows else 0
    for r in rows:
        r["speedup_vs_first"] = round(r["experiments_per_hour"] / base, 2) if base else None
    out = {"model": args.model, "device": args.device, "budget_s": args.budget, "reps": args.reps, "tp": args.tp,
           "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
           "trace": args.trace, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "note": ("CPU engines as a stand-in for GPUs: the engines share this machine's cores (and other work), "
                    "so K engines on fewer than K free cores cannot scale"
                    if args.device == "cpu" else "one GPU per engine actor"),
           "store_write_ms": store_ms, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("speedup vs 1 engine: " + ", ".join(f"{r['engines']}: {r['speedup_vs_first']}x" for r in rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
