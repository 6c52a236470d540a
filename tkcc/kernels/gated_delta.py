"""Gated DeltaNet decode step (Qwen3-Next, Qwen 3.5, OLMo hybrid): the delta-rule state update and its read-out,
one launch per layer.

A gated DeltaNet layer keeps, per value head, a state ``S`` [DK, DV] in float32. One decode token, as transformers'
``torch_recurrent_gated_delta_rule`` computes it (q and k L2-normalised, q scaled by ``DK ** -0.5``, all in fp32):

    S = exp(g) S;   delta = beta (v - k S);   S = S + k^T delta;   o = q S

The state lives in ``Program.state`` as a double buffer ``[2, B, H, DK, DV]`` (``tkcc.frontend.hf_linear_state``):
the step at position ``p`` reads slot ``p % 2`` (zeros at ``p == 0``) and writes slot ``(p + 1) % 2``. In aten the
step is some twenty launches per layer, each reading or writing the state; ``gated_delta`` is one launch over
(head, block of value columns) that reads the state once and writes it once. ``gated_delta_ref`` is transformers'
code, op for op. The kernel's sums run in another order than torch's: not bit-exact, within fp32 rounding.

The op also takes what transformers computes just before the rule, so that none of it is a launch of its own:
q and k with fewer heads than v (Qwen3-Next's ``repeat_interleave`` of the key heads: value head ``h`` reads key
head ``h // (H // HK)``), and, given ``a_log`` and ``dt_bias``, the projections ``a`` and ``b`` in place of ``g``
and ``beta`` (``qwen3_next_gates``; either per value head ``[B, 1, H]``, or per key head ``[B, 1, HK, H // HK]``
as Qwen3-Next's projection lays them out before its reshape, another copy).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from tkcc.kernels.common import fallback_reason, next_pow2, note_fallback
from tkcc.kernels.linear_attention import check_position, read_state

BLOCK_V = (32, 16, 64, 128)  # value columns per program (the kernel's configs; the first is the default)


def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """transformers' (and FLA's) l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def qwen3_next_gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """(g, beta) as transformers' Qwen3-Next (and Qwen 3.5, OLMo hybrid) compute them from the projections a and b:
    the log decay in float32, the write strength in b's dtype."""
    beta = b.sigmoid()
    # If the model is loaded in fp16, without the .float() here, A might be -inf
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def gated_delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                     cache_position: Tensor, l2: bool = True) -> tuple[Tensor, Tensor]:
    """(output, the state buffer written): transformers' recurrent rule for one token, written as its code writes
    it, over tkcc's state read and write (``PositionedCache``): the reference, and the rewrite's pattern."""
    initial_dtype = q.dtype
    query, key, value, beta, decay = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                      for x in (q, k, v, beta, g)]
    if l2:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
    query = query / (query.shape[-1] ** 0.5)
    last = read_state(state, cache_position).to(value)
    out = torch.zeros_like(value)
    q_t, k_t, v_t = query[:, :, 0], key[:, :, 0], value[:, :, 0]
    decay_t = decay[:, :, 0].exp()[..., None, None]
    last = last * decay_t
    beta_t = beta[:, :, 0].unsqueeze(-1)
    kv_mem = (last * k_t.unsqueeze(-1)).sum(dim=-2)
    delta = (v_t - kv_mem) * beta_t
    last = last + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    out[:, :, 0] = (last * q_t.unsqueeze(-1)).sum(dim=-2)
    out = out.transpose(1, 2).contiguous().to(initial_dtype)
    end = (cache_position[-1] + 1) % 2
    written = state.index_copy_(0, end.reshape(1), last.unsqueeze(0).to(state.dtype))
    return out, written


def gated_delta_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, cache_position: Tensor,
                    l2: bool = True, a_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None) -> Tensor:
    """One token of the gated delta rule: q, k [B, 1, HK, DK] (HK divides H), v [B, 1, H, DV], g (log decay) and
    beta [B, 1, H] (or, with ``a_log`` and ``dt_bias``, the projections a and b they come from: [B, 1, H] or
    [B, 1, HK, H // HK]); ``state`` [2, B, H, DK, DV], written at slot ``(p + 1) % 2``. Returns the output
    [B, 1, H, DV] in q's dtype: transformers' code, op for op."""
    H = v.shape[2]
    g, beta = g.reshape(*g.shape[:2], H), beta.reshape(*beta.shape[:2], H)
    if a_log is not None:
        g, beta = qwen3_next_gates(g, beta, a_log, dt_bias)
    group = H // q.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    return gated_delta_step(q, k, v, g, beta, state, cache_position, l2)[0]


def _per_head(x: Tensor, H: int, HK: int) -> bool:
    """Whether a gate input holds one value per value head: [B, 1, H], or [B, 1, HK, H // HK] per key head."""
    return x.numel() == H and (x.dim() == 3 or (x.dim() == 4 and x.shape[2] == HK))


