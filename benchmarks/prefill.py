"""A prefill chunk of a built-in MoE model: the model's eager step (its ``batched_mm`` experts) against the
captured prefill graph (``grouped_mm`` experts on CUDA in bf16, ``tkcc.frontend.hf.experts_for_phase``), in one run.

    python benchmarks/prefill.py --model olmoe-16l --tokens 256 2048 --out benchmarks/results/prefill.json

For each prompt length (one chunk, from position 0): both forwards are timed as CUDA-graph replays (median of
``--reps``, after warm-up), with the peak device memory of one call above what was allocated before it, and
the captured graph's logits are compared with the eager step's (max abs error over the logits' scale, and
greedy-token agreement at every position). Raw rows go to ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-16l")
    ap.add_argument("--tokens", nargs="+", type=int, default=[256, 2048])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefill.json"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill.py times CUDA graphs: it needs a GPU", file=sys.stderr)
        return 2
    import decode as lab
    from tkcc.frontend import capture
    from tkcc.frontend.models import build_model
    from tkcc.kernels.graph_replay import replay_us

    model = build_model(a.model, torch.bfloat16, "cuda")
    prog = capture(model, max_cache_len=max(a.tokens) + 8)
    kinds = {p: sorted({str(n.target) for n in g.graph.nodes if "grouped_mm" in str(n.target)
                        or "bmm" in str(n.target)}) for p, g in prog.graphs.items()}
    rows = []
    for t in a.tokens:
        ids = torch.randint(0, prog.meta["vocab_size"], (1, t), device="cuda")
        pos = torch.arange(t, device="cuda")
        row = {"model": a.model, "tokens": t}
        outs = {}
        for name, fn in (("eager", prog.eager), ("captured", prog.graphs["prefill"])):
            prog.reset_state()
            with torch.no_grad():
                before = lab.peak_reset()
                fn(ids, pos)
                torch.cuda.synchronize()
                row[f"{name}_peak_gib"] = round((lab.peak() - before) / 2**30, 3)
                prog.reset_state()
                out = fn(ids, pos)
                outs[name] = (out if isinstance(out, torch.Tensor) else out[0]).float().clone()
            prog.reset_state()
            row[f"{name}_ms"] = round(replay_us(lambda: fn(ids, pos), reps=a.reps, warmup=2, warm_replays=2) / 1e3, 3)
            torch.cuda.empty_cache()
        ref, got = outs["eager"], outs["captured"]
        scale = float(ref.abs().max())
        row["max_abs_err"] = round(float((ref - got).abs().max()), 4)
        row["err_of_scale"] = round(row["max_abs_err"] / scale, 4)
        row["greedy_agree"] = round(float((ref.argmax(-1) == got.argmax(-1)).float().mean()), 4)
        row["speedup"] = round(row["eager_ms"] / row["captured_ms"], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=lab.commit(),
                command=" ".join([os.path.basename(sys.executable), *sys.argv]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                dtype="bfloat16", experts_ops=kinds)
    out = {"meta": meta, "rows": rows}
    paths = [Path(a.out)] + ([Path(os.environ["OUT"]) / Path(a.out).name] if os.environ.get("OUT") else [])
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(meta["experts_ops"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
