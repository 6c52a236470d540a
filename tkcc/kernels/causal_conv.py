"""A short causal convolution's decode step over its cached window (gated DeltaNet, Mamba2, before their
recurrences), one launch per layer.

Such a layer keeps its last ``K`` inputs per channel (``conv_<i>`` in ``Program.state``: a double buffer
``[2, B, C, K]`` in the model's dtype, ``tkcc.frontend.hf_linear_state``). One decode token, as transformers'
``causal_conv1d_fn`` computes it over the cached window followed by the token (tkcc's ``update_conv_state``):

    full = [window | x];  y = act(conv1d(full, w, bias, padding=K - 1, groups=C))[..., -1];  window' = full[-K:]

In aten that is a read, a concatenation, a padded depthwise convolution over ``K + 1`` columns, two slices, the
activation and a write. ``causal_conv`` is one launch over blocks of channels. ``causal_conv_ref`` is that eager
code, op for op; the kernel's fp32 sum of K products runs in its own order (not bit-exact).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from tkcc.kernels.common import fallback_reason, next_pow2, note_fallback
from tkcc.kernels.linear_attention import check_position, read_state

ACTS = {"": 0, "silu": 1}
BLOCK_C = (128, 64, 256)  # channels per program (the kernel's configs; the first is the default)


def causal_conv_step(x: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor], cache_position: Tensor,
                     act: str = "silu") -> tuple[Tensor, Tensor]:
    """(output [B, C, T], the state buffer written): tkcc's ``update_conv_state`` then transformers'
    ``causal_conv1d_fn`` and its slice to the step's columns, as the model's code writes them: the reference, and
    the rewrite's pattern. x [B, C, T]; state [2, B, C, K]; weight [C, K] (the conv's weight squeezed)."""
    window = read_state(state, cache_position)
    full = torch.cat([window.to(x.dtype), x], dim=-1)
    end = (cache_position[-1] + 1) % 2
    written = state.index_copy_(0, end.reshape(1), full[..., -window.shape[-1]:].unsqueeze(0).to(state.dtype))
    seq_len, hidden = full.shape[-1], full.shape[1]
    out = F.conv1d(full.to(weight.dtype), weight=weight.unsqueeze(1), bias=bias, padding=weight.shape[-1] - 1,
                   groups=hidden)[:, :, :seq_len]
    if act == "silu":
        out = F.silu(out)
    out = out.to(full.dtype)
    return out[:, :, -x.shape[-1]:], written


def causal_conv_ref(x: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor], cache_position: Tensor,
                    act: str = "silu") -> Tensor:
    return causal_conv_step(x, state, weight, bias, cache_position, act)[0]


def causal_conv_reason(x: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor], cache_position: Tensor,
                       act: str, block_c: int) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    reason = fallback_reason(x, state, weight, bias)
    if reason is not None:
        return reason
    if state.dim() != 4 or state.shape[0] != 2:
        return f"state {tuple(state.shape)} is not a [2, B, C, K] double buffer"
    _, B, C, K = state.shape
    if B != 1 or x.shape != (1, C, 1) or cache_position.numel() != 1:
        return f"x {tuple(x.shape)} is not one token of one sequence over {C} channels"
    if weight.shape != (C, K) or not weight.is_contiguous() or not state.is_contiguous():
        return f"weight {tuple(weight.shape)} for a [{C}, {K}] window, or weight / state not contiguous"
    if bias is not None and (bias.shape != (C,) or not bias.is_contiguous()):
        return f"bias {tuple(bias.shape)} for {C} channels"
    if not (x.dtype == state.dtype == weight.dtype) or (bias is not None and bias.dtype != x.dtype):
        return f"dtypes x {x.dtype} / state {state.dtype} / weight {weight.dtype} differ"
    if act not in ACTS:
        return f"activation {act!r} has no kernel ({sorted(ACTS)})"
    if block_c < 16 or block_c & (block_c - 1):
        return f"block_c {block_c} is not a power of two >= 16"
    return None


def launch(x, state, weight, bias, cache_position, out, act: str = "silu", block_c: int = BLOCK_C[0],
           pdl: bool = False) -> Tensor:
    """The kernel on checked inputs (``causal_conv_reason`` is None); ``out`` [C]."""
    from tkcc.kernels.render import load

    C, K = state.shape[2], state.shape[3]
    mod = load("causal_conv.py.jinja", pdl=pdl)
    mod.causal_conv_kernel[(-(-C // block_c),)](
        x, state, weight, bias if bias is not None else weight, out, cache_position, C, x.stride(1), state.stride(0),
        K=K, K_PAD=max(2, next_pow2(K)), BLOCK_C=block_c, HAS_BIAS=bias is not None, ACT=ACTS[act], num_warps=4,
        **({"launch_pdl": True} if pdl else {}))
    return out


@torch.library.custom_op("tkcc::causal_conv", mutates_args=("state",))
def causal_conv(x: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor], cache_position: Tensor,
                act: str = "silu", block_c: int = 128, pdl: bool = False) -> Tensor:
    """``causal_conv_ref`` as one launch per layer (one decode token of one sequence on a kernel device; anything
    else runs the reference, with the reason logged once)."""
    reason = causal_conv_reason(x, state, weight, bias, cache_position, act, block_c)
    check_position(cache_position, "causal conv")
    if reason is None:
        from tkcc.kernels.lowered import _pdl_ok

        C = state.shape[2]
        out = torch.empty(C, device=x.device, dtype=x.dtype)
        launch(x, state, weight, bias, cache_position, out, act, block_c, pdl and _pdl_ok(x.device))
        return out.view(1, C, 1)
    note_fallback("tkcc.causal_conv", reason)
    return causal_conv_ref(x, state, weight, bias, cache_position, act)


@causal_conv.register_fake
def _(x, state, weight, bias, cache_position, act="silu", block_c=128, pdl=False):
    return x.new_empty(x.shape[0], x.shape[1], x.shape[2])
