"""Graph-callable ops the decode passes insert: fused kernel on the fast path, the eager reference otherwise.

Each op takes exactly what the region it replaces took (activations, the
module's weights, its constants). The fast path runs when the shapes are one
decode token on a device the kernels support; anything else (prefill, batch
> 1, CPU without the interpreter) runs the plain PyTorch reference, which is
the eager arithmetic op for op, so the rewritten graph stays bit-exact there.

``target`` picks the kernels of the fast path: ``"triton"`` (tkcc.kernels) or
``"cuda"`` (the CUDA C++ families of tkcc.kernels.targets, compiled by NVRTC
and launched on PyTorch's current stream, so CUDA-graph capturable). The CUDA
variant comes as plain ``cuda_*`` scalars (JSON/FX friendly). A shape, device
or dtype the CUDA kernel does not take falls back to the Triton path (and from
there to the reference) with a logged reason, never a wrong result.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from tkcc.errors import TkccError
from tkcc.kernels.attention import attention
from tkcc.kernels.expert_order import permuted_experts
from tkcc.kernels.common import GPU_DTYPES, fallback_reason, note_fallback, rms_ref
from tkcc.kernels.gemv import gemv
from tkcc.kernels.moe import moe, moe_ref
from tkcc.kernels.rmsnorm import rmsnorm

TARGETS = ("triton", "cuda")

# (family, dtype, shape, variant, device index) -> callable, or the reason it could not be built. Graphs and
# CUDA-graph captures reuse one compiled module per key (build before capture: the first call compiles).
_CUDA_KERNELS: dict[tuple, object] = {}
# family -> CUDA kernel calls made, so tests and benchmarks can see the CUDA path ran
CUDA_CALLS: dict[str, int] = {}


def _check_target(op: str, target: str) -> None:
    if target not in TARGETS:
        raise TkccError(f"{op}: unknown kernel target {target!r}; one of {list(TARGETS)}")


def _cuda_reason(*tensors: torch.Tensor | None) -> str | None:
    """None when the CUDA families can take these tensors (one CUDA device, one float dtype), else why not."""
    ts = [t for t in tensors if t is not None]
    dev = ts[0].device
    if dev.type != "cuda":
        return f"device {dev.type} is not an NVIDIA GPU"
    floats = {t.dtype for t in ts if t.is_floating_point()}
    for t in ts:
        if t.device != dev:
            return f"tensors on several devices ({dev}, {t.device})"
    if len(floats) > 1:
        return f"mixed dtypes {sorted(str(d) for d in floats)}"
    if floats and next(iter(floats)) not in GPU_DTYPES:
        return f"unsupported dtype {next(iter(floats))}"
    return None


def cuda_kernel(family: str, dtype: torch.dtype, shape: dict, variant: dict, device: torch.device):
    """(callable, None) for the CUDA kernel of ``family`` at ``shape``/``variant``, or (None, why not)."""
    from tkcc.kernels.targets import cuda as cuda_target
    from tkcc.kernels.targets import kernel

    why = cuda_target.supported(family, dtype, shape)
    if why:
        return None, why
    key = (family, dtype, tuple(sorted(shape.items())), tuple(sorted(variant.items())), device.index)
    hit = _CUDA_KERNELS.get(key)
    if hit is None:
        try:
            with torch.cuda.device(device):
                hit = kernel(family, "cuda", dtype, shape, variant, device=device)
        except TkccError as e:
            hit = f"the {family} CUDA kernel could not be built for {shape} {variant}: {e}"
        _CUDA_KERNELS[key] = hit
    return (None, hit) if isinstance(hit, str) else (hit, None)


def _counted(family: str) -> None:
    CUDA_CALLS[family] = CUDA_CALLS.get(family, 0) + 1


def _aligned(*tensors) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


# ---- MoE ----------------------------------------------------------------------------------------

def _moe_cuda(xs, router_w, gate_up, down, top_k, norm_topk_prob, variant):
    """Router logits (cuBLAS), router_topk kernel, moe_gemv kernel: y [1, H], or (None, why not)."""
    reason = _cuda_reason(xs, router_w, gate_up, down)
    E, I2, H = gate_up.shape
    if reason is None and not (gate_up.is_contiguous() and down.is_contiguous()
                               and tuple(down.shape) == (E, H, I2 // 2) and router_w.shape[0] == E):
        reason = f"experts not contiguous [E, 2I, H]/[E, H, I]: {tuple(gate_up.shape)}, {tuple(down.shape)}"
    if reason is not None:
        return None, reason
    router, why = cuda_kernel("router_topk", xs.dtype, dict(T=1, E=E, K=top_k, normalize=bool(norm_topk_prob)),
                              {"threads": variant["router_threads"]}, xs.device)
    if router is None:
        return None, why
    experts, why = cuda_kernel("moe_gemv", xs.dtype, dict(T=1, H=H, I=I2 // 2, E=E, K=top_k),
                               {"warps": variant["warps"], "rows_per_warp": variant["rows_per_warp"]}, xs.device)
    if experts is None:
        return None, why
    xs = xs.contiguous()
    topw, idx = router(F.linear(xs, router_w).contiguous(), top_k, bool(norm_topk_prob))
    _counted("router_topk")
    _counted("moe_gemv")
    return experts(xs, idx, topw, gate_up, down), None


def moe_block(x, router_w, gate_up, down, top_k: int, norm_topk_prob: bool, fused: bool = True, *,
              target: str = "triton", cuda_warps: int = 4, cuda_rows_per_warp: int = 2,
              cuda_router_threads: int = 64, expert_order: tuple | None = None):
    """A sparse-MoE block (router softmax/top-k + experts) on x [..., H] -> [..., H].

    ``expert_order``: run on the experts stored in this order (new expert i = old ``expert_order[i]``), from
    permuted copies (``tkcc.kernels.expert_order``): the same function, the model's weights untouched."""
    _check_target("moe_block", target)
    if expert_order is not None:
        router_w, gate_up, down = permuted_experts(router_w, gate_up, down, expert_order)
    H = x.shape[-1]
    xs = x.reshape(-1, H)
    if fused and xs.shape[0] == 1:
        if target == "cuda":
            y, why = _moe_cuda(xs, router_w, gate_up, down, top_k, norm_topk_prob,
                               dict(warps=cuda_warps, rows_per_warp=cuda_rows_per_warp,
                                    router_threads=cuda_router_threads))
            if y is not None:
                return y.view(x.shape)
            note_fallback("moe_block[cuda]", f"{why}; using the Triton path")
        reason = fallback_reason(x, router_w, gate_up, down)
        if reason is None:
            logits = gemv(xs[0].contiguous(), router_w)
            return moe(xs[0].contiguous(), logits, gate_up, down, top_k, norm_topk_prob).view(x.shape)
        note_fallback("moe_block", reason)
    logits = F.linear(xs, router_w)
    return moe_ref(xs, logits, gate_up, down, top_k, norm_topk_prob).view(x.shape)


