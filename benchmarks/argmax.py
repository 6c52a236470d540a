"""The greedy choice's argmax: torch.argmax against tkcc.kernels.argmax, on one GPU, in bf16.

    PYTHONPATH=. python benchmarks/argmax.py [--out benchmarks/results/argmax.json]

Each is timed replayed from a CUDA graph (``replay_us``: device microseconds, launch gaps as in a captured
step, no host overhead) on [B, V] rows at the vocabularies of the reference models, and checked equal to
torch.argmax on the same rows first. Why: the graph-lowered decode step's greedy loop spent 37 us a token in
torch.argmax's one reduction kernel on llama-1b-16l (128256 values), 4% of its step.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tkcc.kernels.argmax import argmax  # noqa: E402
from tkcc.kernels.graph_replay import replay_us  # noqa: E402

VOCABS = (32000, 50304, 128256, 151936, 201088)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "argmax.json"))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/argmax.py needs a GPU")
    rows = []
    for B in a.batches:
        for V in VOCABS:
            x = torch.randn(B, 2, V, device="cuda", dtype=torch.bfloat16)[:, -1]  # the last position's logits
            same = torch.equal(argmax(x), x.argmax(-1))
            t_torch = replay_us(lambda: x.argmax(-1), reps=50)
            t_tkcc = replay_us(lambda: argmax(x), reps=50)
            rows.append(dict(batch=B, vocab=V, same=same, torch_us=round(t_torch, 2), tkcc_us=round(t_tkcc, 2),
                             speedup=round(t_torch / t_tkcc, 2)))
            print(rows[-1], flush=True)
    from provenance import commit

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=rows)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
