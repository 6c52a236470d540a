"""Multi-head latent attention (DeepSeek-V2/V3): the attention block over the compressed latent cache, absorbed.

The pattern is ``DeepseekV3Attention.forward`` from its projections' outputs to the o-proj's input, as the
decode graph holds it once the GEMV rewrites have taken the projections: the query (``q_proj``, or
``q_b_proj`` after the q LoRA) split per head into its no-rope and rope parts; the latent projection's output
(``kv_a_proj_with_mqa``) split into the latent, RMSNormed, and the shared rope key; the rotary on the rope parts
only (DeepSeek's interleaved pairs, ``rope_interleave``, or ``rotate_half``) with the step's cos/sin table; the
latent and the rope key written into the static caches at ``cache_position`` (the capture keeps MLA's compressed
cache: the latent as the "key", the rope key as the "value"); the whole latent cache expanded through
``kv_b_proj`` into per-head keys (+ the rope key) and values; sdpa under the step's causal mask; heads back.

It becomes ``tkcc.mla_attention``: the decode step attends in the latent space instead (q absorbed through
kv_b_proj's K part, attention over the latent + rope key, the output through its V part: the cache is read
once for all heads and never expanded). The rewrite refuses what the kernels assume otherwise, with the reason
in the pass log (the region stays in aten): one token of one sequence, the caches buffers of the graph in the
[B, 1, S, C] / [B, 1, S, R] layout, ``kv_b_proj``'s weight [H (N + V), C] stored as rows, the mask the step's
causal mask over the cache, the rotation the step's table at the cache positions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tkcc.passes.lower.attention import SCALE, step_mask_and_rotary
from tkcc.passes.lower.norms import EPS, rms_norm
from tkcc.passes.lower.pattern import Refused, Rewrite

NOPE = 13  # sentinel: the no-rope part of a query head (distinct from every other literal of the example)


def _rope_interleave(q, k, cos, sin):
    """``apply_rotary_pos_emb_interleave`` (pairs (x0, x1), (x2, x3), ...; out: [rotated evens | rotated odds])."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed


def _rope_half(q, k, cos, sin):
    """``apply_rotary_pos_emb`` (``rotate_half``)."""
    from tkcc.passes.lower.attention import rotate_half

    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _mla_pattern(interleave: bool):
    rope = _rope_interleave if interleave else _rope_half

    def pattern(q_states, compressed_kv, kv_norm, kv_b, k_cache, r_cache, cache_position, cos, sin, mask, *, eps,
                scale, nope):
        batch_size, seq_length = q_states.shape[:-1]
        kv_lora_rank, rope_dim = k_cache.shape[-1], r_cache.shape[-1]
        num_heads = q_states.shape[-1] // (nope + rope_dim)
        v_head_dim = kv_b.shape[0] // num_heads - nope
        q_states = q_states.view(batch_size, seq_length, -1, nope + rope_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [nope, rope_dim], dim=-1)
        kv_nope, k_rot = torch.split(compressed_kv, [kv_lora_rank, rope_dim], dim=-1)
        kv_nope = rms_norm(kv_nope, kv_norm, eps=eps)
        kv_nope = kv_nope.view(batch_size, 1, seq_length, kv_lora_rank)
        k_rot = k_rot.view(batch_size, 1, seq_length, rope_dim)
        q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
        # the cache update (tkcc's PositionedLayer.update: both at cache_position)
        kv_nope = k_cache.index_copy_(2, cache_position, kv_nope)
        k_rot = r_cache.index_copy_(2, cache_position, k_rot)
        query_states = torch.cat((q_pass, q_rot), dim=-1)
        # expand_kv: the whole latent cache through kv_b_proj
        b, _, s, _ = kv_nope.shape
        kv = F.linear(kv_nope, kv_b).view(b, s, -1, nope + v_head_dim).transpose(1, 2)
        k_nope, value_states = torch.split(kv, [nope, v_head_dim], dim=-1)
        k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
        key_states = kv.new_empty(*kv.shape[:-1], nope + rope_dim)
        filled_nope = key_states[..., :nope].copy_(k_nope)
        filled_rope = key_states[..., nope:].copy_(k_rot)
        o = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=mask, dropout_p=0.0,
                                           scale=scale, is_causal=False)
        o = o.transpose(1, 2).contiguous()
        # the two in-place fills of the key buffer are outputs too: in the graph's data flow sdpa reads the buffer
        # (``new_empty``), not the fills, so only as outputs are they (and the rope-key cache behind them) matched
        return o.reshape(batch_size, seq_length, -1).contiguous(), filled_nope, filled_rope

    def replacement(q_states, compressed_kv, kv_norm, kv_b, k_cache, r_cache, cache_position, cos, sin, mask, *, eps,
                    scale, nope, inv_freq, rope_scale, chunk, block_s, num_warps, pdl):
        o = torch.ops.tkcc.mla_attention(q_states, compressed_kv, kv_norm, kv_b, k_cache, r_cache, cache_position,
                                         inv_freq, rope_scale, eps, scale, nope, interleave, chunk, block_s, num_warps,
                                         pdl)
        return o, o, o  # (nothing reads the fills: they go with the region)

    return pattern, replacement