# ---- RMSNorm ------------------------------------------------------------------------------------

def _rms_cuda(x, residual, weight, eps, threads):
    """CUDA rmsnorm over rows of x (+ residual): (y, h) or (None, why not). Never writes the inputs."""
    D = x.shape[-1]
    reason = _cuda_reason(x, residual, weight)
    if reason is None and not (x.is_contiguous() and weight.is_contiguous() and weight.numel() == D
                               and (residual is None or (residual.shape == x.shape and residual.is_contiguous()))):
        reason = f"non-contiguous or mismatched shapes x {tuple(x.shape)} w {tuple(weight.shape)}"
    if reason is not None:
        return None, reason
    fn, why = cuda_kernel("rmsnorm", x.dtype, dict(D=D, residual=residual is not None), {"threads": threads},
                          x.device)
    if fn is None:
        return None, why
    x2 = x.reshape(-1, D)
    # the kernel writes x + residual over its residual argument: give it a copy, the graph may read the input
    h = residual.reshape(-1, D).clone() if residual is not None else None
    if D % 8 == 0 and not _aligned(x2, weight, *([h] if h is not None else [])):
        return None, "rows not 16-byte aligned for the vector loads"
    y, _ = fn(x2, h, weight, float(eps))
    _counted("rmsnorm")
    return (y.view(x.shape), h.view(x.shape) if h is not None else None), None


def rms_norm(x, weight, eps: float, fused: bool = True, *, target: str = "triton", cuda_threads: int = 256):
    _check_target("rms_norm", target)
    if fused and target == "cuda":
        out, why = _rms_cuda(x, None, weight, eps, cuda_threads)
        if out is not None:
            return out[0]
        note_fallback("rms_norm[cuda]", f"{why}; using the Triton path")
    if fused and fallback_reason(x, weight) is None and x.is_contiguous():
        return rmsnorm(x, weight, eps)
    return rms_ref(x, weight, eps)


