"""Where a decode step is far from the bf16 captured graph, is it a near-tied top-k choice? (GPU.)

    python benchmarks/judge_probe.py --model olmoe-16l --layers 3 16 --contexts 127 --draws 40

The engine's tolerance-mode judge refused olmoe-16l's (since deleted) fused step at a decode input where it was
0.08 of scale from the bf16 graph and 0.077 from the graph run in fp32, which the bf16 graph was 0.012 from. This
draws fresh decode inputs (random cache up to the context, a random token), builds the step of ``--plan`` (a pass
name, default the graph-lowered ``lowered_decode``) through ``tkcc.compile`` (as the front door does), and per
draw records: the step's and the bf16 graph's distance from the fp32 graph
(max |diff| over the fp32 logits' largest |value|, and the norm ratio), the fp32 router's near ties (top-k
margins within ``TIE_REL`` of each row's scale), and the engine's second opinion on the logits and the cache
(``validation.exact_opinion``), with the choice taken the other way where that is what matched.
Raw rows go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode import _rel  # noqa: E402 - the norm ratio decode.py's first-step judge reports


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def _scaled(ref, got):
    from tkcc.runtime.validation import scaled_error

    return scaled_error(ref.float(), got.float())[2]


def probe(name: str, layers: int, context: int, draws: int, bound: float, plan: str) -> list[dict]:
    import tkcc
    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model
    from tkcc.runtime.exact_reference import upcast
    from tkcc.runtime.validation import StateGuard, exact_opinion, exact_run, tensors_of

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = build_model(name, dtype, dev, num_hidden_layers=layers, max_position_embeddings=context + 64)
    prog = capture(model, phases=["decode"], max_cache_len=context + 16)
    gm = prog.graphs["decode"]
    up = upcast(gm)
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        compiled = tkcc.compile(model, program=prog, plan=[{"name": plan}], mode="tolerance", measure=False,
                                check=False, progress=False, out_dir=Path(tmp) / "c")
    fwd = compiled.forwards["decode"]
    log(f"{name} {layers} layers, context {context}: built {[lg.summary() for lg in compiled.logs or []]}")
    rows = []
    for d in range(draws):
        g = torch.Generator(device=dev).manual_seed(1000 * layers + d)
        prog.state.fill_random(context, g)
        tok = torch.randint(0, vocab, (1, 1), device=dev, generator=g)
        pos = torch.tensor([context], device=dev)
        inputs = (tok, pos)
        guard = StateGuard(prog.state)
        with torch.no_grad():
            ref = [t.clone() for t in tensors_of(gm(*inputs))]
            ref_state = guard.current()
            guard.restore()
            got = [t.clone() for t in tensors_of(fwd(*inputs))]
            got_state = guard.current()
            guard.restore()
        memo: dict = {}
        base = exact_run(up, inputs, guard, memo)
        exact, near = base[0], base[2]
        row = dict(model=name, layers=layers, context=context, draw=d,
                   step_vs_bf16=_scaled(ref[0], got[0]), step_vs_fp32=_scaled(exact[0], got[0]),
                   bf16_vs_fp32=_scaled(exact[0], ref[0]), step_vs_fp32_norm=_rel(got[0], exact[0]),
                   bf16_vs_fp32_norm=_rel(ref[0], exact[0]), near_ties=len(near),
                   min_margin=min((m for m, _, _ in near), default=None),
                   cache_step_vs_bf16=max((_scaled(a, b) for a, b in zip(ref_state, got_state)), default=0.0))
        for what, r, o, st in (("logits", ref, got, False), ("cache", ref_state, got_state, True)):
            past = (max(_scaled(a, b) for a, b in zip(r, o)) > bound)
            if not past:
                row[f"{what}_judge"] = "within the bound of the bf16 graph"
                continue
            said = exact_opinion(up, inputs, guard, r, o, bound, of_state=st, memo=memo)
            row[f"{what}_judge"] = ("no opinion" if said is None else ("PASS: " if said[0] else "FAIL: ") + said[1])
        guard.restore()
        rows.append(row)
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
    del compiled, fwd
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-16l")
    ap.add_argument("--layers", nargs="+", type=int, default=[3, 16])
    ap.add_argument("--contexts", nargs="+", type=int, default=[127])
    ap.add_argument("--draws", type=int, default=40)
    ap.add_argument("--bound", type=float, default=0.05)
    ap.add_argument("--plan", default="lowered_decode", help="the decode pass to build (default params)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "judge_probe.json"))
    a = ap.parse_args(argv)
    rows = []
    for n in a.layers:
        for c in a.contexts:
            rows += probe(a.model, n, c, a.draws, a.bound, a.plan)
    outs = [Path(a.out)] + ([Path(os.environ["OUT"]) / Path(a.out).name] if os.environ.get("OUT") else [])
    for p in outs:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(rows, indent=1))
    for n in a.layers:
        mine = [r for r in rows if r["layers"] == n]
        far = [r for r in mine if r["step_vs_bf16"] > a.bound or r["cache_step_vs_bf16"] > a.bound]
        failed = [r for r in far if "FAIL" in r.get("logits_judge", "") + r.get("cache_judge", "")]
        log(f"{a.model} {n} layers: {len(mine)} draws, {len(far)} past {a.bound} of the bf16 graph, "
            f"{len(failed)} refused by the fp32 opinion; of those past, near ties at "
            f"{sum(1 for r in far if r['near_ties'])}; max step_vs_fp32_norm "
            f"{max(r['step_vs_fp32_norm'] for r in mine):.4f} vs bf16 {max(r['bf16_vs_fp32_norm'] for r in mine):.4f}")


if __name__ == "__main__":
    main()
