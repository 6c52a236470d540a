"""``torch.ops.tkcc.mla_attention``: one MLA attention block of a decode step (DeepSeek-V2/V3), as a kernel op.

The op takes what the region computed from: the query projection's output, the latent projection's output
(``kv_a_proj_with_mqa``: the latent C and the shared rope key R), the latent's RMSNorm weight, ``kv_b_proj``'s
weight, the two static caches (latent [B, 1, S, C], rope key [B, 1, S, R]), the positions and the rotary's
``inv_freq`` / ``attention_scaling``. On one decode token of one sequence on a kernel device it runs the absorbed
kernels (``tkcc.kernels.mla_attention``); otherwise ``mla_expanded_ref``, Hugging Face's arithmetic op for op (the
cache expanded through ``kv_b_proj``), so off the kernel path a lowered graph computes what the captured graph
computed, bit for bit. Registered by importing ``tkcc.kernels.lowered`` (as every op of the lowered step).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tkcc.kernels.common import fallback_reason, note_fallback

NS = "tkcc"


def rope_hf(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> tuple[Tensor, Tensor]:
    """``apply_rotary_pos_emb_interleave`` / ``apply_rotary_pos_emb`` of DeepSeek-V3 (cos/sin [B, T, R])."""
    if interleave:
        cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
        sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
        q1, q2 = q[..., 0::2], q[..., 1::2]
        k1, k2 = k[..., 0::2], k[..., 1::2]
        return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
                torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def mla_expanded_ref(q: Tensor, ckv: Tensor, kv_norm: Tensor, kv_b: Tensor, k_cache: Tensor, r_cache: Tensor,
                     cache_position: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, eps: float, scale: float,
                     nope: int, interleave: bool) -> Tensor:
    """``DeepseekV3Attention.forward`` from its projections' outputs to the o-proj's input, over the static
    caches (written at ``cache_position``): q [B, T, H (N + R)], ckv [B, T, C + R] -> [B, T, H V]."""
    B, T = q.shape[0], q.shape[1]
    C, R = k_cache.shape[-1], r_cache.shape[-1]
    H = q.shape[-1] // (nope + R)
    V = kv_b.shape[0] // H - nope
    qs = q.view(B, T, -1, nope + R).transpose(1, 2)
    q_pass, q_rot = torch.split(qs, [nope, R], dim=-1)
    kv_nope, k_rot = torch.split(ckv, [C, R], dim=-1)
    h = kv_nope.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    kv_nope = (kv_norm * h.to(kv_nope.dtype)).view(B, 1, T, C)
    k_rot = k_rot.view(B, 1, T, R)
    q_rot, k_rot = rope_hf(q_rot, k_rot, cos, sin, interleave)
    keys = k_cache.index_copy_(2, cache_position, kv_nope)
    rots = r_cache.index_copy_(2, cache_position, k_rot)
    query = torch.cat((q_pass, q_rot), dim=-1)
    kv = F.linear(keys, kv_b).view(B, keys.shape[2], -1, nope + V).transpose(1, 2)
    k_nope, value = torch.split(kv, [nope, V], dim=-1)
    key = kv.new_empty(*kv.shape[:-1], nope + R)
    key[..., :nope].copy_(k_nope)
    key[..., nope:].copy_(rots.expand(-1, H, -1, -1))
    o = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0, scale=scale)
    return o.transpose(1, 2).reshape(B, T, -1)


def mla_reason(q, ckv, kv_norm, kv_b, k_cache, r_cache, cache_position, inv_freq, nope) -> str | None:
    """None when the MLA kernels take this call, else why not."""
    reason = fallback_reason(q, ckv, kv_norm, kv_b, k_cache, r_cache)
    if reason is not None:
        return reason
    if q.dim() != 3 or q.shape[0] != 1 or q.shape[1] != 1 or cache_position.numel() != 1:
        return f"q {tuple(q.shape)} is not one token of one sequence"
    C, R = k_cache.shape[-1], r_cache.shape[-1]
    if k_cache.dim() != 4 or k_cache.shape[:3] != r_cache.shape[:3] or k_cache.shape[1] != 1 \
            or k_cache.stride(-1) != 1 or r_cache.stride(-1) != 1 or k_cache.dtype != r_cache.dtype:
        return f"caches {tuple(k_cache.shape)} {k_cache.stride()} / {tuple(r_cache.shape)} {r_cache.stride()}"
    if q.shape[-1] % (nope + R) or R % 2 or q.stride(-1) != 1 or ckv.stride(-1) != 1 or ckv.shape[-1] != C + R:
        return f"q {tuple(q.shape)} / latent {tuple(ckv.shape)} for {nope} + {R} per head and a latent of {C}"
    H = q.shape[-1] // (nope + R)
    if kv_b.dim() != 2 or kv_b.shape[1] != C or kv_b.shape[0] % H or kv_b.shape[0] // H <= nope \
            or kv_b.stride(-1) != 1:
        return f"kv_b_proj weight {tuple(kv_b.shape)} {kv_b.stride()} is not [{H} x (N + V), {C}] rows"
    if kv_norm.numel() != C or not kv_norm.is_contiguous():
        return f"latent norm weight {tuple(kv_norm.shape)} for a latent of {C}"
    if not inv_freq.is_floating_point() or inv_freq.numel() != R // 2 or not inv_freq.is_contiguous():
        return f"inv_freq {tuple(inv_freq.shape)} {inv_freq.dtype} (needs a float vector of {R // 2})"
    if q.dtype != k_cache.dtype or ckv.dtype != k_cache.dtype:
        return f"q {q.dtype} / latent {ckv.dtype} / cache {k_cache.dtype}"
    return None


def _check_context(cache_position: Tensor, S: int) -> None:
    from tkcc.errors import TkccError

    last = int(cache_position.max())
    if last >= S or int(cache_position.min()) < 0:
        raise TkccError(f"decode MLA attention: cache position {last} needs a context of {last + 1}, longer than "
                        f"the static cache ({S} positions); capture with a larger max_cache_len")


@torch.library.custom_op(f"{NS}::mla_attention", mutates_args=("k_cache", "r_cache"))
def mla_attention(q: Tensor, ckv: Tensor, kv_norm: Tensor, kv_b: Tensor, k_cache: Tensor, r_cache: Tensor,
                  cache_position: Tensor, inv_freq: Tensor, rope_scale: float, eps: float, scale: float, nope: int,
                  interleave: bool, chunk: int, block_s: int, num_warps: int, pdl: bool = False) -> Tensor:
    """``mla_expanded_ref`` with absorbed projections in three launches (``tkcc.kernels.mla_attention``): q
    through W_UK and rotated, this token's latent normed and rope key rotated into the caches at the position
    (read on the device: a replayed graph advances with its input), split-KV over the latent cache for all heads
    at once, the splits merged and W_UV applied. ``chunk``: positions per split; ``block_s`` x ``num_warps``: the
    split kernel's tile."""
    from tkcc.kernels.lowered import _pdl_ok, attention_layout, causal_mask_ref, rotary_cos_sin_ref

    S = k_cache.shape[2]
    reason = mla_reason(q, ckv, kv_norm, kv_b, k_cache, r_cache, cache_position, inv_freq, nope)
    if reason is None and (chunk < 16 or block_s < 16 or block_s & (block_s - 1) or num_warps not in (1, 2, 4, 8)):
        reason = f"layout chunk={chunk} tile={block_s}x{num_warps}"
    if reason is None:
        if cache_position.device.type == "cpu":  # free to check on the host (on a GPU: the greedy loop's check)
            _check_context(cache_position, S)
        from tkcc.kernels import mla_attention as mk

        R = r_cache.shape[-1]
        H = q.shape[-1] // (nope + R)
        V = kv_b.shape[0] // H - nope
        ch, splits = attention_layout(S, mk.layout(S, chunk))
        out = torch.empty(H * V, device=q.device, dtype=q.dtype)
        mk.launch(q.reshape(-1), ckv.reshape(-1), kv_norm, kv_b, k_cache[0, 0], r_cache[0, 0], cache_position,
                  inv_freq, out, eps=eps, scale=scale, nope=nope, interleave=interleave, chunk=ch, splits=splits,
                  block_s=block_s, num_warps=num_warps, rope_scale=None if rope_scale == 1.0 else rope_scale,
                  pdl=pdl and _pdl_ok(q.device))
        return out.view(1, 1, H * V)
    note_fallback("tkcc.mla_attention", reason)
    _check_context(cache_position, S)
    B = q.shape[0]
    cos, sin = rotary_cos_sin_ref(inv_freq, cache_position.unsqueeze(0).expand(B, -1), rope_scale, q.dtype)
    mask = causal_mask_ref(cache_position, S)
    return mla_expanded_ref(q, ckv, kv_norm, kv_b, k_cache, r_cache, cache_position, cos, sin, mask, eps, scale,
                            nope, interleave)


@mla_attention.register_fake
def _(q, ckv, kv_norm, kv_b, k_cache, r_cache, cache_position, inv_freq, rope_scale, eps, scale, nope, interleave,
      chunk, block_s, num_warps, pdl=False):
    H = q.shape[-1] // (nope + r_cache.shape[-1])
    return q.new_empty(q.shape[0], q.shape[1], kv_b.shape[0] - H * nope)
