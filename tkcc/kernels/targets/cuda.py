"""CUDA C++ implementations of the kernel families: render, compile (NVRTC), launch.

``template_params`` maps a family's shape and variant (the search's knobs:
threads, warps, rows per warp, splits) to template parameters, the same for
CUDA and HIP, so both targets compile one source. ``build`` returns a callable
with the family reference's signature.
"""
from __future__ import annotations

from typing import Callable

import torch

from tkcc.kernels.targets.families import FAMILIES, dtype_name
from tkcc.kernels.targets.render import render
from tkcc.errors import TkccError

# variant space per family (first value is the default); the search may choose per shape
VARIANTS: dict[str, dict[str, list]] = {
    "rmsnorm": {"threads": [256, 128, 512, 1024, 64, 32]},
    "router_topk": {"threads": [64, 128, 256]},
    "moe_gemv": {"warps": [4, 8, 2], "rows_per_warp": [2, 1, 4]},
    "decode_attention": {"nsplit": [0, 16, 32, 64, 128, 8], "warps": [4, 8, 2], "unroll": [4, 2, 8]},
}


def template_params(family: str, shape: dict, variant: dict | None = None) -> dict:
    v = {k: vals[0] for k, vals in VARIANTS[family].items()}
    v.update(variant or {})
    for k in v:
        if k not in VARIANTS[family]:
            raise TkccError(f"{family}: unknown variant parameter {k!r}; has {sorted(VARIANTS[family])}")
    if family == "rmsnorm":
        vector = shape["D"] % 8 == 0  # whole 16-byte vectors per row in every dtype
        threads = min(v["threads"], max(32, 1 << (max(1, shape["D"] // 8) - 1).bit_length())) if vector else v["threads"]
        return dict(D=shape["D"], threads=threads, residual=shape.get("residual", True), vector=vector)
    if family == "router_topk":
        if shape["E"] > 4 * v["threads"] * 8:
            raise TkccError(f"router_topk: E={shape['E']} too large for {v['threads']} threads")
        return dict(E=shape["E"], K=shape["K"], threads=v["threads"], normalize=shape.get("normalize", False))
    if family == "moe_gemv":
        return dict(H=shape["H"], I=shape["I"], K=shape["K"], warps=v["warps"], rows_per_warp=v["rows_per_warp"])
    if family == "decode_attention":
        if shape["HQ"] % shape["HKV"]:
            raise TkccError(f"decode_attention: HQ={shape['HQ']} not a multiple of HKV={shape['HKV']}")
        nsplit = v["nsplit"] or default_splits(shape)
        return dict(HQ=shape["HQ"], HKV=shape["HKV"], D=shape["D"], S=shape["S"], nsplit=nsplit,
                    warps=v["warps"], unroll=v["unroll"], merge_threads=min(1024, max(32, shape["D"])))
    raise TkccError(f"unknown kernel family {family!r}; families: {sorted(FAMILIES)}")


def default_splits(shape: dict, sms: int = 132) -> int:
    """Context splits when the variant leaves it open (nsplit=0): about four blocks per SM at the
    longest context the cache holds, and no split shorter than 256 positions."""
    return max(1, min(shape["S"] // 256, (4 * sms) // max(1, shape["B"] * shape["HQ"])))


def source(family: str, target: str, dtype: torch.dtype, shape: dict, variant: dict | None = None) -> str:
    return render(FAMILIES[family].template, target, dtype_name(dtype), **template_params(family, shape, variant))


def supported(family: str, dtype: torch.dtype, shape: dict) -> str | None:
    """None when the CUDA kernel handles this shape, else the reason it does not (the caller falls back)."""
    esz = torch.empty(0, dtype=dtype).element_size()
    vec = 16 // esz
    if family == "moe_gemv":
        if shape["H"] % vec or shape["I"] % vec:
            return f"H={shape['H']} and I={shape['I']} must be multiples of {vec} for 16-byte loads"
        if shape["H"] * 4 > 48 * 1024 or shape["K"] * shape["I"] * 4 > 48 * 1024:
            return "activations exceed 48 KiB of shared memory"
    if family == "decode_attention":
        row = shape["D"] * esz
        if row % 16 or row // 16 > 32 or 32 % (row // 16):
            return f"a head of {shape['D']} x {esz} bytes is not a whole number of 16-byte loads within one warp"
    if family == "rmsnorm" and shape["D"] > 16384:
        return f"D={shape['D']} too large for one block per row"
    return None


def build(family: str, dtype: torch.dtype, shape: dict, variant: dict | None = None, arch: str | None = None
          ) -> Callable:
    """A callable with the family reference's signature, running the CUDA kernel(s)."""
    from tkcc.kernels.targets.cuda_launch import CudaModule
    from tkcc.kernels.targets.nvrtc import compile_cuda

    why = supported(family, dtype, shape)
    if why:
        raise TkccError(f"{family} CUDA kernel does not support {shape} in {dtype}: {why}")
    if arch is None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    p = template_params(family, shape, variant)
    mod = CudaModule(compile_cuda(source(family, "cuda", dtype, shape, variant), arch, f"{family}.cu"))

    if family == "rmsnorm":
        fn = mod.function("tk_rmsnorm")

        def run(x, residual, w, eps):
            y = torch.empty_like(x)
            res = residual if residual is not None else x
            if p["vector"] and any(t.data_ptr() % 16 for t in (x, res, w)):
                raise TkccError("rmsnorm (cuda): 16-byte vector loads need 16-byte aligned rows")
            fn((x.shape[0],), (p["threads"],), x.contiguous(), res, w, y, float(eps))
            return y, (residual if residual is not None else x)
        return run

    if family == "router_topk":
        fn = mod.function("tk_router_topk")

        def run(logits, k, normalize):
            T = logits.shape[0]
            w = torch.empty(T, k, dtype=logits.dtype, device=logits.device)
            idx = torch.empty(T, k, dtype=torch.int64, device=logits.device)
            fn((T,), (p["threads"],), logits.contiguous(), w, idx)
            return w, idx
        return run

    if family == "moe_gemv":
        gu, dn = mod.function("tk_moe_gate_up"), mod.function("tk_moe_down")
        rows_per_block = p["warps"] * p["rows_per_warp"]
        threads = p["warps"] * 32

        def run(x, idx, topw, w_gu, w_d):
            T = x.shape[0]
            h = torch.empty(T * p["K"], p["I"], dtype=torch.float32, device=x.device)
            y = torch.empty_like(x)
            idx = idx.contiguous()
            gu(((p["I"] + rows_per_block - 1) // rows_per_block, T * p["K"]), (threads,), x.contiguous(), idx,
               w_gu, h)
            dn(((p["H"] + rows_per_block - 1) // rows_per_block, T), (threads,), h, idx, topw.contiguous(), w_d, y)
            return y
        return run

    if family == "decode_attention":
        split, merge = mod.function("tk_attn_split"), mod.function("tk_attn_merge")

        def run(q, k, v, cache_pos, scale):
            if not (k.is_contiguous() and v.is_contiguous()):
                raise TkccError("decode_attention (cuda): the KV cache must be contiguous [B, HKV, S, D]")
            B = q.shape[0]
            part = torch.empty(B * p["HQ"], p["nsplit"], p["D"] + 2, dtype=torch.float32, device=q.device)
            o = torch.empty_like(q)
            split((B * p["HQ"], p["nsplit"]), (p["warps"] * 32,), q.contiguous(), k, v, cache_pos, part, float(scale))
            merge((B * p["HQ"],), (p["merge_threads"],), part, o)
            return o
        return run
    raise TkccError(f"unknown kernel family {family!r}")
