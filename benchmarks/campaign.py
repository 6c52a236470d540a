"""Campaign figures (issue 6) in one run against one persistent engine.

1. Two tiers vs slow tier only: the same proposer and the same wall-clock budget; how many candidates each
   evaluates and the objective each ends with.
2. A/A: the same forward measured twice, many times; the ship rule (tkcc.agents.noise) calibrated on the
   first pairs is then applied to the rest, and every "ship" there is a false ship.
3. Drift: optimise on one trace, switch the traffic to another (longer contexts), re-check the shipped
   candidate (revert if it lost) and re-optimise; report what that gained on the new traffic.

The workload is the trace's decode buckets (objective: P90 per-user decode tokens/s, which depends on
decode steps only): eager prefill of the captured baseline cannot run at these prompt lengths on
olmoe-16l (transformers' batched_mm gathers every (token, expert) pair's weights).

The engine validates in exact mode where the model's reference forward reproduces itself bit for bit and
switches a tier to tolerance mode where it does not (olmoe-16l bf16 on an H200: see docs/engine.md,
"Determinism probe"); ``validation`` in the JSON says which mode each tier used and the measured
self-disagreement. ``--wall-limit`` keeps the whole run inside one device call: later stages shrink to the
time left (A/A stops early, the drift campaigns get what remains) and every stage is saved as it finishes.

    PYTHONPATH=. python benchmarks/campaign.py --model olmoe-16l --device cuda         # one H200
    PYTHONPATH=. python benchmarks/campaign.py --model olmoe-tiny --device cpu --budget 20 --aa 8  # smoke
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="olmoe-16l")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-cache-len", type=int, default=None, help="default 4096 on cuda, 512 on cpu")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per campaign (default 60)")
    ap.add_argument("--aa", type=int, default=50, help="A/A comparisons judged (default 50)")
    ap.add_argument("--aa-tier", default="fast", choices=["fast", "slow"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--buckets", type=int, default=4, help="decode buckets of the workload")
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--drift-trace", default="servegen-m-mid-81", help="bundled name or path (long contexts)")
    ap.add_argument("--tolerance", action="store_true", default=True)
    ap.add_argument("--validation", default="auto", choices=["auto", "exact", "tolerance"],
                    help="the engine's validation mode (tkcc serve --validation; default auto)")
    ap.add_argument("--wall-limit", type=float, default=0.0,
                    help="seconds for the whole run (0: none); later stages shrink to fit")
    ap.add_argument("--fair-tiers", action="store_true",
                    help="only stage 1, each campaign in its own fresh engine with its own Triton cache, so the "
                         "second does not reuse kernels the first compiled (writes campaign_fair.json)")
    ap.add_argument("--out", default=None, help="default benchmarks/results/campaign.json (campaign_fair.json)")
    args = ap.parse_args()

    from tkcc.agents.campaign import CampaignConfig, run_campaign
    from tkcc.agents.engine_eval import EngineEvaluator, spawned_engine
    from tkcc.agents.noise import NoiseModel
    from tkcc.agents.search import BayesianSearch, SearchSpace
    from tkcc.agents.ship import recheck_and_revert
    from tkcc.agents.store import ExperimentStore
    from tkcc.traffic.buckets import workload_from_trace
    from tkcc.traffic.loaders import bundled_trace, load_trace

    cap = args.max_cache_len or (4096 if args.device.startswith("cuda") else 512)
    args.out = args.out or str(ROOT / "benchmarks" / "results" / ("campaign_fair.json" if args.fair_tiers
                                                                  else "campaign.json"))

    def save(final: bool = False):
        """Write what is measured so far (a run cut short keeps its finished stages)."""
        out["complete"] = final
        for path in [args.out] + ([os.path.join(os.environ["OUT"], os.path.basename(args.out))] if os.environ.get("OUT") else []):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(out, indent=1, default=str))
    tmp = Path(tempfile.mkdtemp(prefix="tkcc-campaign-bench-"))
    store = ExperimentStore(tmp / "store.db")
    out: dict = {"model": args.model, "device": args.device, "budget_s": args.budget}
    t_start = time.time()

    def left() -> float:
        return args.wall_limit - (time.time() - t_start) if args.wall_limit > 0 else float("inf")

    def trace_path(name):
        return name if os.path.exists(name) else bundled_trace(name)

    def workload(name):
        tr = load_trace(trace_path(name))
        w = workload_from_trace(tr, max_context=cap - 1, batch_sizes=(1,), num_buckets=2 * args.buckets)
        return w.only("decode")

    def space():
        return SearchSpace.from_registry(exact_only=not args.tolerance, device=args.device)

    extra = ("--max-cache-len", str(cap), "--timeout", "300", "--validation", args.validation)
    if args.device == "cpu":
        extra += ("--threads", "1")
    if args.fair_tiers:
        return fair_tiers(args, tmp, extra, workload, space, save, out)
    with spawned_engine(args.model, args.device, str(tmp / "engine"), extra=extra) as client:
        out["engine_start_s"] = round(time.time() - t_start, 1)
        tiers_st = (client.status().get("worker") or {}).get("tiers") or {}
        out["validation_requested"] = args.validation
        out["validation"] = {t: v.get("validation") for t, v in tiers_st.items()}
        out["probe"] = {t: {k: v.get("deterministic", {}).get(k) for k in ("deterministic", "max_abs_diff",
                                                                           "max_norm_diff", "eager_vs_graph_abs",
                                                                           "worst", "buckets", "seconds")}
                        for t, v in tiers_st.items()}
        for t, v in out["validation"].items():
            print(f"{t} tier validation: {(v or {}).get('why')}", flush=True)
        save()
        w1 = workload(args.trace)
        out["workload"] = {"trace": args.trace, "fingerprint": w1.fingerprint(),
                           "buckets": [b.key() for b in w1.buckets]}

        # 1. two tiers vs slow only, same budget, same proposer seed
        res = {}
        for label, tiers in (("two_tier", ("fast", "slow")), ("slow_only", ("slow",))):
            res[label] = tier_campaign(args, client, store, w1, space, label, tiers)
        out.update(two_tier_candidates=res["two_tier"]["candidates"], slow_only_candidates=res["slow_only"]["candidates"],
                   two_tier_objective=res["two_tier"]["objective"], slow_only_objective=res["slow_only"]["objective"],
                   tiers=res)
        save()

        # 2. A/A: the serving forward measured twice per comparison
        wl = EngineEvaluator(client, w1).workload
        vals = []
        t0 = time.time()
        aa_budget = left() - (args.budget + 60)  # keep enough for the drift run
        for i in range(2 * (3 + args.aa)):
            if i >= 8 and i % 2 == 0 and time.time() - t0 > aa_budget:
                break  # out of wall time: judge the pairs measured so far (says how many below)
            m = client.measure(tier=args.aa_tier, workload=wl, reps=args.reps)
            vals.append(float(m["objective"]))
        n_aa = len(vals) // 2 - 3
        calib, judged = NoiseModel(), []
        for i in range(3):
            calib.add_pair(vals[2 * i], vals[2 * i + 1])
        for i in range(3, 3 + n_aa):
            judged.append(calib.decide(vals[2 * i + 1], vals[2 * i])[0])
        out.update(aa_comparisons=len(judged), aa_false_ships=int(sum(judged)), aa_tier=args.aa_tier,
                   aa_threshold=calib.threshold(), aa_wall_s=round(time.time() - t0, 1),
                   aa_relative_diffs=[vals[2 * i + 1] / vals[2 * i] - 1 for i in range(3 + n_aa)],
                   aa_validation=m["validation"].get("policy", {}).get("mode"))
        print("A/A", out["aa_comparisons"], "comparisons,", out["aa_false_ships"], "false ships; threshold",
              f"{calib.threshold() * 100:.2f}%", flush=True)
        save()

        # 3. drift: optimise on trace 1, switch to trace 2, re-check and re-optimise
        w2 = workload(args.drift_trace)
        drift_budget = max(10.0, min(args.budget, left() - 45))  # both halves, within the wall time left
        out["drift_budget_s"] = round(drift_budget, 1)
        st1 = run_campaign(CampaignConfig(name="drift-before", model=args.model, budget_s=drift_budget / 2),
                           store, BayesianSearch(space(), seed=2), EngineEvaluator(client, w1, reps=args.reps),
                           progress=False)
        ev2 = EngineEvaluator(client, w2, reps=args.reps)
        rc = recheck_and_revert(store, st1.campaign_id, ev2, st1.noise)
        st2 = run_campaign(CampaignConfig(name="drift-after", model=args.model, budget_s=drift_budget / 2),
                           store, BayesianSearch(space(), seed=3), ev2, progress=False)
        base2 = next((s["objective"] for s in store.ships(st2.campaign_id) if s["reason"] == "baseline"), None)
        out["drift"] = {"validation": {t: v.get("mode") for t, v in st2.validation.items()},
                        "before": {"trace": args.trace, "shipped": st1.shipped[0], "objective": st1.shipped[1]},
                        "new_traffic": {"trace": args.drift_trace, "fingerprint": w2.fingerprint(),
                                        "buckets": [b.key() for b in w2.buckets]},
                        "recheck": {"reverted": rc.reverted, "reason": rc.reason, "objectives": rc.objectives},
                        "after": {"shipped": st2.shipped[0], "objective": st2.shipped[1], "baseline": base2,
                                  "old_shipped_on_new_traffic": rc.objectives.get(st1.shipped[0]),
                                  "gain_over_old_shipped": (st2.shipped[1] / rc.objectives[st1.shipped[0]] - 1)
                                  if rc.objectives.get(st1.shipped[0]) else None}}
        print("drift", json.dumps(out["drift"], default=str)[:600], flush=True)
        status = client.status()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or os.environ.get("TKCC_COMMIT", "")
    env = (status.get("worker") or {}).get("env", {})
    out.update(env=env, commit=commit, command=" ".join(["python", *sys.argv]), wall_s=round(time.time() - t_start, 1),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    save(final=True)
    print(json.dumps({k: out[k] for k in ("two_tier_candidates", "slow_only_candidates", "two_tier_objective",
                                          "slow_only_objective", "aa_comparisons", "aa_false_ships")}))
    return 0


def tier_campaign(args, client, store, w1, space, label: str, tiers: tuple) -> dict:
    """One stage-1 campaign (``tiers``, the budget, proposer seed 1) on the engine behind ``client``; its summary."""
    from tkcc.agents.campaign import CampaignConfig, run_campaign
    from tkcc.agents.engine_eval import EngineEvaluator
    from tkcc.agents.search import BayesianSearch

    ev = EngineEvaluator(client, w1, reps=args.reps)
    cfg = CampaignConfig(name=label, model=args.model, budget_s=args.budget, tiers=tiers, batch=4)
    t0 = time.time()
    st = run_campaign(cfg, store, BayesianSearch(space(), seed=1), ev, progress=False)
    exps = store.experiments(st.campaign_id)
    ships = store.ships(st.campaign_id)
    res = {"candidates": len({e.candidate for e in exps if e.proposer == "search"}),
           "experiments": {t: sum(1 for e in exps if e.tier == t) for t in ("fast", "slow")},
           "objective": st.shipped[1], "shipped": st.shipped[0], "wall_s": round(time.time() - t0, 1),
           "baseline_objective": next((s["objective"] for s in ships if s["reason"] == "baseline"), None),
           "failed": sum(1 for e in exps if e.verdict != "measured"),
           "failures": [{"plan": e.plan, "tier": e.tier, "verdict": e.verdict, "reason": (e.reason or "")[:600]}
                        for e in exps if e.verdict != "measured"],
           "refused_ships": [{"plan": x["plan"], "reason": x["reason"][:600]} for x in ships
                             if x["action"] == "refused"],
           "validation": {t: v.get("mode") for t, v in st.validation.items()}}
    print(label, {k: v for k, v in res.items() if k not in ("failures", "refused_ships")}, flush=True)
    return res


def fair_tiers(args, tmp, extra, workload, space, save, out) -> int:
    """Stage 1 only, each campaign in a fresh engine with an empty Triton cache of its own."""
    from tkcc.agents.engine_eval import spawned_engine
    from tkcc.agents.store import ExperimentStore

    w1 = workload(args.trace)
    out["workload"] = {"trace": args.trace, "fingerprint": w1.fingerprint(), "buckets": [b.key() for b in w1.buckets]}
    out["tiers"] = {}
    for label, tiers in (("two_tier", ("fast", "slow")), ("slow_only", ("slow",))):
        env = {"TRITON_CACHE_DIR": str(tmp / label / "triton")}
        t_eng = time.time()
        with spawned_engine(args.model, args.device, str(tmp / label / "engine"), extra=extra, env=env) as client:
            start_s = round(time.time() - t_eng, 1)
            out["tiers"][label] = {"engine_start_s": start_s,
                                   **tier_campaign(args, client, ExperimentStore(tmp / label / "store.db"), w1, space,
                                                   label, tiers)}
        save()
    t, s = out["tiers"]["two_tier"], out["tiers"]["slow_only"]
    out.update(two_tier_candidates=t["candidates"], slow_only_candidates=s["candidates"],
               two_tier_objective=t["objective"], slow_only_objective=s["objective"],
               command=" ".join(["python", *sys.argv]),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    save(final=True)
    print(json.dumps({k: out[k] for k in ("two_tier_candidates", "slow_only_candidates", "two_tier_objective",
                                          "slow_only_objective")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
