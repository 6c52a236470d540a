"""Layout benchmark: measured decode ms/token at degree 1 and 2 for each strategy, next to the cost model.

    python benchmarks/layout.py                      # two H200s: olmoe-16l, llama-1b-16l; batch 1, 8; ctx 2k, 32k
    python benchmarks/layout.py --quick              # CPU smoke run: tiny models, gloo, short contexts
    python benchmarks/layout.py --models llama-1b-16l --contexts 2048   # a subset
    python benchmarks/layout.py --assemble $OUT/layout_partial.jsonl    # predictions for a run cut short

Every rank builds the model (bf16, seed 0) on its GPU and captures its decode
step once per (batch, cache length) with ``max_cache_len = context + 16``, so
the decode attends over the context it is measured at. For each setting it
times the unsharded graph on rank 0 (degree 1), then shards it (pass
``sharding``) for every strategy and times the sharded graph on both ranks in
lockstep (degree 2): CUDA events around each step, median of ``--reps`` steps
after warm-up, input ids rotated, both under a CUDA graph (what the engine
serves) and eagerly; the reported time is the slowest rank's median. The
cost model predicts each from the machine profile, measured at the start of
the run (bandwidth, dispatch, kernel floor, all-reduce fit at degree 2) and
cached in ``~/.cache/tkcc/machine.json``. Degrees 4 and 8 are predicted only
(``measured_ms: null``).

Each measurement is appended to ``layout_partial.jsonl`` (in ``$OUT`` or
beside ``--out``) as it is taken, so a run stopped by its time limit keeps
what it measured. Raw rows go to ``benchmarks/results/layout.json`` (and ``$OUT/layout.json``
when ``$OUT`` is set): model, batch, context, degree, strategy, measured_ms,
predicted_ms, plus the eager pair, the mode, the prediction's terms, device,
versions, commit and command.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing tkcc
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")  # spawned ranks too

FULL = dict(models=["olmoe-16l", "llama-1b-16l"], batches=[1, 8], contexts=[2048, 32768], dtype="bfloat16")
QUICK = dict(models=["olmoe-tiny", "llama-tiny"], batches=[1, 2], contexts=[32, 128], dtype="float32")


def _time_steps(step, n_warm: int, reps: int, dev) -> list[float]:
    """Milliseconds per call of ``step(i)``."""
    for i in range(n_warm):
        step(i)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        out = []
        for i in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(i)
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        return out
    out = []
    for i in range(reps):
        t0 = time.perf_counter()
        step(i)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _measure(gm, ids_pool, pos, dev, reps: int, use_graph: bool) -> tuple[float | None, str]:
    """(median ms per decode step, note). ``ids_pool``: [R, B, 1] token ids rotated per step."""
    static_ids = ids_pool[0].clone()
    static_pos = torch.tensor([pos], device=dev)

    def eager(i):
        static_ids.copy_(ids_pool[i % len(ids_pool)])
        return gm(static_ids, static_pos)

    if not use_graph:
        return statistics.median(_time_steps(eager, 3, reps, dev)), "eager"
    from tkcc.kernels.graph_replay import CapturedCall

    try:
        g = CapturedCall(gm, (static_ids, static_pos), warmup=3, device=dev)
        graph_ids = g.static_args[0]

        def replay(i):
            graph_ids.copy_(ids_pool[i % len(ids_pool)])
            g.replay()

        return statistics.median(_time_steps(replay, 3, reps, dev)), "cuda_graph"
    except Exception as e:  # noqa: BLE001 - record why, the eager number still stands
        return None, f"cuda graph capture failed: {type(e).__name__}: {str(e)[:200]}"


def _profile_on_ranks(rank, world, dev):
    """Machine profile: cached, or measured here (collectives inside this very group)."""
    import torch.distributed as dist

    from tkcc.parallel import machine as mach

    name, count = mach.current_device()
    cached = mach.load_profiles().get(mach.machine_key(name, count))
    have = [cached is not None and str(world) in (cached or {}).get("all_reduce", {})]
    objs = [have[0]]
    dist.broadcast_object_list(objs, src=0)
    if objs[0]:
        return mach.MachineProfile(**cached) if rank == 0 else None
    raw = mach._collective_rank(rank, world)
    gathered = [None] * world
    dist.all_gather_object(gathered, raw)
    if rank != 0:
        return None
    dispatch, kernel = mach.measure_floor(dev)
    prof = mach.MachineProfile(device=name, count=count, mem_bw_gbs=mach.measure_bandwidth(dev),
                               dispatch_us=dispatch, kernel_us=kernel,
                               torch_version=torch.__version__,
                               measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               **mach.measure_op_costs(dev))
    fits = {}
    for mode in [m for m in raw if not m.endswith("_error") and all(m in r for r in gathered)]:
        samples = [(n, max(r[mode][i][1] for r in gathered)) for i, (n, _) in enumerate(raw[mode])]
        lat, bw = mach._fit(samples, world)
        fits[mode] = dict(lat_us=lat, busbw_gbs=bw, mode=mode, samples=samples)
    prof.all_reduce[str(world)] = fits
    mach.save_profile(prof)
    return prof


def _partial(cfg, kind, payload) -> None:
    """Append one record to the partial log (so a run cut short still leaves its measurements)."""
    path = cfg.get("partial")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "data": payload}, default=str) + "\n")


def bench_rank(rank, world, cfg):
    import torch.distributed as dist

    from tkcc.frontend.hf import capture_hf
    from tkcc.frontend.models import build_model
    from tkcc.parallel.cost import count_ops
    from tkcc.parallel.layout import dims_from_config, legal_strategies
    from tkcc.passes.sharding import shard_program

    dev = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, cfg["dtype"])
    prof = _profile_on_ranks(rank, world, dev)
    if rank == 0:
        _partial(cfg, "profile", prof.to_json())
    rows = []
    use_graph = dev.type == "cuda"
    for name in cfg["models"]:
        t0 = time.perf_counter()
        overrides = {"max_position_embeddings": max(cfg["contexts"]) + 64}
        model = build_model(name, dtype=dtype, device=dev, **overrides)
        dims = dims_from_config(model.config, name)
        build_s = time.perf_counter() - t0
        for batch in cfg["batches"]:
            for ctx in cfg["contexts"]:
                t1 = time.perf_counter()
                prog = capture_hf(model, phases=["decode"], max_cache_len=ctx + 16, batch=batch)
                capture_s = time.perf_counter() - t1
                g = torch.Generator(device="cpu").manual_seed(0)
                ids_pool = torch.randint(0, dims.vocab, (8, batch, 1), generator=g).to(dev)
                base_ops = count_ops(prog.graphs["decode"])
                # degree 1: rank 0 alone
                if rank == 0:
                    with torch.no_grad():
                        m_graph, note = (_measure(prog.graphs["decode"], ids_pool, ctx, dev, cfg["reps"], True)
                                         if use_graph else (None, "no CUDA: eager only"))
                        m_eager, _ = _measure(prog.graphs["decode"], ids_pool, ctx, dev, cfg["reps"], False)
                    rows.append(dict(model=name, batch=batch, context=ctx, degree=1, strategy="tp",
                                     measured_graph_ms=m_graph, measured_eager_ms=m_eager, note=note,
                                     ops=base_ops, capture_s=round(capture_s, 2), build_s=round(build_s, 2)))
                    _partial(cfg, "row", rows[-1])
                dist.barrier()
                for strategy in legal_strategies(dims):
                    sharded, _info = shard_program(prog, world, strategy)
                    ops = {**count_ops(sharded.graphs["decode"]), "sharded": True}
                    with torch.no_grad():
                        m_graph, note = (_measure(sharded.graphs["decode"], ids_pool, ctx, dev, cfg["reps"], True)
                                         if use_graph else (None, "no CUDA: eager only"))
                        m_eager, _ = _measure(sharded.graphs["decode"], ids_pool, ctx, dev, cfg["reps"], False)
                    both = [None] * world
                    dist.all_gather_object(both, (m_graph, m_eager))
                    if rank == 0:
                        mg = None if any(b[0] is None for b in both) else max(b[0] for b in both)
                        rows.append(dict(model=name, batch=batch, context=ctx, degree=world, strategy=strategy,
                                         measured_graph_ms=mg, measured_eager_ms=max(b[1] for b in both),
                                         note=note, ops=ops, base_ops=base_ops,
                                         collectives=sharded.meta["layout"]["collectives"]))
                        _partial(cfg, "row", rows[-1])
                    del sharded
                    dist.barrier()
                del prog
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        del model
    return {"rows": rows, "profile": prof.to_json() if prof is not None else None}


def _tree() -> str:
    from provenance import commit

    return commit()


def assemble(raw_rows, profile, cfg, command) -> tuple[list[dict], dict]:
    """Add predictions to measured rows, add degree 4/8 prediction rows, and summarise the picks."""
    from tkcc.parallel.cost import predict
    from tkcc.parallel.layout import check_layout, dims_for_model, legal_strategies, LayoutError
    from tkcc.parallel.machine import MachineProfile

    prof = MachineProfile(**profile)
    dtype_bytes = torch.tensor([], dtype=getattr(torch, cfg["dtype"])).element_size()
    common = dict(device=f"{prof.device} x{prof.count}", dtype=cfg["dtype"], torch=torch.__version__,
                  commit=_tree(), command=command,
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    out = []
    for r in raw_rows:
        dims = dims_for_model(r["model"], max_position_embeddings=max(cfg["contexts"]) + 64)
        kw = dict(batch=r["batch"], context=r["context"], cache_len=r["context"] + 16, dtype_bytes=dtype_bytes,
                  ops=r["ops"])
        pg = predict(dims, r["degree"], r["strategy"], prof, mode="cuda_graph", **kw)
        pe = predict(dims, r["degree"], r["strategy"], prof, mode="eager", **kw)
        graph_ok = r["measured_graph_ms"] is not None
        out.append(dict(model=r["model"], batch=r["batch"], context=r["context"], degree=r["degree"],
                        strategy=r["strategy"],
                        measured_ms=r["measured_graph_ms"] if graph_ok else r["measured_eager_ms"],
                        predicted_ms=pg.ms_per_token if graph_ok else pe.ms_per_token,
                        mode="cuda_graph" if graph_ok else "eager",
                        measured_eager_ms=r["measured_eager_ms"], predicted_eager_ms=pe.ms_per_token,
                        terms=pg.terms if graph_ok else pe.terms, eager_terms=pe.terms, prediction_notes=pg.notes,
                        note=r.get("note"), ops=r["ops"], collectives=r.get("collectives"), **common))
    # degrees 4 and 8: predictions only, op counts from the degree-2 graphs' base counts
    settings = {(r["model"], r["batch"], r["context"]): r for r in raw_rows if r["degree"] == 1}
    for (model, batch, ctx), r in settings.items():
        dims = dims_for_model(model, max_position_embeddings=max(cfg["contexts"]) + 64)
        for d in (4, 8):
            for s in legal_strategies(dims):
                try:
                    check_layout(dims, d, s)
                except LayoutError:
                    continue
                kw = dict(batch=batch, context=ctx, cache_len=ctx + 16, dtype_bytes=dtype_bytes, ops=r["ops"])
                pg = predict(dims, d, s, prof, mode="cuda_graph", **kw)
                pe = predict(dims, d, s, prof, mode="eager", **kw)
                out.append(dict(model=model, batch=batch, context=ctx, degree=d, strategy=s, measured_ms=None,
                                predicted_ms=pg.ms_per_token, mode="cuda_graph", measured_eager_ms=None,
                                predicted_eager_ms=pe.ms_per_token, terms=pg.terms, eager_terms=pe.terms,
                                prediction_notes=pg.notes, **common))
    summary = {}
    for key in settings:
        rows = [o for o in out if (o["model"], o["batch"], o["context"]) == key and o["measured_ms"] is not None]
        best_m = min(rows, key=lambda o: o["measured_ms"])
        best_p = min(rows, key=lambda o: o["predicted_ms"])
        errs = [abs(o["predicted_ms"] - o["measured_ms"]) / o["measured_ms"] for o in rows]
        summary["/".join(map(str, key))] = dict(
            measured_best=f"{best_m['degree']}/{best_m['strategy']}", predicted_best=f"{best_p['degree']}/"
            f"{best_p['strategy']}", pick_ok=(best_m["degree"], best_m["strategy"]) == (best_p["degree"],
                                                                                      best_p["strategy"]),
            max_rel_err=max(errs))
    return out, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run (tiny models, gloo)")
    ap.add_argument("--models", nargs="*")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "layout.json"))
    ap.add_argument("--batches", nargs="*", type=int)
    ap.add_argument("--contexts", nargs="*", type=int)
    ap.add_argument("--timeout", type=float, default=540.0)
    ap.add_argument("--assemble", metavar="PARTIAL_JSONL",
                    help="no measuring: add predictions to the rows of an earlier run's partial log")
    ap.add_argument("--op-costs", metavar="JSON",
                    help="with --assemble: per-op machine numbers (tkcc.parallel.machine.measure_op_costs, "
                         "measured on the same kind of machine) for a profile recorded without them")
    args = ap.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    for k in ("models", "batches", "contexts"):
        if getattr(args, k):
            cfg[k] = getattr(args, k)
    cfg["reps"] = args.reps if not args.quick else min(args.reps, 10)
    out_dir = os.environ.get("OUT") or os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    cfg["partial"] = os.path.join(out_dir, "layout_partial.jsonl")
    from tkcc.parallel.launch import RankError, launch

    t0 = time.perf_counter()
    if args.assemble:
        recs = [json.loads(line) for line in open(args.assemble)]
        raw = {"profile": next(r["data"] for r in recs if r["kind"] == "profile"),
               "rows": [r["data"] for r in recs if r["kind"] == "row"]}
        if args.op_costs:
            with open(args.op_costs) as f:
                costs = json.load(f)
            raw["profile"].update({k: costs[k] for k in ("stream_bw_gbs", "gemv_us", "attn_floor_us",
                                                         "expand_copy_gbs", "topk_us")})
            raw["profile"]["derived_from"] = f"per-op numbers from {os.path.basename(args.op_costs)}: " + \
                str(costs.get("note", ""))
    else:
        if os.path.exists(cfg["partial"]):
            os.remove(cfg["partial"])
        try:
            res = launch(bench_rank, 2, (cfg,), timeout_s=args.timeout, collective_timeout_s=120,
                         threads=None if torch.cuda.is_available() else 1)
        except RankError as e:
            print(f"layout benchmark stopped: {e}\nmeasurements so far: {cfg['partial']} "
                  f"(python benchmarks/layout.py --assemble {cfg['partial']})", file=sys.stderr)
            return 1
        raw = res[0]
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    rows, summary = assemble(raw["rows"], raw["profile"], cfg, command)
    doc = {"rows": rows, "summary": summary, "machine": raw["profile"], "wall_s": round(time.perf_counter() - t0, 1),
           "config": cfg}
    text = json.dumps(doc, indent=1, default=str)
    paths = [args.out] + ([os.path.join(os.environ["OUT"], "layout.json")] if os.environ.get("OUT") else [])
    for p in paths:
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        with open(p, "w") as f:
            f.write(text)
    print(f"{'model':<14}{'batch':>6}{'ctx':>7}{'deg':>4} {'strategy':<7}{'measured':>10}{'predicted':>10}"
          f"{'eager':>9}{'pred.e':>9}")
    for r in rows:
        m = "-" if r["measured_ms"] is None else f"{r['measured_ms']:.3f}"
        me = "-" if r["measured_eager_ms"] is None else f"{r['measured_eager_ms']:.3f}"
        print(f"{r['model']:<14}{r['batch']:>6}{r['context']:>7}{r['degree']:>4} {r['strategy']:<7}{m:>10}"
              f"{r['predicted_ms']:>10.3f}{me:>9}{r['predicted_eager_ms']:>9.3f}")
    print(json.dumps(summary, indent=1))
    print(f"wrote {', '.join(paths)} in {doc['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
