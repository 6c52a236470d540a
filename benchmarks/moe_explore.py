"""Where do the routed-MoE kernels (``tkcc.moe``) lose to the copy bandwidth? Each family's block shape, each config.

Profiled inside whole lowered steps the expert kernels stream at a third of the copy bandwidth (qwen3next-16l,
twenty-seventh session: ``moe_down_routed_kernel`` 27.8 us a launch for 21 MB, ``moe_gate_up_routed_kernel`` 17.8 us
for 42 MB), and every MoE family below 60% of its floor spends most of its step there. Under PDL a kernel's
profiled time includes its wait for the one before, so those numbers do not say which kernel is slow. This
times ``tkcc.moe`` alone at each named family's MoE shape, ``--layers`` blocks with their own weights back to back
(no L2 reuse), replayed from one CUDA graph:

  configs   each gate_up config with the first down config, and each down config with the first gate_up config,
            PDL off and on; per block: us and GB/s (the router and the k experts' gate_up and down bytes)
  kernels   the profiler's device us per kernel and launch for each config (PDL off, so each kernel is timed on
            its own), with each kernel's own GB/s
  stream    torch.sum over the same k experts' gate_up and down slabs: what streaming those bytes costs here

Every config is first checked against ``moe_ref`` on the same forced experts (the bf16 tolerance of
``tkcc.kernels.checks``); a config that fails is reported, not timed. ``--smoke``: the checks alone at a small
shape on CPU under the Triton interpreter (the script's plumbing, not a result). Writes one JSON (``--out``).

  python benchmarks/moe_explore.py --out benchmarks/results/moe_explore.json
  python benchmarks/moe_explore.py --families qwen3next deepseekv3
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

# family -> (E, H, I, top_k, router): the MoE block of each named family's GPU reference model (tkcc/data/models.json)
SHAPES = {
    "olmoe": (64, 2048, 1024, 8, "softmax"),
    "qwen3moe": (64, 2048, 768, 8, "softmax"),
    "qwen3next": (64, 2048, 512, 10, "softmax"),
    "qwen2moe": (30, 2048, 1408, 4, "softmax"),
    "deepseekv3": (32, 2048, 1408, 6, "sigmoid_grouped"),
    "minimax": (16, 2048, 3072, 2, "softmax"),
    "mixtral": (8, 4096, 3584, 2, "softmax_fp32"),
}
GROUPED = dict(n_group=8, topk_group=4, scaling=2.446)  # deepseekv3-16l's router


def _blocks(n, E, H, I, k, router, device, dtype, seed=0):
    """n MoE blocks, each its own weights, input and k forced experts (distinct, drawn at random; the grouped
    router picks its own)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        def r(*shape, s=1.0):
            return (torch.randn(*shape, generator=g) * s).to(device=device, dtype=dtype)

        blk = dict(h=r(1, 1, H, s=0.5), nw=r(H, s=0.1) + 1, router_w=r(E, H, s=H ** -0.5),
                   gate_up=r(E, 2 * I, H, s=H ** -0.5), down=r(E, H, I, s=I ** -0.5),
                   count=torch.zeros(1, device=device, dtype=torch.int32))
        if router == "sigmoid_grouped":
            blk["bias"] = (torch.randn(E, generator=g) * 0.1).to(device=device, dtype=torch.float32)
            blk["ids"] = None
        else:
            blk["bias"] = None
            blk["ids"] = torch.randperm(E, generator=g)[:k].to(device=device, dtype=torch.int32)
        out.append(blk)
    return out


def _bytes(E, H, I, k, itemsize) -> int:
    """What one block reads at least: the router, and the k experts' gate_up and down."""
    return itemsize * (E * H + k * 3 * H * I)


def _kw(router):
    return dict(router=router, **(GROUPED if router == "sigmoid_grouped" else {}))


def _call(b, k, router, configs, pdl):
    import torch

    return torch.ops.tkcc.moe(b["h"], b["nw"], 1e-6, b["router_w"], b["gate_up"], b["down"], k, True, True,
                              b["count"], configs=configs, pdl=pdl, router_bias=b["bias"], forced_ids=b["ids"],
                              **_kw(router))


def _ref(b, k, router):
    from tkcc.kernels.lowered import moe_ref

    kw = _kw(router)
    return moe_ref(b["h"], b["nw"], 1e-6, b["router_w"], b["gate_up"], b["down"], k, True, True, router, b["bias"],
                   kw.get("n_group", 1), kw.get("topk_group", 1), kw.get("scaling", 1.0),
                   None if b["ids"] is None else b["ids"].long())


def _pairs(smoke):
    """(gate_up, down) config pairs: each of one kind beside the other kind's first."""
    from tkcc.kernels.moe_routed import DOWN_CONFIGS, GATE_UP_CONFIGS, INTERP

    if smoke:
        return [(INTERP, INTERP)]
    return list(dict.fromkeys([(gc, DOWN_CONFIGS[0]) for gc in GATE_UP_CONFIGS]
                              + [(GATE_UP_CONFIGS[0], dc) for dc in DOWN_CONFIGS]))


