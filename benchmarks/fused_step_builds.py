"""The fused decode step as each build path tunes it, replayed side by side in one process.

    python benchmarks/fused_step_builds.py --model olmoe-16l --out benchmarks/results/fused_step_builds.json

On the H200 the front door's olmoe-16l step ran 1.39 ms/token where the lab's (``decode.py``'s ``tkcc_v4``)
ran 1.02, and where the same front door had run 0.99 a few commits earlier. This separates the build from
the engine around it. Rows, each the decoder's CUDA graph replayed back to back at each context:
- ``pass_whole``: the ``decode_fused_step`` pass applied to the whole model's captured Program (no engine,
  no tiers), tuned as the pass tunes;
- ``pass_fast_tier``: the pass applied to a 2-block tier (tuned there, not on the whole model), its configs
  then served by a decoder of the whole model (what the engine's slow tier took from the fast one);
- ``direct``: a ``FusedDecoder`` with the pass's options built and tuned by hand (``tune``, ``tune_step`` at
  128, each span's attention), the lab's way, on the same cache length.
The configs each row picked are in the notes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode as lab  # noqa: E402
from frontdoor_gap import replay_ms  # noqa: E402 (the decoder's graph replayed at a context)

from tkcc.frontend.capture import capture  # noqa: E402
from tkcc.frontend.models import build_model  # noqa: E402
from tkcc.kernels.fused_step import decoder_for  # noqa: E402
from tkcc.passes import decode_graph  # noqa: E402


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-16l")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--max-cache-len", type=int, default=8320)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", nargs="+", default=["pass_whole", "pass_fast_tier", "direct"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fused_step_builds.json"))
    a = ap.parse_args(argv)
    cap = a.max_cache_len
    model = build_model(a.model, dtype=torch.bfloat16, device="cuda", max_position_embeddings=cap + 64)
    prog = capture(model, phases=["decode"], max_cache_len=cap)
    kv = prog.state
    keys, vals = decode_graph.cache_tensors(kv)
    opts = dict(attn_chunk=0, pdl=True, fused_attention=True, routed_moe=True, fused_ends=True, attn_tile="64x4",
                attn_spans="1024,4096")
    rows, notes = [], {"model": a.model, "max_cache_len": cap, "device": torch.cuda.get_device_name(),
                       "commit": lab.commit(), "opts": opts}

    def add(variant, dec, build_s):
        notes[variant] = {"configs": {k: list(v) for k, v in dec.configs.items()}, "build_s": round(build_s, 1)}
        log(f"{variant}: built in {build_s:.0f} s; configs {notes[variant]['configs']}")
        for c in a.contexts:
            ms = replay_ms(dec, c, a.tokens, a.reps)
            rows.append(dict(model=a.model, context=c, variant=variant, ms_per_token=round(ms, 4)))
            log(f"{variant} ctx={c}: {ms:.3f} ms/step")
        Path(a.out).write_text(json.dumps({"rows": rows, "notes": notes}, indent=1, default=str))

    if "pass_whole" in a.rows:
        t0 = time.perf_counter()
        new, info = decode_graph.DecodeFusedStep().apply(prog, **{k: v for k, v in opts.items()})
        dec = new.graphs["decode"].fused_decode.decoder
        notes["pass_whole_log"] = info.notes
        add("pass_whole", dec, time.perf_counter() - t0)
        del new, dec
        torch.cuda.empty_cache()
    if "pass_fast_tier" in a.rows:
        t0 = time.perf_counter()
        fast = prog.truncate(2)
        fast.tuned, fast.whole = {}, None  # the tier times its own configs
        new, info = decode_graph.DecodeFusedStep().apply(fast, **opts)
        cfgs = dict(new.graphs["decode"].fused_decode.decoder.configs)
        notes["pass_fast_tier_log"] = info.notes
        del new, fast
        dec = decoder_for(model, cap, (keys, vals), opts, cfgs)
        add("pass_fast_tier", dec, time.perf_counter() - t0)
        del dec
        torch.cuda.empty_cache()
    if "direct" in a.rows:
        t0 = time.perf_counter()
        dec = decoder_for(model, cap, (keys, vals), opts)
        dec.tune()
        dec.reset(0, 128)
        dec.tune_step()
        decode_graph._tune_spans(dec)
        add("direct", dec, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
