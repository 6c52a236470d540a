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

# (BLOCK_N, BLOCK_K, num_warps): BLOCK_N columns per program, BLOCK_K rows of H (or I) per tile. Untimed yet (the
# tuner picks on the device). The first of each keeps an H200's 132 SMs busy at gpt-oss-20b's shapes (H = I = 2880,
# k = 4): gate_up 45 x 4 programs; down, one program per BLOCK_N of H's columns, 90
GATE_UP_CONFIGS = [(64, 64, 4), (32, 128, 4), (128, 32, 4), (16, 256, 4)]
DOWN_CONFIGS = [(32, 128, 4), (16, 256, 4), (64, 64, 4), (128, 32, 4)]
INTERP = ((16, 4), (16, 16, 4), (16, 16, 4))


def default_configs():
    """(router, gate_up, down) configs where the caller gives none."""
    if interpreting():
        return INTERP
    return ROUTER_CONFIGS[0], GATE_UP_CONFIGS[0], DOWN_CONFIGS[0]


def launch(x, router_w, router_b, gate_up, gate_up_b, down, down_b, k, alpha, limit, out, scratch, configs=None,
           pdl=None):
    """x [H] (the block's flattened input) -> out [H], on caller-owned scratch ``(logits [E], ids [k] int32,
    wts [k] fp32, xn [H], act [k, I], count [1] int32)`` (``count`` zero, left zero). ``configs``: (router,
    gate_up, down) as ``default_configs`` gives them."""
    pdl = launch_pdl(pdl)
    rc, gc, dc = configs or default_configs()
    logits, ids, wts, xn, act, count = scratch
    E, H, I2 = gate_up.shape
    I = I2 // 2
    launch_kw = {"launch_pdl": True} if pdl else {}
    # top-k of the biased logits, then a softmax over the k: the same experts, and up to fp32 rounding the same
    # weights, as the softmax over all, its top k, renormalised; the weights rounded to the dtype
    router = load("moe_routed.py.jinja", pdl=pdl, norm=False, logit_bias=True)
    launch_router(router, x, router_w, k, True, None, 1e-6, scratch, rc, None, {"lb_ptr": router_b}, launch_kw)
    mod = load("moe_gptoss.py.jinja", pdl=pdl)
    bn, bk, nw = gc
    mod.oss_gate_up_kernel[(triton.cdiv(I, bn), k)](
        xn, ids, gate_up, gate_up_b, act, I, H, gate_up.stride(0), gate_up.stride(1), gate_up_b.stride(0),
        float(alpha), float(limit), BLOCK_N=bn, BLOCK_K=min(bk, next_pow2(H)), num_warps=nw, **launch_kw)
    bn, bk, nw = dc
    mod.oss_down_kernel[(triton.cdiv(H, bn),)](
        act, ids, wts, down, down_b, out, I, H, down.stride(0), down.stride(1), down_b.stride(0),
        BLOCK_N=bn, BLOCK_K=min(bk, next_pow2(I)), TOPK=k, num_warps=nw, **launch_kw)
    return out
