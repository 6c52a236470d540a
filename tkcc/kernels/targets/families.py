"""Kernel families every target implements, each with its plain PyTorch reference beside it.

A family fixes the signature and the math (rounded where Hugging Face's eager
code rounds); a target (cuda, hip, nki, triton) supplies an implementation.
``bytes_moved`` is the floor each call must move through device memory, for
the achieved-bandwidth figures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tkcc.errors import TkccError

_DT = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DT[dtype]
    except KeyError:
        raise TkccError(f"kernel targets support float32/float16/bfloat16, not {dtype}") from None


# ---- references ------------------------------------------------------------------------------

def rmsnorm_ref(x, residual, w, eps: float):
    """y = w * rmsnorm(x + residual); returns (y, x + residual) (the next residual)."""
    h = x + residual if residual is not None else x
    hf = h.float()
    y = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y, h


def router_topk_ref(logits, k: int, normalize: bool):
    p = torch.softmax(logits, dim=-1, dtype=torch.float)
    val, idx = torch.topk(p, k, dim=-1)
    if normalize:
        val = val / val.sum(-1, keepdim=True)
    return val.to(logits.dtype), idx


def moe_gemv_ref(x, idx, topw, w_gu, w_d):
    """Sum over each token's selected experts of topw * down(silu(gate) * up)."""
    T, H = x.shape
    inter = w_d.shape[-1]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for t in range(T):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gu = x[t] @ w_gu[e].T
            g, u = gu[:inter], gu[inter:]
            h = F.silu(g) * u
            d = h @ w_d[e].T
            out[t] += (d * topw[t, j]).float()
    return out.to(x.dtype)


def decode_attention_ref(q, k, v, cache_pos, scale: float):
    """Attention of one new token per sequence over the first cache_pos+1 cached positions."""
    L = int(cache_pos[0]) + 1
    hq, hkv = q.shape[1], k.shape[1]
    kk = k[:, :, :L].repeat_interleave(hq // hkv, dim=1).float()
    vv = v[:, :, :L].repeat_interleave(hq // hkv, dim=1).float()
    s = torch.einsum("bhd,bhld->bhl", q.float(), kk) * scale
    return torch.einsum("bhl,bhld->bhd", torch.softmax(s, -1), vv).to(q.dtype)


# ---- families --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    name: str
    template: str
    reference: Callable
    make_inputs: Callable  # (shape: dict, dtype, device, generator) -> tuple of args
    bytes_moved: Callable  # (shape: dict, dtype) -> int
    tolerance: dict  # dtype name -> (rtol, atol)


def _rms_inputs(s, dtype, device, g):
    R, D = s["rows"], s["D"]
    x = torch.randn(R, D, generator=g).to(device, dtype)
    res = torch.randn(R, D, generator=g).to(device, dtype) if s.get("residual", True) else None
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype)
    return x, res, w, 1e-6


def _router_inputs(s, dtype, device, g):
    return (torch.randn(s["T"], s["E"], generator=g).to(device, dtype), s["K"], s.get("normalize", False))


def _moe_inputs(s, dtype, device, g):
    T, H, I, E, K = s["T"], s["H"], s["I"], s["E"], s["K"]
    x = torch.randn(T, H, generator=g).to(device, dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    topw = torch.softmax(torch.randn(T, K, generator=g), -1).to(device, dtype)
    w_gu = (torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)).to(device, dtype)
    w_d = (torch.randn(E, H, I, generator=g) / math.sqrt(I)).to(device, dtype)
    return x, idx, topw, w_gu, w_d


def _attn_inputs(s, dtype, device, g):
    B, HQ, HKV, D, S, L = s["B"], s["HQ"], s["HKV"], s["D"], s["S"], s["L"]
    q = torch.randn(B, HQ, D, generator=g).to(device, dtype)
    k = torch.randn(B, HKV, S, D, generator=g).to(device, dtype)
    v = torch.randn(B, HKV, S, D, generator=g).to(device, dtype)
    return q, k, v, torch.tensor([L - 1], dtype=torch.int64, device=device), 1.0 / math.sqrt(D)


def _esize(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("rmsnorm", "rmsnorm", rmsnorm_ref, _rms_inputs,
           lambda s, dt: s["rows"] * s["D"] * _esize(dt) * (4 if s.get("residual", True) else 2) + s["D"] * _esize(dt),
           {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}),
    Family("router_topk", "router_topk", router_topk_ref, _router_inputs,
           lambda s, dt: s["T"] * s["E"] * _esize(dt) + s["T"] * s["K"] * (8 + _esize(dt)),
           {"float32": (1e-5, 1e-6), "float16": (2e-3, 1e-4), "bfloat16": (2e-2, 1e-3)}),
    Family("moe_gemv", "moe_gemv", moe_gemv_ref, _moe_inputs,
           lambda s, dt: s["T"] * s["K"] * 3 * s["H"] * s["I"] * _esize(dt) + 2 * s["T"] * s["H"] * _esize(dt),
           {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (5e-2, 5e-2)}),
    Family("decode_attention", "decode_attention", decode_attention_ref, _attn_inputs,
           lambda s, dt: 2 * s["B"] * s["HKV"] * s["L"] * s["D"] * _esize(dt) + 2 * s["B"] * s["HQ"] * s["D"] * _esize(dt),
           {"float32": (1e-4, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}),
]}


# Decode shapes of the reference models (BENCH.md), batch 1
def model_shapes(model: str) -> dict[str, dict]:
    if model == "olmoe-16l":
        return {"rmsnorm": dict(rows=1, D=2048), "router_topk": dict(T=1, E=64, K=8),
                "moe_gemv": dict(T=1, H=2048, I=1024, E=64, K=8),
                "decode_attention": dict(B=1, HQ=16, HKV=16, D=128, S=4096, L=2048)}
    if model == "llama-1b-16l":
        return {"rmsnorm": dict(rows=1, D=2048),
                "decode_attention": dict(B=1, HQ=32, HKV=8, D=64, S=4096, L=2048)}
    raise TkccError(f"no decode shapes recorded for {model!r}")
