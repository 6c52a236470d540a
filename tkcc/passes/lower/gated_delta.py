"""Gated DeltaNet's decode recurrence (Qwen3-Next, Qwen 3.5, OLMo hybrid) as the aten graph shows it.

The pattern is transformers' ``torch_recurrent_gated_delta_rule`` for one token with the q/k L2 norm, from the
q, k, v, g and beta it is called with to its output back in the model's dtype, over tkcc's recurrent state
(``Program.state``: a ``[2, B, H, DK, DV]`` float32 double buffer, read at slot ``p % 2`` — zeros at ``p == 0`` —
and written at slot ``(p + 1) % 2`` by ``index_copy_``, as ``tkcc.frontend.hf_linear_state`` reads and writes it;
``tkcc.kernels.gated_delta.gated_delta_step`` writes both as the model's code does).

It becomes ``tkcc.gated_delta``: one launch that reads the state once and writes it once. The larger patterns
take what Qwen3-Next's layer computes just before the rule into the same launch, each otherwise a launch (or a
copy) of its own per layer: the ``repeat_interleave`` of q and k over the value heads of a key head (the kernel
reads key head ``h // group``), and the gates ``beta = b.sigmoid()``, ``g = -A_log.float().exp() *
softplus(a.float() + dt_bias)`` from the projections' per-key-head ``b`` and ``a`` before their reshape (a copy:
they are strided views of the projection). The convolution before it, and the gated norm and out-projection
after it, are other regions. The check refuses what the kernel does not assume: the state must be a buffer of
the graph in that layout, one token of one sequence.
"""
from __future__ import annotations

import torch

from tkcc.kernels.gated_delta import BLOCK_V, gated_delta_step, qwen3_next_gates
from tkcc.passes.lower.pattern import Rewrite


def _pattern(q, k, v, g, beta, state, cache_position):
    return gated_delta_step(q, k, v, g, beta, state, cache_position, l2=True)


def _grouped_pattern(q, k, v, g, beta, state, cache_position):
    """Qwen3-Next's broadcast of each key head over its value heads, before the rule."""
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    return gated_delta_step(q, k, v, g, beta, state, cache_position, l2=True)


def _gates(rule):
    """``rule`` after Qwen3-Next's gates, from its ``b`` and ``a`` as ``fix_query_key_value_ordering`` splits them
    off the projection ([B, 1, HK, H // HK]) to its reshape to one per value head."""
    def pattern(q, k, v, a, b, state, cache_position, a_log, dt_bias):
        B, T, heads = b.shape[0], b.shape[1], b.shape[2] * b.shape[3]
        g, beta = qwen3_next_gates(a.reshape(B, T, heads), b.reshape(B, T, heads), a_log, dt_bias)
        return rule(q, k, v, g, beta, state, cache_position)

    return pattern


def _replacement(q, k, v, g, beta, state, cache_position, a_log=None, dt_bias=None, *, block_v, pdl):
    """(With the gates' A_log and dt_bias, g and beta are the patterns' a and b.)"""
    out = torch.ops.tkcc.gated_delta(q, k, v, g, beta, state, cache_position, True, block_v, pdl, a_log, dt_bias)
    return out, state


def _example(gates: bool, group: int):
    def example(dt):
        HK, DK, DV = 3, 16, 16
        H = HK * group
        qk = (torch.empty(1, 1, HK, DK, dtype=dt), torch.empty(1, 1, HK, DK, dtype=dt), torch.empty(1, 1, H, DV, dtype=dt))
        pos = (torch.empty(2, 1, H, DK, DV, dtype=torch.float32), torch.empty(1, dtype=torch.int64))
        if gates:
            a_b = (torch.empty(1, 1, HK, group, dtype=dt), torch.empty(1, 1, HK, group, dtype=dt))
            return qk + a_b + pos + (torch.empty(H, dtype=dt), torch.empty(H, dtype=dt)), {}
        return qk + (torch.empty(1, 1, H, dtype=torch.float32), torch.empty(1, 1, H, dtype=dt)) + pos, {}

    return example


def _check(m) -> str | None:
    q, k, v, g, beta, state, pos = (m.val(i) for i in range(7))
    if m.tensor(5) is None:
        return "the recurrent state is not a buffer of the graph"
    if state.dim() != 5 or state.shape[0] != 2:
        return f"state {tuple(state.shape)} is not a [2, B, H, DK, DV] double buffer"
    H, DK, DV = state.shape[2], state.shape[3], state.shape[4]
    HK = q.shape[2] if q.dim() == 4 else 0
    if not HK or H % HK or tuple(q.shape) != (1, 1, HK, DK) or tuple(k.shape) != (1, 1, HK, DK) or \
            tuple(v.shape) != (1, 1, H, DV):
        return f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} are not one token of one sequence " \
               f"for a [{H}, {DK}, {DV}] state (the kernel is batch-1 decode)"
    if g.numel() != H or beta.numel() != H:
        return f"g {tuple(g.shape)} / beta {tuple(beta.shape)} are not one value per head ({H})"
    if len(m.inputs) > 7 and (m.val(7).numel() != H or m.val(8).numel() != H):
        return f"A_log {tuple(m.val(7).shape)} / dt_bias {tuple(m.val(8).shape)} are not one value per head ({H})"
    if pos.dim() != 1:
        return f"positions of shape {tuple(pos.shape)}"
    return None


def _params(m, ctx):
    bv = ctx.options.get("gated_delta_block_v") or BLOCK_V[0]
    return {"block_v": int(bv), "pdl": bool(ctx.options.get("pdl"))}


def _rewrite(name, pattern, gates, group):
    return Rewrite(name, pattern, _replacement, _example(gates, group), region="gated_delta", check=_check,
                   params=_params)


# the larger patterns first: each region is taken by the first that matches it
REWRITES = [_rewrite("gated_delta[l2 qk, qwen3-next gates, grouped heads]", _gates(_grouped_pattern), True, 2),
            _rewrite("gated_delta[l2 qk, qwen3-next gates]", _gates(_pattern), True, 1),
            _rewrite("gated_delta[l2 qk, grouped heads]", _grouped_pattern, False, 2),
            _rewrite("gated_delta[l2 qk]", _pattern, False, 1)]