def gated_delta_reason(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                       cache_position: Tensor, block_v: int, a_log: Optional[Tensor] = None,
                       dt_bias: Optional[Tensor] = None) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    reason = fallback_reason(q, k, v, g, beta, state, a_log, dt_bias)
    if reason is not None:
        return reason
    if state.dim() != 5 or state.shape[0] != 2:
        return f"state {tuple(state.shape)} is not a [2, B, H, DK, DV] double buffer"
    _, B, H, DK, DV = state.shape
    if B != 1 or cache_position.numel() != 1:
        return f"a batch of {B} / {cache_position.numel()} positions (the kernel is one token of one sequence)"
    HK = q.shape[2] if q.dim() == 4 else 0
    if not HK or H % HK or q.shape != (1, 1, HK, DK) or k.shape != (1, 1, HK, DK) or v.shape != (1, 1, H, DV):
        return f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} for a [{H}, {DK}, {DV}] state"
    if not _per_head(g, H, HK) or not _per_head(beta, H, HK):
        return f"g {tuple(g.shape)} / beta {tuple(beta.shape)} for {H} heads ({HK} key heads)"
    if (a_log is None) != (dt_bias is None) or (a_log is not None and (a_log.shape != (H,) or dt_bias.shape != (H,))):
        return f"a_log {None if a_log is None else tuple(a_log.shape)} / dt_bias " \
               f"{None if dt_bias is None else tuple(dt_bias.shape)} are not one value per head ({H})"
    if not state.is_contiguous():
        return "state not contiguous"
    if DK != next_pow2(DK) or DK < 16 or DV < 16:
        return f"key head dim {DK} not a power of two >= 16, or value head dim {DV} < 16"
    if state.dtype != torch.float32:
        return f"state in {state.dtype} (the kernel keeps transformers' float32 state)"
    if block_v < 16 or block_v & (block_v - 1):
        return f"block_v {block_v} is not a power of two >= 16"
    return None


def _head_strides(x: Tensor, group: int) -> tuple[int, int]:
    """(per key head, per value head within it) strides of a per-head gate input (``_per_head``)."""
    if x.dim() == 4:
        return x.stride(2), x.stride(3)
    return group * x.stride(-1), x.stride(-1)


def launch(q, k, v, g, beta, state, cache_position, out, l2: bool = True, block_v: int = BLOCK_V[0],
           pdl: bool = False, a_log=None, dt_bias=None) -> Tensor:
    """The kernel on checked inputs (``gated_delta_reason`` is None); ``out`` [H * DV]."""
    from tkcc.kernels.render import load

    H, DK, DV = state.shape[2], state.shape[3], state.shape[4]
    group = H // q.shape[2]
    bv = min(block_v, next_pow2(DV))
    gates = a_log is not None
    mod = load("gated_delta.py.jinja", pdl=pdl)
    mod.gated_delta_kernel[(H, -(-DV // bv))](
        q, k, v, g, beta, a_log if gates else g, dt_bias if gates else g, state, out, cache_position,
        state.stride(0), state.stride(2), q.stride(2), q.stride(3), k.stride(2), k.stride(3), v.stride(2), v.stride(3),
        *_head_strides(g, group), *_head_strides(beta, group), DK=DK, DV=DV, BLOCK_V=bv, L2=bool(l2), GROUP=group,
        GATES=gates, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out


@torch.library.custom_op("tkcc::gated_delta", mutates_args=("state",))
def gated_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, cache_position: Tensor,
                l2: bool = True, block_v: int = 32, pdl: bool = False, a_log: Optional[Tensor] = None,
                dt_bias: Optional[Tensor] = None) -> Tensor:
    """``gated_delta_ref`` as one launch per layer (one decode token of one sequence on a kernel device; anything
    else runs the reference, with the reason logged once)."""
    reason = gated_delta_reason(q, k, v, g, beta, state, cache_position, block_v, a_log, dt_bias)
    check_position(cache_position, "gated delta")
    if reason is None:
        from tkcc.kernels.lowered import _pdl_ok

        H, DV = state.shape[2], state.shape[4]
        out = torch.empty(H * DV, device=q.device, dtype=q.dtype)
        launch(q, k, v, g, beta, state, cache_position, out, l2, block_v, pdl and _pdl_ok(v.device), a_log, dt_bias)
        return out.view(1, 1, H, DV)
    note_fallback("tkcc.gated_delta", reason)
    return gated_delta_ref(q, k, v, g, beta, state, cache_position, l2, a_log, dt_bias)


@gated_delta.register_fake
def _(q, k, v, g, beta, state, cache_position, l2=True, block_v=32, pdl=False, a_log=None, dt_bias=None):
    return q.new_empty(q.shape[0], q.shape[1], state.shape[2], state.shape[4])
