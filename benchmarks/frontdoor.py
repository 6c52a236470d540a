"""The front door against what a user would run instead, in one run: HF eager, torch.compile, the lab path.

    python benchmarks/frontdoor.py --models llama-1b-16l olmoe-16l --out benchmarks/results/frontdoor.json
    python benchmarks/frontdoor.py --smoke       # CPU: llama-tiny, tiny contexts, a few-second budget

Per model (bf16, batch 1, greedy, on the GPU):
- ``hf_eager``: HF's own decode step over its StaticCache (``benchmarks/decode.py``'s timer);
- ``torch_compile``: the same with ``torch.compile(max-autotune)``, each context compiled in a fresh
  process (``decode.py --compile-only``), as BENCH.md asks;
- ``lab_best``: ``decode.py``'s best variant (``lowered``: the graph-lowered decode step, its kernels tuned
  and its attention layout tuned at each context, built on a cache sized to the context and judged against
  the captured graph run in fp32), driven directly;
- ``frontdoor``: ``tkcc.compile(model, "azure-conv", mode="tolerance")`` at its default budget, then
  ``compiled.stream``: ms/token = the time from the first new token to the (N+1)-th, / N (the decode alone,
  no prefill in it), median of 3, after a warm-up, at each context (a prompt of that length);
- ``loaded``: ``compiled.save`` then ``tkcc.load`` in a fresh process: time to first token (load included)
  and ms/token the same way, in rounds alternating with the front door's at each context (``--rounds``), so that
  both are timed under the same device state and each one's spread shows what difference is noise;
- ``objective``: P90 per-user decode tokens/s on the Azure conv trace from each variant's ms/token curve
  (``decode.py``'s ``objective_rows``), front door against torch.compile.
Raw rows go to ``--out`` (a list of rows, see ``issues show 17``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CUDA = torch.cuda.is_available()


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def out_paths_for(out: str) -> list[Path]:
    """Where a benchmark's raw JSON goes: ``out``, and on the device machine the same name under ``$OUT``."""
    return [Path(out)] + ([Path(os.environ["OUT"]) / Path(out).name] if os.environ.get("OUT") else [])


def sync():
    if CUDA:
        torch.cuda.synchronize()


def decode_ms(stream, ids, n: int) -> float:
    """ms per token of ``n`` decode steps: from the first new token (the prompt's prefill done) to the last.

    Timing ``generate`` of 1 + n tokens against 1 put two prefills in the difference; at 2k context their
    variance (tens of ms) moved a round by as much as the decode itself (olmoe-16l: rounds of 0.75 to 2.19)."""
    steps = stream(ids, n + 1)
    next(steps)
    sync()
    t0 = time.perf_counter()
    for _ in steps:
        pass
    sync()
    return (time.perf_counter() - t0) / n * 1e3


def one_round(stream, ids, n: int, reps: int = 3) -> float:
    """One round's ms/token: the median of ``reps`` back-to-back ``decode_ms``."""
    return statistics.median(decode_ms(stream, ids, n) for _ in range(reps))


def ms_per_token(stream, ids, n: int, reps: int) -> float:
    """``one_round`` of ``reps``, after one warm-up."""
    decode_ms(stream, ids, n)
    return one_round(stream, ids, n, reps)


def prompt(context: int, vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(context)
    return torch.randint(0, vocab, (1, context), generator=g).to(device)


_CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/benchmarks")
t_start = time.perf_counter()
import tkcc
from tkcc.frontend.models import build_model
from frontdoor import one_round, prompt, sync
name, path, contexts, n, dtype = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]), \
    getattr(torch, sys.argv[6])
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = build_model(name, dtype=dtype, device=dev, max_position_embeddings=max(contexts) + n + 64)
t_model = time.perf_counter()
c = tkcc.load(path, model)
ids = prompt(contexts[0], model.config.vocab_size, dev)
c.generate(ids, 1); sync()
print(json.dumps({"ttft_s": time.perf_counter() - t_model, "process_s": time.perf_counter() - t_start,
                  "serves": c.serves}), flush=True)
warm = set()
for line in sys.stdin:  # one round per request, at the context asked: the parent interleaves them with its own
    ctx = json.loads(line)["ctx"]
    ids = prompt(ctx, model.config.vocab_size, dev)
    if ctx not in warm:
        one_round(c.stream, ids, n); warm.add(ctx)
    print(json.dumps({"ms": one_round(c.stream, ids, n)}), flush=True)
