"""Why do gpt-oss's expert kernels stream at a fraction of the copy bandwidth? Every config, side by side.

On an H200 (twenty-seventh session) gptoss-8l's lowered step profiled ``oss_down_kernel`` at 249 us a launch
(about 266 GB/s for 4 experts of 2880 x 2880 bf16) and ``oss_gate_up_kernel`` at 151 us (about 880 GB/s): 3.2 of
its 3.81 ms a token, where the GEMVs of the same step stream at over 3 TB/s. The op ran its first configs only.
This times ``tkcc.moe_gptoss`` alone at gpt-oss-20b's block shape (E 32, H = I = 2880, top-4), ``--layers``
blocks with their own weights back to back (no L2 reuse), replayed from one CUDA graph:

  configs   every (gate_up, down) pair of ``GATE_UP_CONFIGS`` x ``DOWN_CONFIGS``, PDL off and on; per block:
            us and GB/s (router + the k experts' gate_up and down bytes)
  kernels   the profiler's device us per kernel for each config (PDL off: with PDL a kernel's time includes its
            wait for the one before), so each config's gate_up and down are timed on their own; the profiler's
            "per token" there is per replay, i.e. per ``--layers`` blocks
  stream    torch.sum over the same k experts' slabs: what streaming those bytes costs here
  ref       ``moe_gptoss_ref`` (aten) on the same forced experts

Every config is first checked against ``moe_gptoss_ref`` on the same forced experts (bf16 tolerance of
``tkcc.kernels.checks``); a config that fails is reported, not timed. ``--smoke``: the check alone at a small shape
on CPU under the Triton interpreter (the script's plumbing, not a result). Writes one JSON (``--out``).

  python benchmarks/moe_gptoss_explore.py --out benchmarks/results/moe_gptoss_explore.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's SwiGLU


def _blocks(n, E, H, I, k, device, dtype, seed=0):
    """n gpt-oss MoE blocks, each its own weights, input and k forced experts (distinct, drawn at random)."""
    import torch

    from tkcc.kernels.moe_gptoss import counters_any
    from tkcc.passes.lower.checks import gptoss_weights

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w = gptoss_weights(E, H, I, g, device, dtype)
        xs = (torch.randn(1, H, generator=g) * 0.5).to(device=device, dtype=dtype)
        ids = torch.randperm(E, generator=g)[:k].to(device=device, dtype=torch.int32)
        count = torch.zeros(counters_any(H, I, k), device=device, dtype=torch.int32)
        out.append((xs, w, ids, count))
    return out


def _bytes(E, H, I, k, itemsize) -> int:
    """What one block reads at least: the router, and the k experts' gate_up and down with their biases."""
    return itemsize * (E * H + E + k * (H * 2 * I + 2 * I + I * H + H))


def _call(block, k, configs, pdl):
    import torch

    xs, w, ids, count = block
    return torch.ops.tkcc.moe_gptoss(xs, *w, k, ALPHA, LIMIT, count, configs=configs, pdl=pdl, forced_ids=ids)


def _flat(gc, dc) -> list[int]:
    from tkcc.kernels.moe_gptoss import ROUTER_CONFIGS

    return [*ROUTER_CONFIGS[0], *gc, *dc]


