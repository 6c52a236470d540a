"""Gated DeltaNet's decode recurrence (Qwen3-Next, Qwen 3.5, OLMo hybrid) as the aten graph shows it.

The pattern is transformers' ``torch_recurrent_gated_delta_rule`` for one token with the q/k L2 norm, from the
q, k, v, g and beta it is called with to its output back in the model's dtype, over tkcc's recurrent state
(``Program.state``: a ``[2, B, H, DK, DV]`` float32 double buffer, read at slot ``p % 2`` — zeros at ``p == 0`` —
and written at slot ``(p + 1) % 2`` by ``index_copy_``, as ``tkcc.frontend.hf_linear_state`` reads and writes it;
``tkcc.kernels.gated_delta.gated_delta_step`` writes both as the model's code does).

It becomes ``tkcc.gated_delta``: one launch that reads the state once and writes it once. The convolution before
it, and the gated norm and out-projection after it, are other regions. The check refuses what the kernel does not
assume: the state must be a buffer of the graph in that layout, one token of one sequence.
"""
from __future__ import annotations

import torch

from tkcc.kernels.gated_delta import BLOCK_V, gated_delta_step
from tkcc.passes.lower.pattern import Rewrite


def _pattern(q, k, v, g, beta, state, cache_position):
    return gated_delta_step(q, k, v, g, beta, state, cache_position, l2=True)


def _replacement(q, k, v, g, beta, state, cache_position, *, block_v, pdl):
    out = torch.ops.tkcc.gated_delta(q, k, v, g, beta, state, cache_position, True, block_v, pdl)
    return out, state


def _example(dt):
    H, DK, DV = 3, 16, 16
    return ((torch.empty(1, 1, H, DK, dtype=dt), torch.empty(1, 1, H, DK, dtype=dt), torch.empty(1, 1, H, DV, dtype=dt),
             torch.empty(1, 1, H, dtype=torch.float32), torch.empty(1, 1, H, dtype=dt),
             torch.empty(2, 1, H, DK, DV, dtype=torch.float32), torch.empty(1, dtype=torch.int64)), {})


def _check(m) -> str | None:
    q, k, v, g, beta, state, pos = (m.val(i) for i in range(7))
    if m.tensor(5) is None:
        return "the recurrent state is not a buffer of the graph"
    if state.dim() != 5 or state.shape[0] != 2:
        return f"state {tuple(state.shape)} is not a [2, B, H, DK, DV] double buffer"
    H, DK, DV = state.shape[2], state.shape[3], state.shape[4]
    if tuple(q.shape) != (1, 1, H, DK) or tuple(k.shape) != (1, 1, H, DK) or tuple(v.shape) != (1, 1, H, DV):
        return f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} are not one token of one sequence " \
               f"for a [{H}, {DK}, {DV}] state (the kernel is batch-1 decode)"
    if g.numel() != H or beta.numel() != H:
        return f"g {tuple(g.shape)} / beta {tuple(beta.shape)} are not one value per head ({H})"
    if pos.dim() != 1:
        return f"positions of shape {tuple(pos.shape)}"
    return None


def _params(m, ctx):
    bv = ctx.options.get("gated_delta_block_v") or BLOCK_V[0]
    return {"block_v": int(bv), "pdl": bool(ctx.options.get("pdl"))}


REWRITES = [Rewrite("gated_delta[l2 qk]", _pattern, _replacement, _example, region="gated_delta", check=_check,
                    params=_params)]