"""


def side_by_side(compiled, name, path, contexts, n, rounds, dtype, vocab, dev) -> tuple[list, dict]:
    """The front door and its saved artifact loaded in a fresh process, timed in alternating rounds at each
    context (one round each, in turn, ``rounds`` times): both see the same device state, and each one's spread
    over its rounds says how large a difference between them is noise (METHOD.md: time the same version twice).
    Rows: (frontdoor, loaded) per context, medians, with the rounds; the child's time to first token."""
    cmd = [sys.executable, "-c", _CHILD, str(ROOT), name, str(path), json.dumps(contexts), str(n),
           str(dtype).replace("torch.", "")]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        if not line:
            err = child.stderr.read()[-2000:]
            log(f"{name}: the loaded artifact failed in a fresh process: {err}")
            return [], {"error": err}
        info = json.loads(line)
        rows = []
        for c in contexts:
            ids = prompt(c, vocab, dev)
            one_round(compiled.stream, ids, n)  # warm-up (the child warms up on its first request)
            mine, theirs = [], []
            for _ in range(rounds):
                mine.append(one_round(compiled.stream, ids, n))
                child.stdin.write(json.dumps({"ctx": c}) + "\n")
                child.stdin.flush()
                got = child.stdout.readline()
                if not got:
                    raise RuntimeError(f"the loaded process ended: {child.stderr.read()[-2000:]}")
                theirs.append(json.loads(got)["ms"])
            for variant, ms in (("frontdoor", mine), ("loaded", theirs)):
                rows.append(dict(model=name, context=c, variant=variant, ms_per_token=statistics.median(ms),
                                 rounds_ms=ms, spread_ms=max(ms) - min(ms)))
            rows[-1].update(ttft_s=info["ttft_s"], fresh_process_s=info["process_s"])
            d = statistics.median(theirs) - statistics.median(mine)
            log(f"{name} ctx={c}: frontdoor {statistics.median(mine):.3f}, loaded {statistics.median(theirs):.3f} "
                f"ms/token ({d / statistics.median(mine):+.1%}; spreads {max(mine) - min(mine):.3f} / "
                f"{max(theirs) - min(theirs):.3f})")
        return rows, info
    finally:
        if child.poll() is None:
            child.stdin.close()
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()


def same_contexts(lab, curve: list[dict], model: str) -> dict:
    """Each variant's P90 against the front door's over the contexts both measured: a curve over fewer contexts
    (a row the time limit cut, or refused) interpolates a different stretch of the trace, so its P90 is not the
    front door's to compare with. {variant: {"contexts", "frontdoor", variant}}."""
    mine = {r["context"] for r in curve if r["model"] == model and r["variant"] == "frontdoor"}
    out = {}
    for v in sorted({r["variant"] for r in curve if r["model"] == model} - {"frontdoor"}):
        common = sorted(mine & {r["context"] for r in curve if r["model"] == model and r["variant"] == v})
        if not common:
            continue
        sub = [r for r in curve if r["model"] == model and r["variant"] in ("frontdoor", v) and r["context"] in common]
        got = {o["variant"]: o["p90_decode_tokens_per_s"] for o in lab.objective_rows(sub, [model])
               if o["trace"] == "azure-conv"}
        out[v] = {"contexts": common, "frontdoor": got.get("frontdoor"), v: got.get(v)}
    return out


def experiment_timeline(loop: dict | None) -> list[dict]:
    """Each experiment of the compile's loop, from its store: when it started (s after the first), its tier,
    passes, verdict, seconds, and where they went on the engine's critical path (what a compile wall past its
    budget is read from)."""
    from tkcc.agents.store import ExperimentStore

    if not loop or not loop.get("store") or not loop.get("campaign"):
        return []
    store = ExperimentStore(loop["store"])
    exps = store.experiments(int(loop["campaign"]))
    t0 = min((e.started for e in exps), default=0.0)
    return [{"start_s": round(e.started - t0, 1), "seconds": round(e.finished - e.started, 1), "tier": e.tier,
             "candidate": e.candidate[:8], "proposer": e.proposer, "verdict": e.verdict,
             "passes": [(st.get("name"), st.get("params") or {}) for st in e.plan],
             "objective": e.objective, "critical": (e.timing or {}).get("critical"), "reason": e.reason,
             "validation": _validation_brief((e.measurement or {}).get("validation")),
             "checks": {k: ((e.measurement or {}).get("checks") or {}).get(k) for k in ("seconds", "fp32_runs")},
             "measure_capture_s": (e.measurement or {}).get("capture_s"),
             "pass_notes": [n for p in (e.measurement or {}).get("passes") or [] if isinstance(p, dict)
                            for n in (p.get("notes") or [])][-8:]}
            for e in exps]