def check(blocks, k, gc, dc) -> float:
    """The config's relative error against the reference on the first block's forced experts."""
    from tkcc.kernels.checks import rel_err
    from tkcc.kernels.lowered import moe_gptoss_ref

    xs, w, ids, _ = blocks[0]
    return rel_err(_call(blocks[0], k, _flat(gc, dc), False), moe_gptoss_ref(xs, *w, k, ALPHA, LIMIT, ids.long()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_gptoss_explore.json"))
    ap.add_argument("--layers", type=int, default=4, help="blocks with their own weights, back to back")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter: the checks at a small shape only")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from tkcc.kernels.checks import TOL
    from tkcc.kernels.moe_gptoss import DOWN_CONFIGS, GATE_UP_CONFIGS

    if args.smoke:
        E, H, I, k, dev, dt = 8, 64, 96, 2, "cpu", torch.float32
        pairs = [((16, 16, 2, 4), (16, 16, 2, 4)), ((8, 32, 1, 4), (32, 16, 3, 4))]
    else:
        if not torch.cuda.is_available():
            sys.exit("moe_gptoss_explore: needs a CUDA device (or --smoke on CPU)")
        E, H, I, k, dev, dt = 32, 2880, 2880, 4, "cuda", torch.bfloat16
        pairs = [(gc, dc) for gc in GATE_UP_CONFIGS for dc in DOWN_CONFIGS]
    t0 = time.time()
    blocks = _blocks(1 if args.smoke else args.layers, E, H, I, k, dev, dt)
    nbytes = _bytes(E, H, I, k, torch.empty((), dtype=dt).element_size())
    res = {"shape": {"E": E, "H": H, "I": I, "top_k": k, "dtype": str(dt).replace("torch.", "")},
           "layers": len(blocks), "bytes_per_block": nbytes, "configs": [], "kernels": {}}
    ok = []
    for gc, dc in pairs:
        err = check(blocks, k, gc, dc)
        good = err <= TOL[dt]
        res["configs"].append({"gate_up": list(gc), "down": list(dc), "rel_err": err, "ok": good})
        if good:
            ok.append((gc, dc))
        print(f"check gate_up {gc} down {dc}: rel err {err:.2e} {'ok' if good else 'FAILED'}", flush=True)
    if not args.smoke:
        from decode import kernel_times  # the decode benchmark's profiler breakdown

        from tkcc.kernels.graph_replay import CapturedCall, replay_us
        from tkcc.kernels.lowered import moe_gptoss_ref

        dev_ = torch.device("cuda")
        rows = {(tuple(r["gate_up"]), tuple(r["down"])): r for r in res["configs"]}
        for gc, dc in ok:
            flat = _flat(gc, dc)
            for pdl in (False, True):
                us = replay_us(lambda: [_call(b, k, flat, pdl) for b in blocks], args.reps, warm_replays=3,
                               pdl=pdl, device=dev_) / len(blocks)
                rows[(gc, dc)][f"us_pdl_{'on' if pdl else 'off'}"] = round(us, 2)
                rows[(gc, dc)][f"gbps_pdl_{'on' if pdl else 'off'}"] = round(nbytes / us / 1e3, 1)
            print(f"gate_up {gc} down {dc}: {rows[(gc, dc)]['us_pdl_off']} us (PDL off), "
                  f"{rows[(gc, dc)]['us_pdl_on']} us (on) a block", flush=True)
        # each gate_up config, and each down config, once in the profiler (PDL off), paired by index
        for i in range(max(len(GATE_UP_CONFIGS), len(DOWN_CONFIGS))):
            gc, dc = GATE_UP_CONFIGS[i % len(GATE_UP_CONFIGS)], DOWN_CONFIGS[i % len(DOWN_CONFIGS)]
            if (gc, dc) not in ok:
                continue
            flat = _flat(gc, dc)
            g = CapturedCall(lambda flat=flat: [_call(b, k, flat, False) for b in blocks], (), warmup=2,
                             device=dev_)
            res["kernels"][f"gate_up {list(gc)} / down {list(dc)}"] = kernel_times(
                lambda n, g=g: [g.replay() for _ in range(n)], 10)
        # the k experts' slabs read by torch.sum: the streaming reference for the same bytes
        sinks = torch.empty(len(blocks), 2 * k, device=dev_, dtype=torch.float32)
        chosen = [b[2].tolist() for b in blocks]  # read before the capture (a host read inside one fails it)

        def stream():
            for j, (_, w, _, _) in enumerate(blocks):
                for i, e in enumerate(chosen[j]):
                    torch.sum(w[2][e], dtype=torch.float32, out=sinks[j, 2 * i])
                    torch.sum(w[4][e], dtype=torch.float32, out=sinks[j, 2 * i + 1])
        us = replay_us(stream, args.reps, warm_replays=3, device=dev_) / len(blocks)
        res["stream"] = {"us": round(us, 2), "gbps": round(k * 3 * H * I * 2 / us / 1e3, 1),
                         "what": "torch.sum over each of the k experts' gate_up and down slabs"}
        try:
            us = replay_us(lambda: [moe_gptoss_ref(xs, *w, k, ALPHA, LIMIT, ids.long()) for xs, w, ids, _ in blocks],
                           args.reps, warm_replays=3, device=dev_) / len(blocks)
            res["ref"] = {"us": round(us, 2), "gbps": round(nbytes / us / 1e3, 1)}
        except Exception as e:  # noqa: BLE001 - the reference may not capture; the kernels' rows stand
            res["ref"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        res["device"] = torch.cuda.get_device_name()
    from provenance import write_result

    write_result(res, args.out, t0)
    bad = [r for r in res["configs"] if not r["ok"]]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
