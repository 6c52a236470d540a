"""gpt-oss's MoE block for one decode token in three launches: the routed router (its bias in the GEMV's epilogue,
the top-k and the softmax over the k once, by the last program), then the k chosen experts' gate_up and down with
their biases and the clamped SwiGLU (``moe_gptoss.py.jinja``). The reference is ``tkcc.kernels.lowered.moe_gptoss_ref``.

Why not ``tkcc.moe``: its experts are [E, 2I, H] rows with gate and up halves and ``silu(g) * u``; gpt-oss's are
[E, H, 2I] columns (``x @ W``) with biases, gate and up interleaved, and a clamped, shifted SwiGLU.
"""
from __future__ import annotations

import triton

from tkcc.kernels.common import interpreting, next_pow2
from tkcc.kernels.graph_replay import launch_pdl
from tkcc.kernels.moe_routed import ROUTER_CONFIGS, launch_router
from tkcc.kernels.render import load

# gate_up: (BLOCK_N gate / up pairs, so 2 BLOCK_N contiguous columns; BLOCK_K rows of H a tile; SPLIT ways the rows
# of H are split; num_warps). down: (BLOCK_N columns of H, BLOCK_K rows of I, SPLIT, num_warps). Untimed yet (the
# tuner picks on the device). At gpt-oss-20b's shapes (H = I = 2880, k = 4) the first of each runs 45 x 4 x 4 = 720
# and 23 x 4 x 8 = 736 programs on an H200's 132 SMs, each streaming 256-byte rows. The configs without a split
# (one program per column block, as first written) ran at 111-345 GB/s there.
GATE_UP_CONFIGS = [(64, 32, 4, 4), (64, 64, 2, 4), (128, 16, 4, 4), (32, 64, 8, 4), (64, 32, 1, 4)]
DOWN_CONFIGS = [(128, 32, 8, 4), (128, 64, 4, 4), (256, 16, 8, 4), (64, 64, 8, 4), (128, 32, 2, 4)]
INTERP = ((16, 4), (8, 16, 2, 4), (16, 16, 2, 4))


def default_configs():
    """(router, gate_up, down) configs where the caller gives none."""
    if interpreting():
        return INTERP
    return ROUTER_CONFIGS[0], GATE_UP_CONFIGS[0], DOWN_CONFIGS[0]


def counters(H: int, I: int, k: int, gc, dc) -> int:
    """Arrival counters the three launches use at these configs: the router's one, one per (expert slot, gate_up
    column block), one per down column block."""
    return 1 + k * triton.cdiv(I, gc[0]) + triton.cdiv(H, dc[0])


def counters_any(H: int, I: int, k: int) -> int:
    """Counters enough for every config the tuner may pick (the graph's counter tensor is sized once)."""
    return max(counters(H, I, k, g, d) for g in GATE_UP_CONFIGS + [INTERP[1]] for d in DOWN_CONFIGS + [INTERP[2]])


def _kch(rows: int, split: int, bk: int) -> int:
    """Rows a split takes: a multiple of BLOCK_K (the last split takes what is left)."""
    return triton.cdiv(triton.cdiv(rows, split), bk) * bk


def launch(x, router_w, router_b, gate_up, gate_up_b, down, down_b, k, alpha, limit, out, scratch, configs=None,
           pdl=None, forced_ids=None):
    """x [H] (the block's flattened input) -> out [H], on caller-owned scratch ``(logits [E], ids [k] int32,
    wts [k] fp32, xn [H], act [k, I], count int32, part fp32)``: ``count`` zero, left zero, at least ``counters``
    long; ``part`` at least ``part_size`` long. ``configs``: (router, gate_up, down) as ``default_configs`` gives
    them. ``forced_ids`` (int32 [k]): the router takes these experts, its softmax over their logits (the
    benchmark's real-routing hook)."""
    pdl = launch_pdl(pdl)
    rc, gc, dc = configs or default_configs()
    logits, ids, wts, xn, act, count, part = scratch
    E, H, I2 = gate_up.shape
    I = I2 // 2
    launch_kw = {"launch_pdl": True} if pdl else {}
    # top-k of the biased logits, then a softmax over the k: the same experts, and up to fp32 rounding the same
    # weights, as the softmax over all, its top k, renormalised; the weights rounded to the dtype
    router = load("moe_routed.py.jinja", pdl=pdl, norm=False, logit_bias=True)
    launch_router(router, x, router_w, k, True, None, 1e-6, scratch[:6], rc, forced_ids, {"lb_ptr": router_b},
                  launch_kw)
    mod = load("moe_gptoss.py.jinja", pdl=pdl)
    bn, bk, split, nw = gc
    bk = min(bk, next_pow2(H))
    nb = triton.cdiv(I, bn)
    mod.oss_gate_up_kernel[(nb, k, split)](
        xn, ids, gate_up, gate_up_b, act, part, count[1:], I, H, _kch(H, split, bk), gate_up.stride(0),
        gate_up.stride(1), gate_up_b.stride(0), float(alpha), float(limit), BLOCK_N=bn, BLOCK_K=bk, TOPK=k,
        SPLIT=split, num_warps=nw, **launch_kw)
    bn, bk, split, nw = dc
    bk = min(bk, next_pow2(I))
    mod.oss_down_kernel[(triton.cdiv(H, bn), k, split)](
        act, ids, wts, down, down_b, out, part, count[1 + k * nb:], I, H, _kch(I, split, bk), down.stride(0),
        down.stride(1), down_b.stride(0), BLOCK_N=bn, BLOCK_K=bk, TOPK=k, SPLIT=split, num_warps=nw, **launch_kw)
    return out


def part_size(H: int, I: int, k: int, gc, dc) -> int:
    """fp32 partial sums the two expert launches write (one buffer: down runs after gate_up has finished)."""
    return max(gc[2] * k * 2 * I, dc[2] * k * H)
