"""What every kernel launcher shares: when a Triton kernel may run, and the fallback log.

A kernel runs on CUDA tensors, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported) in fp32/fp16 — the
interpreter's bf16 arithmetic is wrong, so bf16 on CPU takes the reference.
Anything a kernel does not support takes the plain PyTorch reference with a
logged reason, never a wrong result.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("tkcc.kernels")
_FALLBACKS: dict[tuple[str, str], int] = {}
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERP_DTYPES = (torch.float32, torch.float16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if interpreting():  # the interpreter without its per-helper-call re-patching (interp_patch.py)
    from tkcc.kernels.interp_patch import install as _install_interp_patch

    _install_interp_patch()


def fallback_reason(*tensors: torch.Tensor | None) -> str | None:
    """None when a Triton kernel can take these tensors, else why not."""
    ts = [t for t in tensors if t is not None]
    if not ts:
        return "no tensors"
    dev = ts[0].device
    for t in ts:
        if t.device != dev:
            return f"tensors on several devices ({dev}, {t.device})"
    if dev.type == "cuda":
        bad = [t.dtype for t in ts if t.dtype not in GPU_DTYPES and t.is_floating_point()]
        return f"unsupported dtype {bad[0]}" if bad else None
    if dev.type == "cpu" and interpreting():
        bad = [t.dtype for t in ts if t.is_floating_point() and t.dtype not in INTERP_DTYPES]
        return f"dtype {bad[0]} is not exact in the Triton interpreter" if bad else None
    return f"device {dev.type} without CUDA or TRITON_INTERPRET=1"


def note_fallback(kernel: str, reason: str) -> None:
    """Log once per (kernel, reason) and count, so a silent slow path is visible."""
    key = (kernel, reason)
    if key not in _FALLBACKS:
        log.info("kernel %s: using the PyTorch reference (%s)", kernel, reason)
    _FALLBACKS[key] = _FALLBACKS.get(key, 0) + 1


def fallbacks() -> dict[str, int]:
    return {f"{k}: {r}": n for (k, r), n in _FALLBACKS.items()}


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def split_heads_ref(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per-head [q_h | k_h | v_h] blocks of ``head_dim`` along the last dim, as [q | k | v] over all heads (the
    row order GPT-NeoX's fused projection writes, put in the one the attention reads)."""
    lead = y.shape[:-1]
    return y.reshape(*lead, -1, 3, head_dim).transpose(-3, -2).reshape(*lead, y.shape[-1])


def rms_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Eager RMSNorm as the HF models write it: fp32 statistic, rounded, then times the weight."""
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dt)