def _example(dt):
    H, V, R, C, S = 3, 11, 6, 20, 40
    return ((torch.empty(1, 1, H * (NOPE + R), dtype=dt), torch.empty(1, 1, C + R, dtype=dt), torch.empty(C, dtype=dt),
             torch.empty(H * (NOPE + V), C, dtype=dt), torch.empty(1, 1, S, C, dtype=dt),
             torch.empty(1, 1, S, R, dtype=dt), torch.empty(1, dtype=torch.int64), torch.empty(1, 1, R, dtype=dt),
             torch.empty(1, 1, R, dtype=dt), torch.empty(1, 1, 1, S, dtype=torch.bool)),
            {"eps": EPS, "scale": SCALE, "nope": NOPE})


def _check(m) -> str | None:
    q, ckv, nw, kv_b, kc, rc = (m.val(i) for i in range(6))
    nope = m.scalars["nope"]
    if q.shape[0] != 1 or q.shape[1] != 1:
        return f"q {tuple(q.shape)} is not one token of one sequence (the MLA kernels are batch-1 decode)"
    C, R = kc.shape[-1], rc.shape[-1]
    if kc.dim() != 4 or rc.dim() != 4 or kc.shape[:3] != rc.shape[:3] or kc.shape[1] != 1 or kc.dtype != q.dtype \
            or rc.dtype != q.dtype:
        return (f"caches {tuple(kc.shape)} {kc.dtype} / {tuple(rc.shape)} {rc.dtype} are not one latent [B, 1, S, C] "
                f"and rope-key [B, 1, S, R] layout")
    if m.tensor(4) is None or m.tensor(5) is None:
        return "the caches are not buffers of the graph"
    H = q.shape[-1] // (nope + R)
    if tuple(nw.shape) != (C,):
        return f"latent norm weight {tuple(nw.shape)} for a latent of {C}"
    if kv_b.dim() != 2 or kv_b.shape[1] != C or kv_b.shape[0] % H or kv_b.stride(-1) != 1:
        return (f"kv_b_proj weight {tuple(kv_b.shape)} strides {tuple(kv_b.stride())} is not [{H} heads x (N + V), "
                f"{C}] stored as rows (the absorbed kernels stream its rows per head)")
    if R % 2:
        return f"rope key of odd width {R}"
    return step_mask_and_rotary(m, pos=6, cos=7, sin=8, mask=9, kv_len=kc.shape[2], whole=True)


def _params(m, ctx):
    kc, rc = m.val(4), m.val(5)
    C, R, S = kc.shape[-1], rc.shape[-1], kc.shape[2]
    H = m.val(0).shape[-1] // (m.scalars["nope"] + R)
    rot = m.inputs[7].args[0]
    chunk, (block_s, num_warps) = ctx.options["attention_layout"](H, 1, C + R, S)
    if block_s is None:
        raise Refused("no attention tile fits the device")
    return {"inv_freq": rot.args[0], "rope_scale": float(rot.args[2]), "chunk": int(chunk), "block_s": int(block_s),
            "num_warps": int(num_warps), "pdl": bool(ctx.options.get("pdl"))}


REWRITES = [Rewrite(f"mla_attention[{'interleaved' if il else 'half'} rope]", *_mla_pattern(il), _example,
                    region="attention", check=_check, params=_params) for il in (True, False)]
