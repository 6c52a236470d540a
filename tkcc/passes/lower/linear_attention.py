"""Linear-attention recurrences: MiniMax's lightning attention decode step as the aten graph shows it.

The pattern is transformers' decode branch of ``MiniMaxLightningAttention.forward`` for one token, from the
packed projection's output to the heads merged back, over tkcc's recurrent state (``Program.state``: a
``[2, B, H, D, D]`` double buffer, read at slot ``p % 2`` — zeros at ``p == 0`` — and written at slot
``(p + 1) % 2`` by ``index_copy_``, as ``tkcc.frontend.hf_cache.PositionedCache`` writes it):

    q, k, v = split(act(qkv), D) per head;  S = exp(-slope) * S + k^T v;  o = q S

It becomes ``tkcc.linear_attention``: one launch that applies the activation, reads the state once, writes
the decayed update in place into the other slot and reads it out (``tkcc.kernels.linear_attention``). The
output norm, the sigmoid output gate and the out-projection around it are ordinary regions (the norm and
projection rewrites take them). The check refuses what the kernel does not assume: the state must be a
buffer of the graph in that layout, the decay a per-head [H, 1, 1] tensor, all in one dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tkcc.passes.lower.pattern import Rewrite


def _lightning_pattern(act: str):
    def pattern(qkv, state, cache_position, slope):
        B, T = qkv.shape[0], qkv.shape[1]
        H, D = state.shape[2], state.shape[-1]
        x = F.silu(qkv) if act == "silu" else qkv
        x = x.reshape(B, T, H, 3 * D)
        q, k, v = torch.split(x, D, dim=3)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # PositionedCache.recurrent_state
        start = cache_position[0]
        slot = state.index_select(0, (start % 2).reshape(1))[0]
        s = torch.where(start > 0, slot, torch.zeros((), dtype=state.dtype, device=state.device))
        # transformers' one-token recurrence
        ratio = torch.exp(-slope)
        kv = torch.matmul(k.transpose(-1, -2), v)
        s = ratio * s + kv
        o = torch.matmul(q, s)
        o = torch.cat([o], dim=-2)
        o = o.transpose(1, 2).reshape(B, T, H * D)
        # PositionedCache.write_state
        end = (cache_position[-1] + 1) % 2
        written = state.index_copy_(0, end.reshape(1), s.unsqueeze(0).to(state.dtype))
        return o, written

    def replacement(qkv, state, cache_position, slope, *, block_v, pdl):
        o = torch.ops.tkcc.linear_attention(qkv, state, cache_position, slope, act, block_v, pdl)
        return o, state

    return pattern, replacement


def _example(dt):
    H, D = 3, 16
    return ((torch.empty(1, 1, 3 * H * D, dtype=dt), torch.empty(2, 1, H, D, D, dtype=dt),
             torch.empty(1, dtype=torch.int64), torch.empty(H, 1, 1, dtype=dt)), {})


def _check(m) -> str | None:
    qkv, state, pos, slope = (m.val(i) for i in range(4))
    if m.tensor(1) is None:
        return "the recurrent state is not a buffer of the graph"
    if state.dim() != 5 or state.shape[0] != 2 or state.shape[-1] != state.shape[-2]:
        return f"state {tuple(state.shape)} is not a [2, B, H, D, D] double buffer"
    H, D = state.shape[2], state.shape[-1]
    if qkv.shape[0] != 1 or qkv.shape[1] != 1:
        return f"qkv {tuple(qkv.shape)} is not one token of one sequence (the kernel is batch-1 decode)"
    if tuple(slope.shape) != (H, 1, 1):
        return f"decay slope {tuple(slope.shape)} is not one value per head ({H}, 1, 1)"
    if not (qkv.dtype == state.dtype == slope.dtype):
        return f"dtypes qkv {qkv.dtype} / state {state.dtype} / slope {slope.dtype} differ"
    if pos.dim() != 1:
        return f"positions of shape {tuple(pos.shape)}"
    return None


def _params(m, ctx):
    D = m.val(1).shape[-1]
    bv = ctx.options.get("linear_block_v") or min(32, D)
    return {"block_v": int(bv), "pdl": bool(ctx.options.get("pdl"))}


REWRITES = [Rewrite(f"linear_attention[{act or 'no act'}]", *_lightning_pattern(act), _example,
                    region="linear_attention", check=_check, params=_params) for act in ("silu", "")]
