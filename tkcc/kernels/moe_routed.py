"""MoE for one decode token with the routing done once per layer: router+top-k, then the experts.

``moe.py``'s kernels recompute softmax + top-k over the router logits in every
program (1k gate_up programs, and k times in each of 2k down programs) and the
RMSNorm statistic in every gate_up program: a serial prologue before any weight
byte is requested. Here the router GEMV kernel ends with its last program
(atomic arrival counter) writing the k expert ids and weights, and program 0
writes the normalised activations, so the expert kernels start streaming
weights at once; gate_up reads whole rows in one tile (all bytes in flight),
and down reads the k experts' rows in one [k, rows, I] tile that, with PDL,
is requested before gate_up has finished. Same three launches as the router
GEMV + ``moe`` path, same bytes, same rounding (transformers' batched_mm path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from tkcc.kernels.common import fallback_reason, interpreting, next_pow2, note_fallback, rms_ref
from tkcc.kernels.graph_replay import launch_pdl
from tkcc.kernels.moe import moe_ref
from tkcc.kernels.render import load

# (BLOCK_N, num_warps) per kernel; BLOCK_K covers the whole row when it fits (FULL_K), else a loop
ROUTER_CONFIGS = [(2, 4), (1, 4), (4, 8), (2, 8), (1, 8)]
GATE_UP_CONFIGS = [(2, 4), (4, 8), (1, 4), (2, 8), (4, 4), (8, 8), (1, 2)]
DOWN_CONFIGS = [(2, 8), (1, 4), (1, 8), (2, 4), (4, 8), (4, 16), (1, 2)]
MAX_TILE = 16384  # elements per weight tile held in registers (per kernel program)
INTERP = (16, 4)


def moe_routed_ref(x, router_w, gate_up, down, top_k, norm_topk_prob=False, residual=None, norm_w=None, eps=1e-5,
                   forced_ids=None, residual_scale=1.0):
    """Eager: logits = router(rmsnorm(x)), then transformers' batched_mm experts (``moe_ref``) [+ residual
    [* residual_scale, rounded]]."""
    xs = x.reshape(1, -1)
    xn = rms_ref(xs, norm_w, eps) if norm_w is not None else xs
    logits = F.linear(xn, router_w)
    r = None if residual is None else residual.reshape(1, -1)
    if r is not None and residual_scale != 1.0:
        r = r * residual_scale
    return moe_ref(xs, logits, gate_up, down, top_k, norm_topk_prob, r, norm_w, eps, forced_ids).reshape(x.shape)


def _block_k(n_rows: int, K: int) -> int:
    """The whole row when the [rows, K] tile fits the register budget, else the largest power of two that does."""
    bk = next_pow2(K)
    while n_rows * bk > MAX_TILE and bk > 64:
        bk //= 2
    return bk


class RoutedMoE:
    """Scratch for one decoder (reused by every layer: launches are ordered) and the three launches."""

    def __init__(self, E: int, H: int, I: int, top_k: int, device, dtype):
        self.E, self.H, self.I, self.k = E, H, I, top_k
        self.logits = torch.empty(E, device=device, dtype=dtype)
        self.ids = torch.zeros(top_k, device=device, dtype=torch.int32)
        self.wts = torch.zeros(top_k, device=device, dtype=torch.float32)
        self.xn = torch.empty(H, device=device, dtype=dtype)
        self.act = torch.empty(top_k, I, device=device, dtype=dtype)
        self.count = torch.zeros(1, device=device, dtype=torch.int32)  # the router's arrival counter, self-resetting

    def __call__(self, x, router_w, gate_up, down, norm_topk_prob=False, residual=None, norm_w=None, eps=1e-5,
                 forced_ids=None, out=None, router_config=None, gate_up_config=None, down_config=None, pdl=None,
                 residual_scale=1.0):
        """x [H] (pre-norm when norm_w) -> [H] (+ residual [* residual_scale]), written to ``out`` (may be
        ``residual``)."""
        E, H, I, k = self.E, self.H, self.I, self.k
        reason = fallback_reason(x, router_w, gate_up, down, residual, norm_w)
        if reason is None and (x.numel() != H or tuple(router_w.shape) != (E, H)
                               or tuple(gate_up.shape) != (E, 2 * I, H) or tuple(down.shape) != (E, H, I)
                               or not gate_up.is_contiguous() or not down.is_contiguous() or router_w.stride(-1) != 1
                               or norm_w is None
                               or x.dtype != self.logits.dtype or x.device != self.logits.device):
            reason = (f"not a one-token normed MoE of this shape: x {tuple(x.shape)} router {tuple(router_w.shape)} "
                      f"gate_up {tuple(gate_up.shape)} down {tuple(down.shape)} norm {norm_w is not None}")
        if reason is not None:
            note_fallback("moe_routed", reason)
            y = moe_routed_ref(x, router_w, gate_up, down, k, norm_topk_prob, residual, norm_w, eps, forced_ids,
                               residual_scale)
            if out is None:
                return y
            out.copy_(y)
            return out
        if out is None:
            out = torch.empty(H, device=x.device, dtype=x.dtype)
        rc, gc, dc = default_configs()
        return launch(x, router_w, gate_up, down, k, norm_topk_prob, residual, norm_w, eps, out,
                      (self.logits, self.ids, self.wts, self.xn, self.act, self.count), router_config or rc,
                      gate_up_config or gc, down_config or dc, pdl=pdl, forced_ids=forced_ids,
                      residual_scale=residual_scale)


def default_configs():
    """(router, gate_up, down) configs where the caller (the lowered step's artifact) gives none."""
    if interpreting():
        return INTERP, INTERP, INTERP
    return ROUTER_CONFIGS[0], GATE_UP_CONFIGS[0], DOWN_CONFIGS[0]


def launch(x, router_w, gate_up, down, k, norm_topk_prob, residual, norm_w, eps, out, scratch, rc, gc, dc,
           pdl=None, forced_ids=None, fp32_weights=False, grouped=None, biased=None, residual_scale=1.0):
    """The three launches on caller-owned scratch ``(logits [E], ids [k] int32, wts [k] fp32, xn [H], act [k, I],
    count [1] int32)``: all but ``count`` may hold anything (each is written before it is read); ``count``
    starts at zero and is left at zero. ``rc``/``gc``/``dc``: (BLOCK_N, warps) of router, gate_up, down.
    ``norm_w`` None: ``x`` is normed already. ``fp32_weights``: the routing weights are not rounded to the activations' dtype (Mixtral's router), and
    the weighted sum over the experts is taken in fp32. ``grouped=(bias, n_group, topk_group, scaling)``:
    DeepSeek-V3's router (sigmoid scores, bias-corrected grouped top-k, scaled fp32 weights; the logits
    scratch must then be fp32). ``biased=(bias, norm_min)``: Ernie 4.5-MoE's router (the choice on the softmax
    plus the bias, renormalised over max(sum, norm_min); the logits scratch must be fp32). ``residual_scale``: the
    residual times it, rounded to the dtype, before the add (a down kernel of its own; 1 adds it as it is)."""
    pdl = launch_pdl(pdl)  # None: the enclosing pdl_scope's setting
    logits, ids, wts, xn, act, count = scratch
    E, I2, H = gate_up.shape
    I = I2 // 2
    scaled = residual is not None and residual_scale != 1.0
    mod = load("moe_routed.py.jinja", pdl=pdl, fp32_weights=fp32_weights, norm=norm_w is not None,
               grouped=grouped is not None, biased=biased is not None, **({"res_scale": True} if scaled else {}))
    extra = {}
    if grouped is not None:
        bias, n_group, topk_group, scaling = grouped
        extra = dict(bias_ptr=bias, scaling=float(scaling), NG=int(n_group), NG_PAD=max(2, next_pow2(n_group)),
                     TOPK_GROUP=int(topk_group))
    if biased is not None:
        bias, norm_min = biased
        extra = dict(bias_ptr=bias, norm_min=float(norm_min))
    launch_kw = {"launch_pdl": True} if pdl else {}
    K_PAD = max(2, next_pow2(k))
    launch_router(mod, x, router_w, k, norm_topk_prob, norm_w, eps, scratch, rc, forced_ids, extra, launch_kw)
    bn, nw = gc
    bk = _block_k(2 * bn, H)
    mod.moe_gate_up_routed_kernel[(triton.cdiv(I, bn), k)](
        xn, ids, gate_up, act, I, H, gate_up.stride(0), gate_up.stride(1), BLOCK_N=bn, BLOCK_K=bk,
        FULL_K=bk >= H, num_warps=nw, **launch_kw)
    bn, nw = dc
    bk = _block_k(K_PAD * bn, I)
    mod.moe_down_routed_kernel[(triton.cdiv(H, bn),)](
        act, ids, wts, down, residual if residual is not None else x, out, I, H, down.stride(0),
        down.stride(1), *([float(residual_scale)] if scaled else []), BLOCK_N=bn, BLOCK_K=bk, TOPK=k, K_PAD=K_PAD,
        RESIDUAL=residual is not None,
        FULL_K=bk >= I, num_warps=nw, **launch_kw)
    return out


def launch_router(mod, x, router_w, k, norm_topk_prob, norm_w, eps, scratch, rc, forced_ids, extra, launch_kw):
    """The router launch alone, of ``mod`` (the template rendered with the caller's hooks): logits, the k ids and
    weights, and xn (x normed, or x itself) written to ``scratch``; also gpt-oss's experts' first launch."""
    logits, ids, wts, xn, _act, count = scratch
    E, H = router_w.shape
    bn, nw = rc
    bk = _block_k(bn, H)
    mod.router_topk_kernel[(triton.cdiv(E, bn),)](
        x, norm_w if norm_w is not None else x, router_w, logits, forced_ids if forced_ids is not None else ids, ids, wts,
        xn, count, E, H, router_w.stride(0), eps, BLOCK_N=bn, BLOCK_K=bk, TOPK=k, K_PAD=max(2, next_pow2(k)),
        E_PAD=max(16, next_pow2(E)), NORM_TOPK=bool(norm_topk_prob), FORCED=forced_ids is not None,
        FULL_K=bk >= H, num_warps=nw, **extra, **launch_kw)


def moe_routed(x, router_w, gate_up, down, top_k, norm_topk_prob=False, residual=None, norm_w=None, eps=1e-5,
               forced_ids=None, out=None, pdl=None, **configs):
    """One-shot convenience (allocates its scratch): see ``RoutedMoE``."""
    E, I2, H = gate_up.shape
    return RoutedMoE(E, H, I2 // 2, top_k, x.device, x.dtype)(
        x, router_w, gate_up, down, norm_topk_prob, residual, norm_w, eps, forced_ids, out, pdl=pdl, **configs)
