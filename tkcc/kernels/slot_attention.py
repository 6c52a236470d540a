"""Split-KV decode attention for B slot rows, each at its own position (continuous batching's decode step).

The slot step (``tkcc.frontend.slots``) decodes one token for each of B rows
of the KV cache, row b at ``positions[b]``. Written as transformers writes it,
each layer expands its cache for grouped-query heads (``repeat_kv``: a copy of
every row's whole cache) and runs sdpa over all ``S`` positions of every row
under a mask. Here each (row, kv head, split) program reads only its row's
positions ``[0, positions[b]]`` of its split, for the G query heads that share
the kv head, with no expanded copy; a second launch merges the splits of each
(row, head) by their log-sum-exp (flash-decoding). Programs of a split past a
row's position do no work, so a short row next to a long one costs what it
reads.

Layout: ``q`` [B, Hq, 1, D]; caches [B, Hkv, S, D] (last dim contiguous, any
row/head/position strides; the slot rows of a ``SlotCache``); ``positions``
[B] int64 on the device (no host read: a CUDA graph of the step stays valid as
the rows advance). The split layout (``chunk`` positions per split) depends on
S, B and Hkv only, never on the positions, and every program computes its
row from that row's own inputs: a row's output does not depend on the other
rows, bit for bit (what continuous batching rests on).

``slot_attention`` runs the kernel where ``tkcc.kernels.common`` says a Triton
kernel can run (CUDA; CPU under ``TRITON_INTERPRET=1`` in fp32/fp16) and the
plain path otherwise: ``repeat_kv`` + sdpa under the step's mask, the slot
step's own arithmetic op for op (so off the kernel path the rewritten step is
bit-exact). ``slot_attention_ref`` is the fp32 reference the checks compare
against; ``check`` runs them (``python -m tkcc.kernels.slot_attention``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tkcc.kernels.common import fallback_reason, next_pow2, note_fallback

LOG2E = 1.4426950408889634
BLOCK_S = 64  # positions per loop step of a program


def slot_attention_ref(q, k_cache, v_cache, positions, scale=None):
    """fp32 reference: row b of q [B, Hq, 1, D] attends to row b of the caches [B, Hkv, S, D] over positions
    ``[0, positions[b]]`` (GQA: query head h reads kv head h // (Hq / Hkv)). Returns [B, Hq, 1, D] in q's dtype."""
    B, Hq, _, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    for b in range(B):
        L = min(int(positions[b]) + 1, S)
        k = k_cache[b, :, :L].float().repeat_interleave(Hq // Hkv, dim=0)
        v = v_cache[b, :, :L].float().repeat_interleave(Hq // Hkv, dim=0)
        s = torch.einsum("hd,hsd->hs", q[b, :, 0].float(), k) * scale
        out[b, :, 0] = torch.einsum("hs,hsd->hd", torch.softmax(s, -1), v).to(q.dtype)
    return out


def repeat_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' repeat_kv: [B, Hkv, S, D] -> [B, Hkv * n_rep, S, D]."""
    if n_rep == 1:
        return k
    B, H, S, D = k.shape
    return k[:, :, None].expand(B, H, n_rep, S, D).reshape(B, H * n_rep, S, D)


def plain(q, k_cache, v_cache, mask, scale: float):
    """The slot step's own arithmetic: repeat_kv + sdpa over every position under ``mask`` [B, 1, 1, S]."""
    n_rep = q.shape[1] // k_cache.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k_cache, n_rep), repeat_kv(v_cache, n_rep), attn_mask=mask,
                                          scale=scale)


def choose_chunk(S: int, rows: int, kv_heads: int, sms: int = 132, block_s: int = BLOCK_S) -> int:
    """Positions per split: about two programs per SM over the rows and kv heads at a full cache, each split at
    least 4 blocks long (a multiple of ``block_s``); the whole cache in one split when that is all it takes."""
    want = max(1, (2 * sms) // max(1, rows * kv_heads))
    chunk = max(4 * block_s, triton.cdiv(triton.cdiv(S, want), block_s) * block_s)
    return min(chunk, S)


def kernel_reason(q, k_cache, v_cache, positions) -> str | None:
    """None when the kernel takes these tensors, else why not (the plain path runs instead)."""
    reason = fallback_reason(q, k_cache, v_cache)
    if reason is not None:
        return reason
    if q.dim() != 4 or k_cache.dim() != 4 or q.shape[2] != 1:
        return f"not one token per row: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
    B, Hq, _, D = q.shape
    Hkv = k_cache.shape[1]
    if (k_cache.shape[0] != B or k_cache.shape[3] != D or k_cache.shape != v_cache.shape or Hq % Hkv
            or D != next_pow2(D) or D < 16 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride()):
        return (f"unsupported heads/layout q {tuple(q.shape)} cache {tuple(k_cache.shape)} strides "
                f"{k_cache.stride()}/{v_cache.stride()}")
    if positions.shape != (B,) or positions.device != q.device or positions.is_floating_point():
        return f"positions {tuple(positions.shape)} {positions.dtype} on {positions.device}: expected [{B}] ints"
    return None


def slot_attention(q, k_cache, v_cache, positions, mask, scale: float, chunk: int = 0):
    """Decode attention of B rows at their own positions: the kernel where it runs, else ``plain`` under ``mask``
    (the step's mask, ``kv index <= positions[b]`` per row, which the kernel derives from ``positions``).
    ``chunk``: positions per split (0: ``choose_chunk`` for this shape)."""
    reason = kernel_reason(q, k_cache, v_cache, positions)
    if reason is not None:
        note_fallback("slot_attention", reason)
        return plain(q, k_cache, v_cache, mask, scale)
    B, Hq, _, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    chunk = int(chunk) or choose_chunk(S, B, Hkv)
    return launch(q, k_cache, v_cache, positions, scale, min(chunk, S))


def launch(q, k_cache, v_cache, positions, scale: float, chunk: int, block_s: int = BLOCK_S, num_warps: int = 4):
    """The kernel itself (no checks): partials per (row, kv head, split), then the merge when there are several."""
    B, Hq, _, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    splits = triton.cdiv(S, chunk)
    qc = q.reshape(B, Hq, D)
    if not qc.is_contiguous():
        qc = qc.contiguous()
    out = torch.empty(B, Hq, 1, D, device=q.device, dtype=q.dtype)
    single = splits == 1
    if single:
        po = plse = out
    else:
        po = torch.empty(B * Hq, splits, D, device=q.device, dtype=torch.float32)
        plse = torch.empty(B * Hq, splits, device=q.device, dtype=torch.float32)
    _slot_partial[(B, Hkv, splits)](
        qc, k_cache, v_cache, out, po, plse, positions, float(scale) * LOG2E, chunk, k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), S, Hq, splits, G=G, G_PAD=max(16, next_pow2(G)), D=D,
        BLOCK_S=block_s, SINGLE=single, num_warps=num_warps)
    if not single:
        _slot_combine[(B * Hq,)](po, plse, out, positions, chunk, splits, S, Hq, D=D,
                                 BLOCK_SP=min(256, max(2, next_pow2(splits))), num_warps=4)
    return out


@triton.jit
def _slot_partial(q_ptr, k_ptr, v_ptr, out_ptr, po_ptr, plse_ptr, pos_ptr, qk_scale, chunk, stride_kb, stride_kh,
                  stride_ks, S_MAX, HQ, SPLITS, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                  BLOCK_S: tl.constexpr, SINGLE: tl.constexpr):
    # program (b, h, s): the G query heads of kv head h in row b, over that row's positions of split s
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    L = tl.minimum(tl.load(pos_ptr + b).to(tl.int32) + 1, S_MAX)
    start = sp * chunk
    end = tl.minimum(start + chunk, L)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    gmask = g < G
    rows = b * HQ + hk * G + g  # (row, query head) index into q / out / partials
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    base = b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < end
        k = tl.load(k_ptr + base + s[:, None] * stride_ks + d[None, :], mask=smask[:, None], other=0.0)
        v = tl.load(v_ptr + base + s[:, None] * stride_ks + d[None, :], mask=smask[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        qk = tl.where(smask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SINGLE:
        tl.store(out_ptr + rows[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(po_ptr + (rows[:, None] * SPLITS + sp) * D + d[None, :], o, mask=gmask[:, None])
        tl.store(plse_ptr + rows * SPLITS + sp, lse, mask=gmask)


@triton.jit
def _slot_combine(po_ptr, plse_ptr, out_ptr, pos_ptr, chunk, SPLITS, S_MAX, HQ, D: tl.constexpr,
                  BLOCK_SP: tl.constexpr):
    # program r = (row, query head): merge the splits that hold that row's positions, cdiv(L_b, chunk) of them
    r = tl.program_id(0)
    L = tl.minimum(tl.load(pos_ptr + r // HQ).to(tl.int32) + 1, S_MAX)
    used = tl.minimum((L + chunk - 1) // chunk, SPLITS)
    d = tl.arange(0, D)
    m = float("-inf")
    for s0 in range(0, used, BLOCK_SP):
        sp = s0 + tl.arange(0, BLOCK_SP)
        lse = tl.load(plse_ptr + r * SPLITS + sp, mask=sp < used, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, 0))
    den = tl.zeros([BLOCK_SP], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, used, BLOCK_SP):
        sp = s0 + tl.arange(0, BLOCK_SP)
        smask = sp < used
        lse = tl.load(plse_ptr + r * SPLITS + sp, mask=smask, other=float("-inf"))
        w = tl.where(smask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
        o = tl.load(po_ptr + (r * SPLITS + sp)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
        acc += tl.sum(o * w[:, None], 0)
        den += w
    tl.store(out_ptr + r * D + d, (acc / tl.sum(den, 0)).to(out_ptr.dtype.element_ty))


# (B, Hq, Hkv, D, S, chunk): GQA, MHA and MQA; one split, several, and more than one merge tile holds
SHAPES = ((3, 4, 2, 16, 40, 16), (2, 4, 4, 32, 100, 0), (4, 8, 1, 16, 300, 64), (2, 8, 2, 64, 1024, 0),
          (8, 32, 8, 64, 600, 64), (2, 16, 16, 128, 4096, 16))
CPU_SHAPES = SHAPES[:3]  # the interpreter runs programs one by one


def check(device, dtype, g: torch.Generator, shapes=SHAPES) -> list[dict]:
    """The kernel against ``slot_attention_ref`` on fresh random inputs: per shape, rows at random positions
    with the first (0) and the last (S - 1) always among them; cache positions past each row's own are NaN
    (they must never be read). Rows ``{kernel, shape, dtype, rel_err, tol, ok}`` as ``tkcc.kernels.checks``."""
    from tkcc.kernels.checks import _rand, _row, rel_err

    rows = []
    for B, Hq, Hkv, D, S, chunk in shapes:
        q = _rand(B, Hq, 1, D, device=device, dtype=dtype, g=g)
        kc = _rand(B, Hkv, S, D, device=device, dtype=dtype, g=g)
        vc = _rand(B, Hkv, S, D, device=device, dtype=dtype, g=g)
        pos = torch.randint(0, S, (B,), generator=g)
        pos[0], pos[-1] = 0, S - 1
        for b in range(B):
            kc[b, :, int(pos[b]) + 1:] = float("nan")
            vc[b, :, int(pos[b]) + 1:] = float("nan")
        pos = pos.to(device)
        ch = chunk or choose_chunk(S, B, Hkv)
        mask = torch.arange(S, device=device)[None, None, None, :] <= pos[:, None, None, None]
        reason = kernel_reason(q, kc, vc, pos)
        out = launch(q, kc, vc, pos, 1.0 / math.sqrt(D), min(ch, S)) if reason is None else None
        ref = slot_attention_ref(q, kc, vc, pos)
        err = rel_err(out, ref) if out is not None else float("inf")
        shape = (B, Hq, Hkv, D, S, f"splits={triton.cdiv(S, min(ch, S))}", f"positions={pos.tolist()[:4]}")
        rows.append(_row("slot_attention", shape, dtype, err))
        # the op as the slot step calls it: same result through its dispatch
        got = slot_attention(q, kc, vc, pos, mask, 1.0 / math.sqrt(D), ch)
        rows.append(_row("slot_attention:op", shape, dtype, rel_err(got, ref) if reason is None else float("inf")))
        if out is not None and B > 1:  # row 0 again beside other rows (contents and positions): the same bits
            q2, kc2, vc2 = (_rand(*t.shape, device=device, dtype=dtype, g=g) for t in (q, kc, vc))
            pos2 = torch.randint(0, S, (B,), generator=g).to(device)
            q2[0], kc2[0], vc2[0], pos2[0] = q[0], kc[0], vc[0], pos[0]
            alone = launch(q2, kc2, vc2, pos2, 1.0 / math.sqrt(D), min(ch, S))[0]
            rows.append(_row("slot_attention:rows", shape, dtype, 0.0 if torch.equal(alone, out[0]) else float("inf")))
    return rows


if __name__ == "__main__":  # python -m tkcc.kernels.slot_attention (dtype by TKCC_CHECK_DTYPE), JSON like checks
    import json
    import os
    import sys

    dt = getattr(torch, os.environ.get("TKCC_CHECK_DTYPE", "float32"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = check(dev, dt, torch.Generator().manual_seed(int(os.environ.get("TKCC_CHECK_SEED", "0")) or
                                                        int(torch.randint(0, 2**31, (1,)))),
                CPU_SHAPES if dev == "cpu" else SHAPES)
    bad = [r for r in res if not r["ok"]]
    print(json.dumps({"n": len(res), "failed": bad, "rows": res}, indent=1))
    sys.exit(1 if bad else 0)
