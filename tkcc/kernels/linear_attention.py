"""Linear-attention (lightning) decode step: the recurrent state update and its read-out, one launch per layer.

MiniMax's lightning attention keeps, per head, ``S = sum_s r^(t-s) k_s^T v_s`` ([D, D]) with a per-head decay
``r = exp(-slope)``; one decode token updates it as ``S = r S + k^T v`` and reads ``o = q S``. The state lives
in ``Program.state`` as a double buffer ``[2, B, H, D, D]`` (``tkcc.frontend.hf_cache``): the step at position
``p`` reads slot ``p % 2`` (zeros at ``p == 0``) and writes slot ``(p + 1) % 2``.

``linear_attention`` is that step as one Triton launch over (head, block of value columns): the activation of
the packed projection ``[q | k | v]`` per head, the state read, the decayed update written in place into the
other slot, and ``q S'``. The state is read once and written once (the step's only large traffic); the
rounding follows the eager code (activation, ``k^T v``, ``r S`` and the sum each rounded to the state's
dtype, ``q S'`` summed in fp32). ``linear_attention_ref`` is that eager code, op for op.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from tkcc.kernels.common import fallback_reason, next_pow2, note_fallback

ACTS = {"": 0, "silu": 1}
BLOCK_V = (32, 16, 64, 128)  # value columns per program (the kernel's configs; the first is the default)


def read_state(state: Tensor, cache_position: Tensor) -> Tensor:
    """The state as the step at ``cache_position`` starts: slot ``p % 2``, zeros at ``p == 0``."""
    start = cache_position[0]
    slot = state.index_select(0, (start % 2).reshape(1))[0]
    return torch.where(start > 0, slot, torch.zeros((), dtype=state.dtype, device=state.device))


def linear_attention_ref(qkv: Tensor, state: Tensor, cache_position: Tensor, slope: Tensor, act: str = "silu") -> Tensor:
    """One token of lightning attention from the projection ``qkv`` [B, 1, H * 3D] (per head ``[q | k | v]``,
    before the activation): ``S' = exp(-slope) S + k^T v`` written into slot ``(p + 1) % 2`` of ``state``
    [2, B, H, D, D], and ``q S'`` returned as [B, 1, H D] (MiniMax's decode branch, as transformers writes it)."""
    B, T = qkv.shape[0], qkv.shape[1]
    H, D = state.shape[2], state.shape[-1]
    x = F.silu(qkv) if act == "silu" else qkv
    x = x.reshape(B, T, H, 3 * D)
    q, k, v = (t.transpose(1, 2) for t in torch.split(x, D, dim=3))
    s = read_state(state, cache_position)
    s = torch.exp(-slope) * s + torch.matmul(k.transpose(-1, -2), v)
    o = torch.matmul(q, s)
    end = (cache_position[-1] + 1) % 2
    state.index_copy_(0, end.reshape(1), s.unsqueeze(0).to(state.dtype))
    return o.transpose(1, 2).reshape(B, T, H * D)


def linear_attention_reason(qkv: Tensor, state: Tensor, cache_position: Tensor, slope: Tensor, act: str,
                            block_v: int) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    reason = fallback_reason(qkv, state, slope)
    if reason is not None:
        return reason
    if state.dim() != 5 or state.shape[0] != 2 or state.shape[-1] != state.shape[-2]:
        return f"state {tuple(state.shape)} is not a [2, B, H, D, D] double buffer"
    _, B, H, D, _ = state.shape
    if B != 1 or qkv.shape[0] != 1 or qkv.numel() != 3 * H * D or cache_position.numel() != 1:
        return f"qkv {tuple(qkv.shape)} is not one token of one sequence with {H} heads of 3 x {D}"
    if not qkv.is_contiguous() or not state.is_contiguous() or D != next_pow2(D) or D < 16:
        return f"qkv / state not contiguous, or head dim {D} not a power of two >= 16"
    if slope.numel() != H or not slope.is_contiguous() or not slope.is_floating_point():
        return f"slope {tuple(slope.shape)} {slope.dtype} for {H} heads"
    if not (qkv.dtype == state.dtype == slope.dtype):
        return f"dtypes qkv {qkv.dtype} / state {state.dtype} / slope {slope.dtype} differ"
    if act not in ACTS:
        return f"activation {act!r} has no kernel ({sorted(ACTS)})"
    if block_v < 16 or block_v & (block_v - 1):
        return f"block_v {block_v} is not a power of two >= 16"
    return None


def launch(qkv: Tensor, state: Tensor, cache_position: Tensor, slope: Tensor, out: Tensor, act: str = "silu",
           block_v: int = BLOCK_V[0], pdl: bool = False) -> Tensor:
    """The kernel on checked inputs (``linear_attention_reason`` is None); ``out`` [H * D]."""
    from tkcc.kernels.render import load

    H, D = state.shape[2], state.shape[-1]
    bv = min(block_v, D)
    mod = load("linear_attention.py.jinja", pdl=pdl)
    mod.linear_attention_kernel[(H, D // bv)](
        qkv, state, out, cache_position, slope, state.stride(0), state.stride(2), H, D=D, BLOCK_V=bv,
        ACT=ACTS[act], num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out


def check_position(cache_position: Tensor, op: str) -> None:
    """A recurrent step's position must not be negative (on the CPU, where reading it costs no sync): its slot
    would be read from the wrong parity. Shared by the recurrent-state ops."""
    from tkcc.errors import TkccError

    if cache_position.device.type == "cpu" and int(cache_position.min()) < 0:
        raise TkccError(f"{op}: negative position {int(cache_position.min())}")


@torch.library.custom_op("tkcc::linear_attention", mutates_args=("state",))
def linear_attention(qkv: Tensor, state: Tensor, cache_position: Tensor, slope: Tensor, act: str = "silu",
                     block_v: int = 32, pdl: bool = False) -> Tensor:
    """``linear_attention_ref`` as one launch per layer (one decode token of one sequence on a kernel device;
    anything else runs the reference, with the reason logged once)."""
    reason = linear_attention_reason(qkv, state, cache_position, slope, act, block_v)
    check_position(cache_position, "linear attention")
    if reason is None:
        from tkcc.kernels.lowered import _pdl_ok

        H, D = state.shape[2], state.shape[-1]
        out = torch.empty(H * D, device=qkv.device, dtype=qkv.dtype)
        launch(qkv, state, cache_position, slope, out, act, block_v, pdl and _pdl_ok(qkv.device))
        return out.view(qkv.shape[0], qkv.shape[1], H * D)
    note_fallback("tkcc.linear_attention", reason)
    return linear_attention_ref(qkv, state, cache_position, slope, act)


@linear_attention.register_fake
def _(qkv, state, cache_position, slope, act="silu", block_v=32, pdl=False):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], state.shape[2] * state.shape[-1])
