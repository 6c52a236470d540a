"""Batch-1 linear layers (GEMV): y = W x, reading each weight byte once.

Variants (jinja hooks of ``gemv.py.jinja``): RMSNorm prologue (the norm before
a projection costs no extra launch), bias, gated epilogue (``silu(g) * u`` from a
fused [gate; up] weight), residual epilogue (``r + W x``); for the decode step's
two ends, a gather prologue (x is a row of a table: the token's embedding) and
an argmax epilogue (next token, position + 1). The reference beside it is the
eager composition of the same ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from tkcc.errors import TkccError
from tkcc.kernels.common import fallback_reason, interpreting, note_fallback, rms_ref, split_heads_ref
from tkcc.kernels.graph_replay import launch_pdl
from tkcc.kernels.render import load

# (BLOCK_N, BLOCK_K, num_warps) candidates the tuner times; the first fitting one is the default.
CONFIGS = [(4, 512, 4), (8, 512, 4), (16, 256, 4), (2, 1024, 4), (4, 1024, 8), (8, 256, 2), (1, 2048, 4), (16, 512, 8),
           (2, 2048, 4), (4, 2048, 4), (4, 2048, 8), (8, 2048, 8), (8, 1024, 4), (32, 256, 8), (1, 8192, 4), (2, 8192, 8)]
# the interpreter runs programs one by one in Python: few, large ones are fastest there
INTERP_CONFIG = (64, 128, 4)


ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def gemv_ref(x, w, norm_w=None, eps=1e-5, residual=None, gated=False, bias=None, act="silu", up_act="",
             residual_scale=1.0, residual2=None):
    """Plain PyTorch: [rmsnorm] -> linear [+ bias] -> [act(g)*u | up_act(y)] -> [+ residual [* residual_scale]]
    [+ residual2] (each add rounded, as two eager adds)."""
    if norm_w is not None:
        x = rms_ref(x, norm_w, eps)
    y = F.linear(x, w, bias)
    if up_act:
        y = torch.square(F.relu(y)) if up_act == "relu2" else F.gelu(y, approximate="tanh" if up_act == "gelu_tanh"
                                                                     else "none")
    if gated:
        g, u = y.chunk(2, dim=-1)
        y = ACTS[act](g) * u
    if residual is not None:
        y = (residual if residual_scale == 1.0 else residual * residual_scale) + y
    if residual2 is not None:
        y = residual2 + y
    return y


NSLOT = 256  # argmax: groups of programs fold their row maxima into at most NSLOT 64-bit slots


class ArgmaxState:
    """What the argmax epilogue needs besides ``tok``: its slots (kept at the minimum between launches) and
    its arrival counters (all programs, then one per group; kept at 0), reset by the last arrivals."""

    def __init__(self, device, nslot: int = NSLOT):
        # nslot (a power of two): NSLOT but in the checks, where fewer programs then fill several groups
        self.slots = torch.full((nslot,), -2**63, device=device, dtype=torch.int64)
        self.count = torch.zeros(1 + nslot, device=device, dtype=torch.int32)


def _ends_ref(x, y, gather, argmax):
    """The eager meaning of the two hooks (``x`` is the gathered row, ``y`` the product)."""
    if gather is not None:
        gather[1].copy_(x.reshape(gather[1].shape))
    if argmax is not None:
        tok, _, pos, seq = argmax
        torch.argmax(y.reshape(-1), dim=0, keepdim=True, out=tok.view(1))
        pos.add_(1)
        seq.add_(1)


def gemv(x, w, norm_w=None, eps=1e-5, residual=None, gated=False, out=None, config=None, pdl=None, gather=None,
         argmax=None, bias=None, act="silu", up_act="", split_heads=0, residual_scale=1.0, residual2=None):
    """x: [K] (or [1, K]); w: [N_total, K] with unit stride along K. Returns [N] (N = N_total/2 if gated).

    ``pdl``: launch with programmatic dependent launch (Hopper+): the kernel starts while the previous one
    drains and, when one tile spans K, reads its weights before waiting for the previous kernel's output;
    None: as the enclosing ``graph_replay.pdl_scope`` says (off outside one).
    ``gather=(idx, xout)``: x is a [rows, K] table and the input is its row ``idx[0]`` (int64 [1]), also
    copied to ``xout`` [K]. ``argmax=(tok, ArgmaxState, pos, seq)``: also writes argmax(y) to ``tok``
    (int64 [1]) and adds 1 to ``pos`` and ``seq`` (int32 [1]), after y is complete. ``up_act`` ("gelu",
    "gelu_tanh", "relu2"): y is that activation of the (not gated) product, as a non-gated MLP's up projection.
    ``split_heads`` (a head dim): w's rows are per-head [q_h | k_h | v_h] blocks, and y is stored as [q | k | v]
    over all heads (``split_heads_ref``). ``residual_scale``: y + residual * residual_scale, the product rounded
    to the dtype first, as eager rounds MiniMax's ``h * alpha`` (a kernel variant of its own; 1 adds r as it is).
    ``residual2`` ([N], with ``residual``): also added, after the first sum is rounded (DeepSeek's decoder residual
    over its routed plus shared experts: two eager adds, one launch)."""
    xt = x
    if gather is not None:
        if x.dim() != 2:
            raise TkccError(f"gemv(gather=...): x must be a [rows, K] table, got shape {tuple(x.shape)}")
        x = x[0]  # a row's shape, for the checks below; the kernel reads row idx[0]
    reason = fallback_reason(xt, w, norm_w, residual, bias, residual2)
    if reason is None and residual2 is not None and (residual is None or residual2.numel() != residual.numel()
                                                     or not residual2.is_contiguous()):
        reason = "a second residual without a first one, of another size, or not contiguous"
    if reason is None and bias is not None and (bias.numel() != w.shape[0] or not bias.is_contiguous()):
        reason = f"bias of shape {tuple(bias.shape)} for a weight of {w.shape[0]} rows"
    if reason is None and (x.numel() != w.shape[-1] or w.stride(-1) != 1 or not x.is_contiguous()
                           or (gather is not None and xt.stride(-1) != 1)):
        reason = f"shape/stride x {tuple(xt.shape)} w {tuple(w.shape)} stride {w.stride()} is not a batch-1 GEMV"
    if reason is None and argmax is not None and gated:
        reason = "argmax of a gated GEMV"
    if reason is None and up_act and (gated or residual is not None or argmax is not None
                                      or up_act not in ("gelu", "gelu_tanh", "relu2")):
        reason = f"activation {up_act!r} over a gated output, before a residual or an argmax, or unknown"
    if reason is None and split_heads and (gated or residual is not None or argmax is not None or up_act
                                           or w.shape[0] % (3 * split_heads)):
        reason = f"split_heads={split_heads}: {w.shape[0]} rows, or with a gate, a residual, an argmax or an activation"
    if reason is not None:
        note_fallback("gemv", reason)
        if gather is not None:
            x = xt.index_select(0, gather[0].reshape(-1)).reshape(-1)
        y = gemv_ref(x.reshape(1, -1), w, norm_w, eps, None if residual is None else residual.reshape(1, -1), gated,
                     bias, act, up_act, residual_scale, None if residual2 is None else residual2.reshape(1, -1))
        y = y.reshape(-1)
        if split_heads:
            y = split_heads_ref(y, split_heads)
        if out is not None:
            out.copy_(y)
            y = out
        _ends_ref(x, y, gather, argmax)
        return y
    N_total, K = w.shape
    N = N_total // 2 if gated else N_total
    if out is None:
        out = torch.empty(N, device=x.device, dtype=x.dtype)
    default = INTERP_CONFIG if interpreting() else CONFIGS[0]
    bn, bk, nw = config or default  # a config is the caller's (the lowered step's artifact): no global table
    bk = min(bk, triton.next_power_of_2(K))
    pdl = launch_pdl(pdl)
    scaled = residual is not None and residual_scale != 1.0
    mod = load("gemv.py.jinja", norm=norm_w is not None, gated=gated, residual=residual is not None, pdl=pdl,
               gather=gather is not None, argmax=argmax is not None, bias=bias is not None, act=act,
               **({"up_act": up_act} if up_act else {}), **({"split_heads": True} if split_heads else {}),
               **({"res_scale": True} if scaled else {}), **({"residual2": True} if residual2 is not None else {}))
    grid = (triton.cdiv(N, bn),)
    ends = [float(residual_scale)] if scaled else []
    ends += [residual2] if residual2 is not None else []
    ends += [bias] if bias is not None else []
    if gather is not None:
        ends += [gather[0], gather[1], xt.stride(0)]
    if argmax is not None:
        tok, st, pos, seq = argmax
        nslot = st.slots.numel()
        ends += [st.slots, st.count, tok, pos, seq, triton.cdiv(grid[0], nslot), nslot]
    mod.gemv_kernel[grid](xt, w, out, norm_w if norm_w is not None else x, residual if residual is not None else x,
                          N, K, w.stride(0), eps, *ends, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=(K % bk == 0),
                          FULL_K=bk >= K, num_warps=nw, **({"launch_pdl": True} if pdl else {}),
                          **({"HEAD_D": int(split_heads)} if split_heads else {}))
    return out
