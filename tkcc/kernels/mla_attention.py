"""Multi-head latent attention (DeepSeek-V2/V3's MLA) for one decode token, with absorbed projections.

The cache holds, per position, the compressed latent ``c`` [C] (RMSNormed) and one rope key ``k_r`` [R] shared by
every head. Hugging Face's decode step expands the whole cache through ``kv_b_proj`` every step (keys
[H, S, N + R] and values [H, S, V]: S x H x (N + V) x C multiply-adds and two cache-sized temporaries). Absorbed,
the step attends in the latent space instead: with ``kv_b_proj``'s weight split per head into its K part
W_UK[h] [N, C] and its V part W_UV[h] [V, C],

    score[h, s] = q_nope[h] . (W_UK[h] c_s) + q_rope[h] . k_r,s = (q_nope[h] W_UK[h]) . c_s + q_rope[h] . k_r,s
    out[h]      = sum_s p[h, s] W_UV[h] c_s = W_UV[h] (sum_s p[h, s] c_s)

so a step reads ``kv_b_proj``'s weight once and the cache once (C + R per position, for all heads together).

Three launches (``templates/mla_attention.py.jinja``): prep (q absorbed through W_UK, q's rotary, this token's
latent normed and its rope key rotated, both written into the caches at pos), split (split-KV over the latent
cache, a block of heads per program), out (merge the splits, W_UV). ``mla_absorbed_ref`` is the same
arithmetic in plain PyTorch; ``mla_expanded_ref`` (in ``tkcc.kernels.lowered_mla``) is Hugging Face's.
"""
from __future__ import annotations

import torch
import triton

from tkcc.kernels.attention import LOG2E
from tkcc.kernels.common import next_pow2
from tkcc.kernels.graph_replay import launch_pdl
from tkcc.kernels.render import load

HEAD_BLOCK = 16      # heads per split program (the tl.dot's M: every head of the block shares the latent loads)
TILE_ELEMS = 16384   # latent elements per loop step at most (positions x C): a tile of C = 512 is 32 positions
MAX_SPLITS = 128     # splits at most: each covers every head, and the out kernel's programs each merge them all