def explore(family, args, res):
    import torch

    from tkcc.kernels.checks import TOL, rel_err
    from tkcc.kernels.moe_routed import ROUTER_CONFIGS

    E, H, I, k, router = SHAPES[family]
    if args.smoke:
        E, H, I, dev, dt = max(8, min(E, 16)), 64, 96, "cpu", torch.float32
        k = min(k, 4)
    else:
        dev, dt = "cuda", torch.bfloat16
    blocks = _blocks(1 if args.smoke else args.layers, E, H, I, k, router, dev, dt)
    nbytes = _bytes(E, H, I, k, torch.empty((), dtype=dt).element_size())
    fam = {"shape": {"E": E, "H": H, "I": I, "top_k": k, "router": router, "dtype": str(dt).replace("torch.", "")},
           "layers": len(blocks), "bytes_per_block": nbytes, "configs": [], "kernels": {}}
    res["families"][family] = fam
    ok = []
    for gc, dc in _pairs(args.smoke):
        flat = [*ROUTER_CONFIGS[0], *gc, *dc]
        err = rel_err(_call(blocks[0], k, router, flat, False), _ref(blocks[0], k, router))
        good = err <= TOL[dt]
        fam["configs"].append({"gate_up": list(gc), "down": list(dc), "rel_err": err, "ok": good})
        if good:
            ok.append((gc, dc, flat))
        print(f"{family}: check gate_up {gc} down {dc}: rel err {err:.2e} {'ok' if good else 'FAILED'}", flush=True)
    if args.smoke:
        return
    from decode import kernel_times  # the decode benchmark's profiler breakdown

    from tkcc.kernels.graph_replay import CapturedCall, replay_us

    dev_ = torch.device("cuda")
    rows = {(tuple(r["gate_up"]), tuple(r["down"])): r for r in fam["configs"]}
    for gc, dc, flat in ok:
        row = rows[(gc, dc)]
        for pdl in (False, True):
            us = replay_us(lambda: [_call(b, k, router, flat, pdl) for b in blocks], args.reps, warm_replays=3,
                           pdl=pdl, device=dev_) / len(blocks)
            row[f"us_pdl_{'on' if pdl else 'off'}"] = round(us, 2)
            row[f"gbps_pdl_{'on' if pdl else 'off'}"] = round(nbytes / us / 1e3, 1)
        g = CapturedCall(lambda: [_call(b, k, router, flat, False) for b in blocks], (), warmup=2, device=dev_)
        kt = kernel_times(lambda n: [g.replay() for _ in range(n)], 10)
        per = {}
        for name, v in kt.get("by_kernel", {}).items():
            per[name] = {"us_per_block": round(v["us_per_token"] / len(blocks), 2),
                         "launches_per_block": round(v["launches_per_token"] / len(blocks), 2)}
            kb = {"gate_up": k * 2 * I * H, "down": k * H * I, "router": E * H}
            for kind, elems in kb.items():
                if kind in name:
                    per[name]["gbps"] = round(elems * 2 / (v["us_per_token"] / len(blocks)) / 1e3, 1)
        fam["kernels"][f"gate_up {list(gc)} / down {list(dc)}"] = per or kt
        print(f"{family}: gate_up {gc} down {dc}: {row['us_pdl_off']} us (PDL off), {row['us_pdl_on']} us (on) a "
              f"block, {row['gbps_pdl_on']} GB/s; kernels {per}", flush=True)
    sinks = torch.empty(len(blocks), 2 * k, device=dev_, dtype=torch.float32)
    chosen = [b["ids"].tolist() if b["ids"] is not None else list(range(k)) for b in blocks]

    def stream():
        for j, b in enumerate(blocks):
            for i, e in enumerate(chosen[j]):
                torch.sum(b["gate_up"][e], dtype=torch.float32, out=sinks[j, 2 * i])
                torch.sum(b["down"][e], dtype=torch.float32, out=sinks[j, 2 * i + 1])
    us = replay_us(stream, args.reps, warm_replays=3, device=dev_) / len(blocks)
    fam["stream"] = {"us": round(us, 2), "gbps": round(k * 3 * H * I * 2 / us / 1e3, 1),
                     "what": "torch.sum over each of the k experts' gate_up and down slabs"}
    best = min((r for r in fam["configs"] if "us_pdl_on" in r), key=lambda r: r["us_pdl_on"], default=None)
    print(f"{family}: stream {fam['stream']}; best {best}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_explore.json"))
    ap.add_argument("--families", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=8, help="blocks with their own weights, back to back")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter: the checks at a small shape only")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import tkcc.kernels.lowered  # noqa: F401 - registers torch.ops.tkcc

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("moe_explore: needs a CUDA device (or --smoke on CPU)")
    t0 = time.time()
    res = {"families": {}}
    failed = []
    for fam in args.families:
        try:
            explore(fam, args, res)
        except Exception as e:  # noqa: BLE001 - one family's failure is its row; the others still run
            res["families"].setdefault(fam, {})["error"] = f"{type(e).__name__}: {e}"[:400]
            failed.append(fam)
            print(f"{fam}: {type(e).__name__}: {e}", flush=True)
    if torch.cuda.is_available() and not args.smoke:
        res["device"] = torch.cuda.get_device_name()
    from provenance import write_result

    write_result(res, args.out, t0)
    bad = failed + [f for f, v in res["families"].items() for r in v.get("configs", []) if not r["ok"]]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
