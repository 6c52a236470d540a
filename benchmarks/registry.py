"""Never below eager, across the registry: ``tkcc.compile`` on every registered model, against the model's own
eager forward in the same run (issue 17: "never below 1.0x the model's own eager forward, on any model in the
registry").

    python benchmarks/registry.py --budget 60s                       # on a GPU: the registry's GPU models
    python benchmarks/registry.py --models llama-tiny --budget 5s    # any of them, on whatever device there is
    python benchmarks/registry.py --smoke                            # CPU: one tiny model, a few seconds

Each model runs in a fresh process (one model's failure or memory cannot reach the next). Per model, one row:
- the compile's own side by side (the engine measured them in the same run, on the trace's shapes): the model's
  eager forward, the captured graphs and the winner, their objective (P90 per-user decode tokens/s), what
  serves, and the report's weighted geomean speedup over eager with its 95% interval;
- ``frontdoor_ms`` (``compiled.stream``, first new token to last, as ``frontdoor.py``) against ``hf_eager_ms``
  (HF's own decode step on its StaticCache, ``decode.py``'s timer) at ``--context``;
- ``ok``: the winner is not below eager (its objective at least eager's, or the interval says within noise).
Raw rows go to ``--out``; a model that fails says why in its row.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from frontdoor import CUDA, log, ms_per_token, out_paths_for, prompt  # noqa: E402 - after the path to it


def default_models() -> list[str]:
    """The registry's models for this device: the GPU reference models on a GPU, the tiny ones on a CPU."""
    from tkcc.frontend.models import REGISTRY

    return [n for n in REGISTRY if n.endswith("-tiny") != CUDA]


def num(x, digits: int = 1) -> str:
    """A number for the log; a measurement a row lacks (None) prints as n/a."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def not_below(winner: float | None, eager: float | None, interval: dict | None) -> bool | None:
    """Whether what ``tkcc.compile`` returned is not below the model's eager forward: its objective at least
    eager's, or the speedup's interval spanning 1 (within the measured noise). None where nothing was measured."""
    if winner is None or eager is None:
        return None
    if winner >= eager:
        return True
    return bool(interval) and (interval.get("within_noise") or interval.get("high", 0.0) >= 1.0)


def one(name: str, budget: str | None, context: int, tokens: int, reps: int) -> dict:
    """One model's row (runs in its own process)."""
    import decode as lab
    import tkcc
    from tkcc.frontend.models import build_model, get_spec

    dtype = torch.bfloat16 if CUDA else torch.float32
    dev = "cuda" if CUDA else "cpu"
    cap = context + tokens + 64
    model = build_model(name, dtype=dtype, device=dev, max_position_embeddings=cap)
    row = dict(model=name, family=get_spec(name).family, context=context, budget=budget)
    try:
        hf = lab.hf_rows(model, name, [context], tokens, reps, "hf_eager", model.forward)
        row["hf_eager_ms"] = hf[0]["ms_per_token"] if hf else None
    except Exception as e:  # noqa: BLE001 - e.g. MiniMax refuses HF's StaticCache; the compile's own eager stands
        row["hf_eager_ms"], row["hf_eager_error"] = None, f"{type(e).__name__}: {e}"[:300]
    t0 = time.perf_counter()
    compiled = tkcc.compile(model, "azure-conv", mode="tolerance", budget=budget, max_cache_len=cap,
                            progress=False)
    row["compile_wall_s"] = round(time.perf_counter() - t0, 1)
    rep = compiled.report(print_report=False)
    side = (rep.loop or {}).get("side_by_side") or {}
    speed = rep.speed or {}
    row.update(serves=compiled.serves, plan=[s.get("name") for s in rep.plan or []],
               eager_objective=side.get("eager"), captured_objective=side.get("captured graphs"),
               winner_objective=side.get("winner"), why=(rep.loop or {}).get("why"),
               speedup_vs_eager=speed.get("weighted_geomean_speedup"), interval=speed.get("interval"))
    row["frontdoor_ms"] = ms_per_token(compiled.stream, prompt(context, model.config.vocab_size, dev), tokens, reps)
    row["ok"] = not_below(row["winner_objective"], row["eager_objective"], row["interval"])
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=None, help="default: the registry's models for this device")
    ap.add_argument("--budget", default=None, help="tkcc.compile budget per model (default: its own default)")
    ap.add_argument("--context", type=int, default=128, help="context of the ms/token rows")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per timed call")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per model, its process killed past it")
    ap.add_argument("--smoke", action="store_true", help="CPU: llama-tiny, a 3 s budget, context 8")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: one model, its row on stdout
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "registry.json"))
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one(a.one, a.budget, a.context, a.tokens, a.reps), default=str), flush=True)
        return None
    if a.smoke:
        a.models, a.budget, a.context, a.tokens, a.reps = a.models or ["llama-tiny"], a.budget or "3s", 8, 4, 1
    import decode as lab

    models = a.models or default_models()
    meta = dict(device=torch.cuda.get_device_name() if CUDA else "cpu", torch=torch.__version__,
                commit=lab.commit(), command=" ".join([os.path.basename(sys.executable), *sys.argv]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    rows = []
    out_paths = out_paths_for(a.out)
    for name in models:
        cmd = [sys.executable, __file__, "--one", name, "--context", str(a.context), "--tokens", str(a.tokens),
               "--reps", str(a.reps)] + (["--budget", a.budget] if a.budget else [])
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if p.returncode == 0 and lines else \
                dict(model=name, error=f"exit {p.returncode}: {p.stderr[-1500:]}")
        except subprocess.TimeoutExpired:
            row = dict(model=name, error=f"killed after {a.timeout_s:.0f} s")
        row.update(process_s=round(time.perf_counter() - t0, 1), **meta)
        rows.append(row)
        for p_ in out_paths:  # written before the line below, which must not lose a row it cannot print
            p_.parent.mkdir(parents=True, exist_ok=True)
            p_.write_text(json.dumps(rows, indent=1, default=str))
        log(f"{name}: " + (row["error"][-300:] if "error" in row else
                           f"serves {row['serves']} {row['plan']}; objective winner {num(row.get('winner_objective'))} "
                           f"vs eager {num(row.get('eager_objective'))}; {num(row.get('frontdoor_ms'), 3)} vs HF eager "
                           f"{num(row.get('hf_eager_ms'), 3)} ms/token at {row['context']}; "
                           f"not below eager: {row['ok']}"))
    bad = [r["model"] for r in rows if r.get("ok") is False]
    log(f"{len(rows)} models; below eager: {bad or 'none'}; failed: {[r['model'] for r in rows if 'error' in r]}")
    return rows


if __name__ == "__main__":
    main()
