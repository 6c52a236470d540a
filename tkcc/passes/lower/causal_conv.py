"""A short causal convolution's decode step over its cached window (gated DeltaNet's and Mamba2's conv1d), as the
aten graph shows it.

The pattern is tkcc's ``update_conv_state`` (the cached window read from slot ``p % 2`` of its ``[2, B, C, K]``
double buffer — zeros at ``p == 0`` — the token appended, the last ``K`` columns written to slot ``(p + 1) % 2``)
followed by transformers' ``causal_conv1d_fn`` over that window and the slice back to the step's columns, with and
without a bias and a SiLU (``tkcc.kernels.causal_conv.causal_conv_step`` writes it as the models' code does). It
becomes ``tkcc.causal_conv``: one launch per layer. The check refuses what the kernel does not assume: the window
must be a buffer of the graph in that layout, one token of one sequence.
"""
from __future__ import annotations

import torch

from tkcc.kernels.causal_conv import BLOCK_C, causal_conv_step
from tkcc.passes.lower.pattern import Rewrite


def _rewrite(bias: bool, act: str) -> Rewrite:
    if bias:
        def pattern(x, state, weight, b, cache_position):
            return causal_conv_step(x, state, weight, b, cache_position, act)

        def replacement(x, state, weight, b, cache_position, *, block_c, pdl):
            return torch.ops.tkcc.causal_conv(x, state, weight, b, cache_position, act, block_c, pdl), state
    else:
        def pattern(x, state, weight, cache_position):
            return causal_conv_step(x, state, weight, None, cache_position, act)

        def replacement(x, state, weight, cache_position, *, block_c, pdl):
            return torch.ops.tkcc.causal_conv(x, state, weight, None, cache_position, act, block_c, pdl), state

    def example(dt):
        C, K = 48, 4
        x = torch.empty(1, 1, C, dtype=dt).transpose(1, 2)
        t = (x, torch.empty(2, 1, C, K, dtype=dt), torch.empty(C, K, dtype=dt))
        return (t + ((torch.empty(C, dtype=dt),) if bias else ()) + (torch.empty(1, dtype=torch.int64),)), {}

    def check(m) -> str | None:
        x, state, weight = m.val(0), m.val(1), m.val(2)
        if m.tensor(1) is None:
            return "the convolution window is not a buffer of the graph"
        if state.dim() != 4 or state.shape[0] != 2:
            return f"window {tuple(state.shape)} is not a [2, B, C, K] double buffer"
        C, K = state.shape[2], state.shape[3]
        if tuple(x.shape) != (1, C, 1):
            return f"x {tuple(x.shape)} is not one token of one sequence over {C} channels (the kernel is decode)"
        if tuple(weight.shape) != (C, K):
            return f"weight {tuple(weight.shape)} for a [{C}, {K}] window"
        return None

    def params(m, ctx):
        return {"block_c": int(ctx.options.get("causal_conv_block_c") or BLOCK_C[0]), "pdl": bool(ctx.options.get("pdl"))}

    name = f"causal_conv[{act or 'no act'}{', bias' if bias else ''}]"
    return Rewrite(name, pattern, replacement, example, region="causal_conv", check=check, params=params)


REWRITES = [_rewrite(bias, act) for bias in (True, False) for act in ("silu", "")]
