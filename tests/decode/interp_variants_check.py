"""Run under TRITON_INTERPRET=1 (by test_lowered_variants.py): the linear-attention, rotary-variant and sink
kernels, OPT's q-scaled attention, BLOOM's ALiBi attention, and the fused attention with its splits sized to the
context, against their references on fresh random inputs and several shapes, fp32 and fp16. One JSON line: {rows,
fallbacks}; then, in the same process (its imports and pattern traces paid once), interp_lowered_greedy.py's line
per model. Arguments: the seed, then the models."""
import json
import sys

import torch

from tkcc.kernels.checks import TOL, rel_err
from tkcc.kernels.common import fallbacks
from tkcc.kernels.lowered import attention_rope_ref
from tkcc.passes.lower.checks_variants import check_causal_conv, check_gated_delta, check_linear_attention, \
    check_alibi_attention, check_q_scaled_attention, check_rotary

SINK_SHAPES = ((4, 2, 16, 40, 16, 0), (4, 4, 32, 64, 64, 0), (2, 1, 16, 300, 16, 0), (4, 2, 16, 64, 16, 12))


def check_sinks(dtype, g, shapes=SINK_SHAPES, device="cpu"):
    """tkcc.attention_rope with per-head sink logits (the kernel: split 0 enters them) against the eager
    gpt-oss arithmetic: one split, several merged in the kernel, more than it merges (the combine launch)."""
    rows = []
    for hq, hkv, D, S, chunk, window in shapes:
        for _ in range(2):
            rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
            qkv, kc, vc = rnd(1, 1, (hq + 2 * hkv) * D), rnd(1, hkv, S, D), rnd(1, hkv, S, D)
            sinks = rnd(hq) * 2
            inv = (1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(device)
            pos = torch.randint(0, S, (1,), generator=g).to(device)
            count = torch.zeros(hkv, dtype=torch.int32, device=device)
            k2, v2 = kc.clone(), vc.clone()
            ref = attention_rope_ref(qkv, kc, vc, pos, inv, 1.0, None, None, 1e-6, D ** -0.5, hq, window, sinks=sinks)
            got = torch.ops.tkcc.attention_rope(qkv, k2, v2, pos, inv, 1.0, None, None, 1e-6, D ** -0.5, hq, window,
                                                chunk, 16, 4, count, False, False, 0, False, sinks)
            err = max(rel_err(got, ref), rel_err(k2, kc), rel_err(v2, vc))
            rows.append({"case": f"sinks[{hq}/{hkv}x{D}, S={S}, chunk={chunk}, window {window}]",
                         "dtype": str(dtype), "rel_err": err, "ok": err <= TOL[dtype] and int(count.sum()) == 0})
    return rows


# (hq, hkv, D, S, splits, window, sinks, qk norm over the projection): GQA and MHA, a window, sinks, OLMoE's norms
DYN_SHAPES = ((4, 2, 16, 300, 4, 0, False, False), (4, 4, 32, 200, 8, 0, False, True),
              (2, 1, 16, 260, 16, 0, False, False), (4, 2, 16, 160, 4, 24, True, False))


def check_dynamic_splits(dtype, g, shapes=DYN_SHAPES, device="cpu"):
    """tkcc.attention_rope with its splits sized to the context on the device (chunk -N) against the eager
    arithmetic, at positions from the first to the cache's last: fewer positions than splits (most splits
    empty), a context that is not a whole number of tiles, and the last position. The same call must also
    agree with the fixed layout of the same tile, and be launched with its splits sized on the device."""
    from tkcc.kernels import attention_rope as ar

    rows, seen, launch = [], [], ar.launch

    def spy(*a, **k):
        seen.append((k.get("dynamic"), k.get("splits")))
        return launch(*a, **k)
    ar.launch = spy
    try:
        _dynamic_rows(dtype, g, shapes, device, rows, seen)
    finally:
        ar.launch = launch
    return rows


def _dynamic_rows(dtype, g, shapes, device, rows, seen):
    for hq, hkv, D, S, splits, window, with_sinks, qk_norm in shapes:
        for p in (0, 5, 37, S // 2 + 3, S - 1):
            rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
            qkv, kc, vc = rnd(1, 1, (hq + 2 * hkv) * D), rnd(1, hkv, S, D), rnd(1, hkv, S, D)
            sinks = rnd(hq) * 2 if with_sinks else None
            qn, kn = (rnd(hq * D) * 0.1 + 1, rnd(hkv * D) * 0.1 + 1) if qk_norm else (None, None)
            inv = (1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(device)
            pos = torch.tensor([p], device=device)
            count = torch.zeros(hkv, dtype=torch.int32, device=device)
            k2, v2 = kc.clone(), vc.clone()
            ref = attention_rope_ref(qkv, kc, vc, pos, inv, 1.0, qn, kn, 1e-6, D ** -0.5, hq, window, sinks=sinks)
            got = torch.ops.tkcc.attention_rope(qkv, k2, v2, pos, inv, 1.0, qn, kn, 1e-6, D ** -0.5, hq, window,
                                                -splits, 16, 4, count, False, False, 0, False, sinks)
            err = max(rel_err(got, ref), rel_err(k2, kc), rel_err(v2, vc))
            fixed = torch.ops.tkcc.attention_rope(qkv, kc.clone(), vc.clone(), pos, inv, 1.0, qn, kn, 1e-6, D ** -0.5,
                                                  hq, window, 64, 16, 4, count, False, False, 0, False, sinks)
            err = max(err, rel_err(got, fixed))
            launched = seen[-2] if len(seen) >= 2 else None
            case = f"dynamic[{hq}/{hkv}x{D}, S={S}, {splits} splits, pos {p}, window {window}, sinks {with_sinks}, " \
                   f"qk norm {qk_norm}]"
            rows.append({"case": case, "dtype": str(dtype), "rel_err": err, "launched": launched,
                         "ok": err <= TOL[dtype] and int(count.sum()) == 0 and launched == (True, splits)})


if __name__ == "__main__":
    from interp_lowered_greedy import run as greedy_run

    g = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    rows = []
    for dt in (torch.float32, torch.float16):
        fp32 = dt == torch.float32
        rows += check_linear_attention("cpu", dt, g, shapes=((3, 16, 16), (4, 32, 16)) if fp32 else ((2, 64, 32),))
        rows += check_gated_delta("cpu", dt, g, shapes=((3, 1, 16, 16, 16, False), (2, 2, 32, 48, 32, True),
                                                       (1, 4, 16, 16, 16, False), (2, 1, 16, 32, 16, True))
                                  if fp32 else ((2, 1, 64, 128, 64, False), (1, 2, 64, 128, 64, True)))
        rows += check_causal_conv("cpu", dt, g, **({} if fp32 else {"shapes": ((300, 4, False, "silu", 128),)}))
        rows += check_rotary("cpu", dt, g, shapes=((4, 2, 32, 300, 16, 8, 0),) if fp32 else ((2, 1, 64, 48, 16, 32, 10),))
        rows += check_sinks(dt, g, SINK_SHAPES if fp32 else SINK_SHAPES[1::2])
        rows += check_dynamic_splits(dt, g, DYN_SHAPES if fp32 else DYN_SHAPES[1::2])
        rows += check_q_scaled_attention("cpu", dt, g, **({} if fp32 else {"shapes": ((4, 32, 64, 64, 12, 1.0),
                                                                                        (2, 64, 300, 16, 0, 1.0))}))
        rows += check_alibi_attention("cpu", dt, g, **({} if fp32 else {"shapes": ((6, 32, 64, 64, 12, 1.0),
                                                                                     (2, 64, 300, 16, 0, 1.0))}))
    print(json.dumps({"rows": rows, "fallbacks": fallbacks()}, default=str), flush=True)
    greedy_run(sys.argv[2:])
