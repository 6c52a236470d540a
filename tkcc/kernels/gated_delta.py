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
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from tkcc.kernels.common import fallback_reason, next_pow2, note_fallback
from tkcc.kernels.linear_attention import check_position, read_state

BLOCK_V = (32, 16, 64, 128)  # value columns per program (the kernel's configs; the first is the default)


def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """transformers' (and FLA's) l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


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
                    l2: bool = True) -> Tensor:
    """One token of the gated delta rule: q, k [B, 1, H, DK], v [B, 1, H, DV], g (log decay) and beta [B, 1, H];
    ``state`` [2, B, H, DK, DV], written at slot ``(p + 1) % 2``. Returns the output [B, 1, H, DV] in q's dtype."""
    return gated_delta_step(q, k, v, g, beta, state, cache_position, l2)[0]


def gated_delta_reason(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                       cache_position: Tensor, block_v: int) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    reason = fallback_reason(q, k, v, g, beta, state)
    if reason is not None:
        return reason
    if state.dim() != 5 or state.shape[0] != 2:
        return f"state {tuple(state.shape)} is not a [2, B, H, DK, DV] double buffer"
    _, B, H, DK, DV = state.shape
    if B != 1 or cache_position.numel() != 1:
        return f"a batch of {B} / {cache_position.numel()} positions (the kernel is one token of one sequence)"
    if q.shape != (1, 1, H, DK) or k.shape != (1, 1, H, DK) or v.shape != (1, 1, H, DV):
        return f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} for a [{H}, {DK}, {DV}] state"
    if g.numel() != H or beta.numel() != H:
        return f"g {tuple(g.shape)} / beta {tuple(beta.shape)} for {H} heads"
    if not state.is_contiguous():
        return "state not contiguous"
    if DK != next_pow2(DK) or DK < 16 or DV < 16:
        return f"key head dim {DK} not a power of two >= 16, or value head dim {DV} < 16"
    if state.dtype != torch.float32:
        return f"state in {state.dtype} (the kernel keeps transformers' float32 state)"
    if block_v < 16 or block_v & (block_v - 1):
        return f"block_v {block_v} is not a power of two >= 16"
    return None


def launch(q, k, v, g, beta, state, cache_position, out, l2: bool = True, block_v: int = BLOCK_V[0],
           pdl: bool = False) -> Tensor:
    """The kernel on checked inputs (``gated_delta_reason`` is None); ``out`` [H * DV]."""
    from tkcc.kernels.render import load

    H, DK, DV = state.shape[2], state.shape[3], state.shape[4]
    bv = min(block_v, next_pow2(DV))
    mod = load("gated_delta.py.jinja", pdl=pdl)
    mod.gated_delta_kernel[(H, -(-DV // bv))](
        q, k, v, g, beta, state, out, cache_position, state.stride(0), state.stride(2), q.stride(2), q.stride(3),
        k.stride(2), k.stride(3), v.stride(2), v.stride(3), g.stride(-1), beta.stride(-1), DK=DK, DV=DV, BLOCK_V=bv,
        L2=bool(l2), num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out


@torch.library.custom_op("tkcc::gated_delta", mutates_args=("state",))
def gated_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, cache_position: Tensor,
                l2: bool = True, block_v: int = 32, pdl: bool = False) -> Tensor:
    """``gated_delta_ref`` as one launch per layer (one decode token of one sequence on a kernel device; anything
    else runs the reference, with the reason logged once)."""
    reason = gated_delta_reason(q, k, v, g, beta, state, cache_position, block_v)
    check_position(cache_position, "gated delta")
    if reason is None:
        from tkcc.kernels.lowered import _pdl_ok

        H, DV = state.shape[2], state.shape[4]
        out = torch.empty(H * DV, device=q.device, dtype=q.dtype)
        launch(q, k, v, g, beta, state, cache_position, out, l2, block_v, pdl and _pdl_ok(v.device))
        return out.view(1, 1, H, DV)
    note_fallback("tkcc.gated_delta", reason)
    return gated_delta_ref(q, k, v, g, beta, state, cache_position, l2)


@gated_delta.register_fake
def _(q, k, v, g, beta, state, cache_position, l2=True, block_v=32, pdl=False):
    return q.new_empty(q.shape[0], q.shape[1], state.shape[2], state.shape[4])
