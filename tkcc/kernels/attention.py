"""Decode attention (one query token) over a static KV cache, split over the context.

Cache layout for decode: ``k_cache, v_cache: [H_kv, S_max, D]`` per layer, one
contiguous run of positions per head, so each (head, split) program streams
its part of the cache once. Only positions ``[0, seqlen)`` are read: seqlen
lives in a device tensor, so a captured CUDA graph stays valid as the
context grows. ``splits`` spreads long contexts over the GPU (flash-decoding).
"""
from __future__ import annotations

import math

import torch
import triton

from tkcc.errors import TkccError
from tkcc.kernels.common import fallback_reason, next_pow2, note_fallback
from tkcc.kernels.graph_replay import launch_pdl
from tkcc.kernels.render import load

LOG2E = 1.4426950408889634


def attention_ref(q, k_cache, v_cache, seqlen, scale=None):
    """q [Hq, D]; caches [H_kv, S_max, D]; attends to positions [0, seqlen). Returns [Hq, D]."""
    Hq, D = q.shape
    Hkv = k_cache.shape[0]
    L = int(seqlen)
    k = k_cache[:, :L].float().repeat_interleave(Hq // Hkv, dim=0)
    v = v_cache[:, :L].float().repeat_interleave(Hq // Hkv, dim=0)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    s = torch.einsum("hd,hsd->hs", q.float(), k) * scale
    return torch.einsum("hs,hsd->hd", torch.softmax(s, -1), v).to(q.dtype)


def choose_splits(context: int, num_kv_heads: int, sms: int = 132, block_s: int = 64) -> tuple[int, int]:
    """(splits, chunk): about two programs per SM, chunks a multiple of block_s and at least 4 blocks long."""
    want = max(1, (2 * sms) // max(1, num_kv_heads))
    chunk = max(4 * block_s, triton.cdiv(triton.cdiv(context, want), block_s) * block_s)
    return triton.cdiv(context, chunk), chunk


def attention(q, k_cache, v_cache, seqlen, scale=None, splits=None, chunk=None, out=None, block_s=64, num_warps=4,
              partials=None, pdl=None):
    """q [Hq, D]; seqlen: int tensor on the device (positions [0, seqlen) are valid) or an int.

    ``splits``/``chunk`` must cover the largest seqlen the call (or captured graph) will see."""
    Hq, D = q.shape
    Hkv, S_max, _ = k_cache.shape
    if isinstance(seqlen, int):
        if seqlen > S_max:
            raise TkccError(f"attention: context {seqlen} is longer than the cache ({S_max} positions)")
        seqlen_t = torch.tensor([seqlen], device=q.device, dtype=torch.int32)
    else:
        seqlen_t = seqlen
    reason = fallback_reason(q, k_cache, v_cache)
    if reason is None and (Hq % Hkv or D != next_pow2(D) or D < 16 or k_cache.stride(2) != 1
                           or k_cache.stride() != v_cache.stride()):
        reason = f"unsupported heads/layout Hq={Hq} Hkv={Hkv} D={D} strides {k_cache.stride()}"
    if reason is not None:
        note_fallback("attention", reason)
        y = attention_ref(q, k_cache, v_cache, int(seqlen_t.reshape(-1)[0]), scale)
        if out is not None:
            out.copy_(y)
            return out
        return y
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    if splits is None:
        L = int(seqlen_t.reshape(-1)[0]) if not isinstance(seqlen, int) else seqlen
        splits, chunk = choose_splits(L, Hkv, block_s=block_s)
    elif chunk is None:
        chunk = triton.cdiv(triton.cdiv(S_max, splits), block_s) * block_s
    G = Hq // Hkv
    if out is None:
        out = torch.empty(Hq, D, device=q.device, dtype=q.dtype)
    pdl = launch_pdl(pdl)  # None: the enclosing pdl_scope's setting
    mod = load("attention.py.jinja", pdl=pdl)
    launch = {"launch_pdl": True} if pdl else {}
    single = splits == 1
    if single:
        po = plse = out
    elif partials is not None:
        po, plse = partials
    else:
        po = torch.empty(Hq, splits, D, device=q.device, dtype=torch.float32)
        plse = torch.empty(Hq, splits, device=q.device, dtype=torch.float32)
    mod.attn_partial_kernel[(Hkv, splits)](
        q, k_cache, v_cache, out, po, plse, seqlen_t, scale * LOG2E, chunk, k_cache.stride(0), k_cache.stride(1),
        S_max, splits, G=G, G_PAD=max(16, next_pow2(G)), D=D, BLOCK_S=block_s, SINGLE=single, num_warps=num_warps,
        **launch)
    if not single:
        combine(po, plse, out, seqlen_t, chunk, splits, pdl)
    return out


def combine(po, plse, out, seqlen, chunk: int, splits: int, pdl: bool | None = None, from_pos: bool = False):
    """Merge the split partials (po [Hq, splits, D] fp32, plse [Hq, splits]) into out [Hq, D], one program
    per head. All splits of a head in one tile (up to 256): the merge's loads are a few round trips to L2
    rather than two per 16 splits, which at 32k context (128-256 splits) cost more than the partials.
    ``from_pos``: ``seqlen`` holds the position just written (the context is one more), as a decode graph's
    ``cache_position`` does, so no launch computes the length."""
    Hq, D = out.shape
    pdl = launch_pdl(pdl)
    bsp = min(256, max(2, next_pow2(splits)))
    load("attention.py.jinja", pdl=pdl, from_pos=from_pos).attn_combine_kernel[(Hq,)](
        po, plse, out, seqlen, chunk, splits, D=D, BLOCK_SP=bsp, num_warps=8 if bsp * D >= 8192 else 4,
        **({"launch_pdl": True} if pdl else {}))