def _validation_brief(v: dict | None) -> dict | None:
    """How long a validation took and what made it long: redrawn inputs, shapes not judged, the greedy check."""
    if not v:
        return None
    return {"seconds": v.get("seconds"), "mode": v.get("mode"),
            "shape_notes": [s.get("note") for s in v.get("shapes") or [] if s.get("note")],
            "greedy": {k: (v.get("greedy") or {}).get(k) for k in ("ok", "tokens", "judged", "prompts")}
            if v.get("greedy") else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-1b-16l", "olmoe-16l"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[128, 2048, 8192])
    ap.add_argument("--compile-contexts", nargs="*", type=int, default=None,
                    help="contexts for torch.compile, one fresh process each (default: --contexts)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per timed generate")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7,
                    help="alternating rounds of the front door and the loaded artifact at each context")
    ap.add_argument("--budget", default=None, help="tkcc.compile budget (default: its own default)")
    ap.add_argument("--mode", default="tolerance")
    ap.add_argument("--measure-max-context", type=int, default=None,
                    help="clip the trace's requests to this many tokens for the compile's loop (default: the "
                         "cache, as tkcc.compile; the engine prefills long buckets in the chunks the model serves)")
    ap.add_argument("--max-buckets", type=int, default=None, help="buckets per phase in the compile's workload "
                                                                  "(default: compile's)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["hf_eager", "torch_compile", "lab_best", "loaded"])
    ap.add_argument("--smoke", action="store_true", help="CPU: llama-tiny, contexts 8 16, budget 3 s")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "frontdoor.json"))
    ap.add_argument("--keep-artifact", default=None, metavar="DIR",
                    help="also copy each model's saved artifact to DIR/compiled_<model> (to serve it later)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.models, a.contexts, a.tokens, a.reps = ["llama-tiny"], [8, 16], 4, 1
        a.budget = a.budget or "3s"
        a.skip = sorted(set(a.skip) | {"torch_compile", "lab_best"})
    import decode as lab
    import tkcc
    from tkcc.frontend.models import build_model, get_spec

    dtype = torch.bfloat16 if CUDA else torch.float32
    dev = "cuda" if CUDA else "cpu"
    meta = dict(device=torch.cuda.get_device_name() if CUDA else "cpu", torch=torch.__version__,
                commit=lab.commit(), command=" ".join([os.path.basename(sys.executable), *sys.argv]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                dtype=str(dtype).replace("torch.", ""), batch=1, tokens=a.tokens, reps=a.reps, mode=a.mode)
    rows, notes = [], {}
    out_paths = out_paths_for(a.out)

    def save():  # the rows (the format: a list), and beside them what they ran on and the loop's notes
        for p in out_paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps([dict(r, **{k: meta[k] for k in ("device", "commit", "date", "dtype")})
                                     for r in rows], indent=1, default=str))
            p.with_name(p.stem + "_notes.json").write_text(json.dumps({"meta": meta, "notes": notes}, indent=1,
                                                                      default=str))

    for name in a.models:
        cap = max(a.contexts) + a.tokens + 64
        model = build_model(name, dtype=dtype, device=dev, max_position_embeddings=cap)
        vocab = model.config.vocab_size
        if "hf_eager" not in a.skip:
            for r in lab.hf_rows(model, name, a.contexts, 32, a.reps, "hf_eager", model.forward):
                rows.append(dict(model=name, context=r["context"], variant="hf_eager", ms_per_token=r["ms_per_token"]))
            save()
        t0 = time.perf_counter()
        compiled = tkcc.compile(model, "azure-conv", mode=a.mode, budget=a.budget, max_cache_len=cap,
                                measure_max_context=a.measure_max_context, max_buckets=a.max_buckets)
        wall = time.perf_counter() - t0
        rep = compiled.report(print_report=False)
        log(rep.text())
        notes[name] = {"loop": rep.loop, "serves": compiled.serves, "plan": rep.plan, "speed": rep.speed,
                       "passes": rep.to_json().get("passes"), "experiments": experiment_timeline(rep.loop)}
        fd = dict(compile_wall_s=wall, serves=compiled.serves, plan_hash=rep.plan_hash)
        got = []
        if "loaded" not in a.skip:
            with tempfile.TemporaryDirectory() as tmp:
                compiled.save(Path(tmp) / "saved")
                if a.keep_artifact:
                    shutil.copytree(Path(tmp) / "saved", Path(a.keep_artifact) / f"compiled_{name}",
                                    dirs_exist_ok=True)
                for src in sorted((Path(tmp) / "saved").rglob("forward_decode*.py")):  # what shipped, configs and all
                    for p in out_paths:
                        (p.parent / f"{p.stem}_{name}_{src.name}").write_text(src.read_text())
                try:
                    got, info = side_by_side(compiled, name, Path(tmp) / "saved", a.contexts, a.tokens,
                                             max(a.reps, a.rounds), dtype, vocab, dev)
                except Exception as e:  # noqa: BLE001 - the front door is timed alone below; say why
                    info = {"error": f"{type(e).__name__}: {e}"[:2000]}
                    log(f"{name}: the side-by-side with the loaded artifact failed: {info['error']}")
                rows += [dict(r, **fd) if r["variant"] == "frontdoor" else r for r in got]
                notes.setdefault(name, {})["loaded"] = info
        timed = {r["context"] for r in got if r["variant"] == "frontdoor"}
        for c in a.contexts:  # alone: --skip loaded, or what the side-by-side did not reach
            if c in timed:
                continue
            ms = ms_per_token(compiled.stream, prompt(c, vocab, dev), a.tokens, a.reps)
            rows.append(dict(model=name, context=c, variant="frontdoor", ms_per_token=ms, **fd))
            log(f"{name} frontdoor ctx={c}: {ms:.3f} ms/token (compile {wall:.0f} s, serves {compiled.serves})")
        save()
        del compiled
        torch.cuda.empty_cache() if CUDA else None
        if "lab_best" not in a.skip:
            try:
                got, lab_notes = lab.frontdoor_rows(model, name, a.contexts, 32, a.reps, variants=["lowered"],
                                                    family=get_spec(name).family, real_routing=False)
                rows += [dict(model=name, context=r["context"], variant="lab_best", ms_per_token=r["ms_per_token"],
                              lab_variant=r["variant"]) for r in got]
                notes.setdefault(name, {})["lab"] = lab_notes
            except Exception as e:  # noqa: BLE001 - the other rows stand; say why this one is missing
                notes.setdefault(name, {})["lab_error"] = f"{type(e).__name__}: {e}"
            save()
        del model
        torch.cuda.empty_cache() if CUDA else None
        if "torch_compile" not in a.skip:
            class A:  # the arguments decode.py's fresh-process runner reads
                compile_mode, reps, compile_cap_s, compile_budget_s = "max-autotune", a.reps, 400.0, 400.0
            res = {"notes": notes.setdefault(name, {})}
            for r in lab.fresh_compile_rows(A, name, a.compile_contexts or a.contexts, 32, 0, res):
                rows.append(dict(model=name, context=r["context"], variant="torch_compile",
                                 ms_per_token=r["ms_per_token"], warmup_s=r.get("warmup_s")))
            save()
    # the objective: the same trace-weighted P90 from each variant's ms/token curve
    curve = [dict(model=r["model"], context=r["context"], variant=r["variant"], routing="router",
                  ms_per_token=r["ms_per_token"]) for r in rows if r["variant"] in ("frontdoor", "torch_compile",
                                                                                    "hf_eager", "lab_best")]
    for o in lab.objective_rows(curve, a.models):
        if o["trace"] != "azure-conv":
            continue
        rows.append(dict(model=o["model"], variant="objective", trace=o["trace"], of=o["variant"],
                         p90_decode_tokens_per_s=o["p90_decode_tokens_per_s"], contexts=o["contexts_measured"]))
    for m in a.models:
        by = {r["of"]: r["p90_decode_tokens_per_s"] for r in rows if r.get("variant") == "objective"
              and r["model"] == m}
        rows.append(dict(model=m, variant="objective", trace="azure-conv", frontdoor_p90=by.get("frontdoor"),
                         torch_compile_p90=by.get("torch_compile"), hf_eager_p90=by.get("hf_eager"),
                         lab_best_p90=by.get("lab_best"), same_contexts=same_contexts(lab, curve, m)))
    save()
    print("\nmodel          ctx     variant          ms/token")
    for r in rows:
        if r["variant"] != "objective":
            print(f"{r['model']:<14} {r['context']:>6}  {r['variant']:<15} {r['ms_per_token']:9.3f}")
    for r in rows:
        if r["variant"] == "objective" and "frontdoor_p90" in r:
            print(f"{r['model']}: Azure conv P90 decode tok/s: frontdoor {r['frontdoor_p90']}, torch.compile "
                  f"{r['torch_compile_p90']}, HF eager {r['hf_eager_p90']}, lab {r['lab_best_p90']}")
    return rows


if __name__ == "__main__":
    main()