def add_rms_norm(a, b, weight, eps: float, fused: bool = True, *, target: str = "triton",
                 cuda_threads: int = 256):
    """(rmsnorm(a + b), a + b): the residual add and the norm after it in one pass."""
    _check_target("add_rms_norm", target)
    if fused and target == "cuda" and a.shape == b.shape:
        out, why = _rms_cuda(b, a, weight, eps, cuda_threads)
        if out is not None:
            return out
        note_fallback("add_rms_norm[cuda]", f"{why}; using the Triton path")
    if fused and fallback_reason(a, b, weight) is None and a.is_contiguous() and b.is_contiguous() \
            and a.shape == b.shape:
        return rmsnorm(b, weight, eps, residual=a)
    h = a + b
    return rms_ref(h, weight, eps), h


# ---- attention ----------------------------------------------------------------------------------

def repeat_kv(k, n_rep: int):
    """HF's repeat_kv: [B, Hkv, S, D] -> [B, Hkv * n_rep, S, D]."""
    if n_rep == 1:
        return k
    B, H, S, D = k.shape
    return k[:, :, None].expand(B, H, n_rep, S, D).reshape(B, H * n_rep, S, D)


def _attention_cuda(q, k_cache, v_cache, cache_position, scale, variant):
    """CUDA split-KV decode attention, one token of one sequence: [1, Hq, 1, D], or (None, why not)."""
    B, Hq, _T, D = q.shape
    reason = _cuda_reason(q, k_cache, v_cache)
    if reason is None and not (k_cache.is_contiguous() and v_cache.is_contiguous()
                               and k_cache.shape == v_cache.shape and k_cache.shape[0] == B):
        reason = f"the KV cache is not contiguous [B, Hkv, S, D]: {tuple(k_cache.shape)} {k_cache.stride()}"
    if reason is not None:
        return None, reason
    _, Hkv, S, _ = k_cache.shape
    fn, why = cuda_kernel("decode_attention", q.dtype, dict(B=B, HQ=Hq, HKV=Hkv, D=D, S=S), variant, q.device)
    if fn is None:
        return None, why
    pos = cache_position.reshape(-1)[-1:]
    if pos.dtype != torch.int64:
        pos = pos.to(torch.int64)
    out = fn(q.reshape(B, Hq, D).contiguous(), k_cache, v_cache, pos, float(scale))
    _counted("decode_attention")
    return out.view(B, Hq, 1, D), None


def split_kv_attention(q, k_cache, v_cache, cache_position, mask, scale: float, n_rep: int, chunk: int = 256,
                       sdpa_kwargs: dict | None = None, *, target: str = "triton", cuda_nsplit: int = 0,
                       cuda_warps: int = 4, cuda_unroll: int = 4):
    """Decode attention over a static cache [B, Hkv, S, D] at ``cache_position``.

    Fast path (one token, batch 1): split-KV kernel over positions [0, pos] only — the frontend's mask for a
    decode step is exactly 'positions <= pos', so it is not read. Otherwise: repeat_kv + sdpa as eager."""
    _check_target("split_kv_attention", target)
    B, Hq, T, D = q.shape
    if T == 1 and B == 1:
        if target == "cuda":
            out, why = _attention_cuda(q, k_cache, v_cache, cache_position, scale,
                                       dict(nsplit=cuda_nsplit, warps=cuda_warps, unroll=cuda_unroll))
            if out is not None:
                return out
            note_fallback("split_kv_attention[cuda]", f"{why}; using the Triton path")
        reason = fallback_reason(q, k_cache, v_cache)
        if reason is None:
            S = k_cache.shape[2]
            ch = min(chunk, S)
            splits = triton.cdiv(S, ch)
            seqlen = (cache_position.reshape(-1)[-1:] + 1).to(torch.int32)
            out = attention(q.reshape(Hq, D).contiguous(), k_cache[0], v_cache[0], seqlen, scale=scale,
                            splits=splits, chunk=ch if splits > 1 else S)
            return out.view(1, Hq, 1, D)
        note_fallback("split_kv_attention", reason)
    return F.scaled_dot_product_attention(q, repeat_kv(k_cache, n_rep), repeat_kv(v_cache, n_rep), attn_mask=mask,
                                          scale=scale, **(sdpa_kwargs or {}))


# the decode ops codegen writes as ``_ops.<name>(...)`` calls (tkcc/codegen/forward_source.py)
OPS = (moe_block, rms_norm, add_rms_norm, split_kv_attention)