def layout(S: int, chunk: int) -> int:
    """Positions per split over a cache of S: the layout's chunk, widened so that there are at most
    ``MAX_SPLITS`` splits (a split program serves all heads, so fewer, longer splits than per-head attention)."""
    return max(chunk, -(-S // MAX_SPLITS))


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [..., R] rotated as Hugging Face's DeepSeek-V3 does; cos/sin [..., R] (the table's ``cat(f, f)``).
    ``interleave``: pairs (x0, x1), (x2, x3), ... each rotated by one frequency, returned as
    [rotated evens | rotated odds] (``apply_rotary_pos_emb_interleave``); else ``rotate_half``."""
    if interleave:
        cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def mla_absorbed_ref(q: torch.Tensor, ckv: torch.Tensor, kv_norm: torch.Tensor, kv_b: torch.Tensor,
                     k_cache: torch.Tensor, r_cache: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float, scale: float, nope: int, interleave: bool) -> torch.Tensor:
    """The kernels' arithmetic in PyTorch (fp32 inside; fp64 for fp64 inputs): one token's q [H (N + R)] and
    latent + rope key ``ckv`` [C + R]; caches [S, C] / [S, R] (written at ``pos``); cos/sin [R] at ``pos``.
    Returns [H V]."""
    S, C = k_cache.shape
    R = r_cache.shape[-1]
    H = q.numel() // (nope + R)
    V = kv_b.shape[0] // H - nope
    dt = k_cache.dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32
    x = ckv[:C].to(acc)
    c_new = kv_norm * (x * torch.rsqrt(x.pow(2).mean() + eps)).to(dt)
    k_cache[pos] = c_new.to(dt)
    r_cache[pos] = rope_ref(ckv[C:], cos, sin, interleave).to(dt)
    qh = q.view(H, nope + R)
    q_rope = rope_ref(qh[:, nope:], cos, sin, interleave).to(acc)
    w = kv_b.view(H, nope + V, C).to(acc)
    q_lat = torch.einsum("hn,hnc->hc", qh[:, :nope].to(acc), w[:, :nope])
    c, kr = k_cache[: pos + 1].to(acc), r_cache[: pos + 1].to(acc)
    p = torch.softmax((q_lat @ c.T + q_rope @ kr.T) * scale, dim=-1)
    return torch.einsum("hvc,hc->hv", w[:, nope:], p @ c).reshape(-1).to(dt)


def tile(block_s: int, C: int) -> int:
    """Positions per loop step of the split kernel: the layout's, at most ``TILE_ELEMS`` latent elements."""
    return max(16, min(block_s, TILE_ELEMS // next_pow2(C)))


def launch(q, ckv, kv_norm, kv_b, k_cache, r_cache, pos, inv_freq, out, *, eps, scale, nope, interleave, chunk,
           splits, block_s=32, num_warps=4, rope_scale=None, pdl=None):
    """One token: q [H (N + R)], ckv [C + R] (one contiguous row each), kv_norm [C], kv_b [H (N + V), C] (rows
    contiguous), caches [S, C] / [S, R] (rows contiguous; written at ``pos``, a device int tensor [1]), inv_freq
    [R / 2]; writes ``out`` [H V]. ``chunk`` positions per split over ``splits`` splits (the last takes the rest)."""
    pdl = launch_pdl(pdl)
    S, C = k_cache.shape
    R = r_cache.shape[-1]
    H = q.numel() // (nope + R)
    V = kv_b.shape[0] // H - nope
    dev, dt = q.device, k_cache.dtype
    mod = load("mla_attention.py.jinja", pdl=pdl, rope_scale=rope_scale is not None, interleave=interleave)
    extra = {"launch_pdl": True} if pdl else {}
    scale_kw = {"rope_scale": float(rope_scale)} if rope_scale is not None else {}
    C_P = max(16, next_pow2(C))
    R_P = max(16, next_pow2(R))
    qlat = torch.empty(H, C, device=dev, dtype=dt)
    qr = torch.empty(H, R, device=dev, dtype=dt)
    block_c = min(C_P, 64)
    ncb = triton.cdiv(C, block_c)
    mod.mla_prep_kernel[(H * ncb + 1,)](
        q, ckv, kv_norm, kv_b, k_cache, r_cache, qlat, qr, pos, inv_freq, eps, H, nope, V, kv_b.stride(0),
        k_cache.stride(0), r_cache.stride(0), S, ncb, C=C, R=R, HALF=R // 2, HALF_P=next_pow2(max(R // 2, 1)),
        BLOCK_N=min(64, next_pow2(nope)), BLOCK_C=block_c, C_P=C_P, num_warps=4, **scale_kw, **extra)
    po = torch.empty(H, splits, C_P, device=dev, dtype=torch.float32)
    plse = torch.empty(H, splits, device=dev, dtype=torch.float32)
    mod.mla_split_kernel[(splits, triton.cdiv(H, HEAD_BLOCK))](
        qlat, qr, k_cache, r_cache, po, plse, pos, scale * LOG2E, chunk, k_cache.stride(0), r_cache.stride(0), S,
        splits, H, C=C, C_P=C_P, R=R, R_P=R_P, HB=HEAD_BLOCK, BLOCK_S=tile(block_s, C), num_warps=num_warps,
        num_stages=2, **extra)
    block_v = min(32, next_pow2(V))
    mod.mla_out_kernel[(H, triton.cdiv(V, block_v))](
        po, plse, kv_b, out, pos, chunk, splits, S, nope, V, kv_b.stride(0), C=C, C_P=C_P, BLOCK_C=min(C_P, 128),
        BLOCK_V=block_v, BLOCK_SP=min(16, max(2, next_pow2(splits))), num_warps=4, **extra)
    return out


def aot_variants(C: int = 512, R: int = 64, nope: int = 128, block_s: int = 32):
    """(template, hooks, kernel, signature, constexprs) of the three kernels at DeepSeek's widths, bf16, for
    ``tkcc.kernels.aot.compile_all`` (no GPU needed: the real compiler is stricter than the interpreter)."""
    P, F32, I = "*bf16", "*fp32", "i32"
    C_P, R_P = max(16, next_pow2(C)), max(16, next_pow2(R))
    out = []
    for pdl, interleave in ((True, True), (False, False)):
        hooks = dict(pdl=pdl, rope_scale=False, interleave=interleave)
        sig = {"q_ptr": P, "ckv_ptr": P, "nw_ptr": P, "w_ptr": P, "kc_ptr": P, "rc_ptr": P, "qlat_ptr": P, "qr_ptr": P,
               "pos_ptr": "*i64", "inv_freq_ptr": F32, "eps": "fp32", "H": I, "N": I, "V": I, "stride_w": I,
               "stride_ks": I, "stride_rs": I, "S_MAX": I, "NCB": I, "C": "constexpr", "R": "constexpr",
               "HALF": "constexpr", "HALF_P": "constexpr", "BLOCK_N": "constexpr", "BLOCK_C": "constexpr",
               "C_P": "constexpr"}
        out.append(("mla_attention.py.jinja", hooks, "mla_prep_kernel", sig,
                    dict(C=C, R=R, HALF=R // 2, HALF_P=next_pow2(R // 2), BLOCK_N=min(64, next_pow2(nope)),
                         BLOCK_C=min(C_P, 64), C_P=C_P)))
        sig = {"qlat_ptr": P, "qr_ptr": P, "kc_ptr": P, "rc_ptr": P, "po_ptr": F32, "plse_ptr": F32, "pos_ptr": "*i64",
               "qk_scale": "fp32", "chunk": I, "stride_ks": I, "stride_rs": I, "S_MAX": I, "SPLITS": I, "H": I,
               "C": "constexpr", "C_P": "constexpr", "R": "constexpr", "R_P": "constexpr", "HB": "constexpr",
               "BLOCK_S": "constexpr"}
        out.append(("mla_attention.py.jinja", hooks, "mla_split_kernel", sig,
                    dict(C=C, C_P=C_P, R=R, R_P=R_P, HB=HEAD_BLOCK, BLOCK_S=tile(block_s, C))))
        sig = {"po_ptr": F32, "plse_ptr": F32, "w_ptr": P, "out_ptr": P, "pos_ptr": "*i64", "chunk": I, "SPLITS": I,
               "S_MAX": I, "N": I, "V": I, "stride_w": I, "C": "constexpr", "C_P": "constexpr",
               "BLOCK_C": "constexpr", "BLOCK_V": "constexpr", "BLOCK_SP": "constexpr"}
        out.append(("mla_attention.py.jinja", hooks, "mla_out_kernel", sig,
                    dict(C=C, C_P=C_P, BLOCK_C=min(C_P, 128), BLOCK_V=32, BLOCK_SP=16)))
    return out
