"""Where the front door's decode step loses to the lab's, measured on one decoder in one process.

    python benchmarks/frontdoor_gap.py --model llama-1b-16l --out benchmarks/results/frontdoor_gap.json

The front door (``tkcc.compile`` with the fused decode step, then ``compiled.generate``) ran 10-13% behind
``decode.py``'s best variant (``tkcc_v4``). The two differ in three ways, and each row here removes one:
- ``frontdoor``: ``compiled.generate`` (the greedy loop, input copies, the loop's argmax) at each context;
- ``step_replay``: the same decoder's CUDA graph replayed back to back at that context (no loop);
- ``step_attn_at_ctx``: that decoder with its attention layout (``attn_chunk``, ``attn_tile``) re-tuned at
  the context, as ``tkcc_v4`` does, then replayed;
- ``lab_cache_sized``: a decoder with the front door's kernel configs on a cache sized to the context
  (``context + tokens + 8`` positions, as ``decode.py`` builds it) instead of the whole ``max_cache_len``;
- ``lab_v4``: ``decode.py``'s ``tkcc_v4`` rows (own tuning, cache sized to the context, attention tuned).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode as lab  # noqa: E402
from frontdoor import ms_per_token, prompt  # noqa: E402

import tkcc  # noqa: E402
from tkcc.frontend.models import build_model  # noqa: E402
from tkcc.kernels.decoder import ATTENTION_KINDS, FusedDecoder  # noqa: E402


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def replay_ms(dec, context: int, tokens: int, reps: int) -> float:
    """ms per step of ``dec``'s graph replayed from the state at ``context`` (as decode.py times it)."""
    if hasattr(dec, "use_span"):
        dec.use_span(context)  # the span's layout, as the greedy loop picks it
    dec.reset(11, context)
    dec.capture()
    start = (dec.token.clone(), dec.pos.clone(), dec.seqlen.clone())

    def run(n):
        dec.token.copy_(start[0]), dec.pos.copy_(start[1]), dec.seqlen.copy_(start[2])
        dec.run(n)
    run(2)
    return lab.time_steps(run, tokens, reps)


def loop_times(fwd, model, context: int, n: int, dev) -> tuple[float, float]:
    """(host ms, device ms) per step of the greedy loop's body on the shipped decode forward."""
    tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
    pos = torch.full((1,), context, dtype=torch.long, device=dev)
    for _ in range(3):
        fwd(tok, pos)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()
    for _ in range(n):
        tok = fwd(tok, pos)[:, -1].argmax(-1)[:, None]
        pos = pos + 1
    host = (time.perf_counter() - t0) * 1e3 / n
    e1.record()
    torch.cuda.synchronize()
    return host, e0.elapsed_time(e1) / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b-16l")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2048, 8192])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--skip-lab", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/frontdoor_gap.json"))
    a = ap.parse_args(argv)
    dev = "cuda"
    cap = max(a.contexts) + a.tokens + 64
    model = build_model(a.model, dtype=torch.bfloat16, device=dev, max_position_embeddings=cap)
    rows, notes = [], {"model": a.model, "max_cache_len": cap, "device": torch.cuda.get_device_name()}

    def add(variant, c, ms, **kw):
        rows.append(dict(model=a.model, context=c, variant=variant, ms_per_token=round(ms, 4), **kw))
        log(f"{variant} ctx={c}: {ms:.3f} ms/token")
        Path(a.out).write_text(json.dumps({"rows": rows, "notes": notes}, indent=1, default=str))

    t0 = time.perf_counter()
    moe = "moe" in a.model  # olmoe's batched_mm prefill graphs past 128 tokens do not fit (see frontdoor.py)
    compiled = tkcc.compile(model, "azure-conv", plan=[{"name": "decode_fused_step"}], mode="tolerance",
                            max_cache_len=cap, progress=False, measure_max_context=128 if moe else None,
                            max_buckets=3 if moe else None)
    notes["compile_s"] = round(time.perf_counter() - t0, 1)
    notes["serves"] = compiled.serves
    vocab = model.config.vocab_size
    for c in a.contexts:
        add("frontdoor", c, ms_per_token(compiled.generate, prompt(c, vocab, dev), a.tokens, a.reps))
    fwd = compiled.forwards["decode"]
    for c in a.contexts:
        host, gpu = loop_times(fwd, model, c, a.tokens, dev)
        add("host_loop", c, host, note="host wall per decode call of the shipped forward + argmax, no sync")
        add("gpu_loop", c, gpu, note="CUDA-event time per decode call of the same loop")
    gc.unfreeze()  # CompiledModel froze what it built; get_objects does not list frozen objects
    decs = [o for o in gc.get_objects() if type(o).__name__ == "FusedDecoder" and o.max_cache_len == cap]
    if not decs:
        raise SystemExit("the compiled model does not serve a fused decode step")
    dec = decs[-1]
    notes["decoders_found"] = len(decs)
    shipped = dict(dec.configs)
    notes["shipped_configs"] = {k: list(v) for k, v in shipped.items()}
    notes["shipped_layout"] = {"chunk": dec.chunk, "splits": dec.splits}
    log(f"shipped configs: {notes['shipped_configs']}")
    for c in a.contexts:
        add("step_replay", c, replay_ms(dec, c, a.tokens, a.reps), splits=dec.splits, chunk=dec.chunk)
    for c in a.contexts:
        dec.configs = dict(shipped)
        dec.reset(11, c)
        got = dec.tune_step(kinds=ATTENTION_KINDS)
        add("step_attn_at_ctx", c, replay_ms(dec, c, a.tokens, a.reps), splits=dec.splits, chunk=dec.chunk,
            configs={k: list(v) for k, v in got.items()})
    dec.configs = dict(shipped)
    dec.graph = None
    opts = dict(fused_attention=True, routed_moe=True, fused_ends=True)
    if a.skip_lab:
        return
    for c in a.contexts:
        d2 = FusedDecoder(model, max_cache_len=c + a.tokens + 8, configs=dict(shipped), **opts)
        lab.random_cache(d2, c)
        add("lab_cache_sized", c, replay_ms(d2, c, a.tokens, a.reps), splits=d2.splits, chunk=d2.chunk)
        d2.configs = dict(shipped)
        d2.reset(11, c)
        got = d2.tune_step(kinds=ATTENTION_KINDS)
        add("lab_cache_sized_attn_at_ctx", c, replay_ms(d2, c, a.tokens, a.reps), splits=d2.splits,
            chunk=d2.chunk, configs={k: list(v) for k, v in got.items()})
        del d2
        torch.cuda.empty_cache()
    lab_rows, lab_notes = lab.tkcc_rows(model, a.model, a.contexts, a.tokens, a.reps, False,
                                        variants=["tkcc", "tkcc_v4"], profile=False)
    for r in lab_rows:
        if r["variant"] == "tkcc_v4":
            add("lab_v4", r["context"], r["ms_per_token"], splits=r["attn_splits"], chunk=r["attn_chunk"],
                configs=r["configs"])
    notes["lab_notes"] = lab_notes


if __name__ == "__main__":
    main()
