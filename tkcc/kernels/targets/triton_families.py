"""The kernel families' Triton implementations: adapters from the family signatures to tkcc.kernels.

The Triton kernels (tkcc/kernels) are shaped for the fused decode path; these
adapters give them the family reference's signature so targets can be timed
and checked side by side. Where an adapter adds work (the MoE kernel routes
from logits, so the adapter feeds it logits that reproduce the given routing),
the docstring says so.
"""
from __future__ import annotations

from typing import Callable

import torch

from tkcc.errors import TkccError


def build(family: str, dtype: torch.dtype, shape: dict, variant: dict | None = None) -> Callable:
    if family == "rmsnorm":
        from tkcc.kernels.rmsnorm import rmsnorm

        def run(x, residual, w, eps):
            out = rmsnorm(x, w, eps, residual=residual)
            return out if residual is not None else (out, x)
        return run

    if family == "router_topk":
        from tkcc.kernels.router import router

        def run(logits, k, normalize):
            ids, w = router(logits, k, normalize)
            return w, ids
        return run

    if family == "moe_gemv":
        from tkcc.kernels.moe import moe

        if shape["T"] != 1:
            raise TkccError("the Triton MoE kernel handles one decode token per call")

        def run(x, idx, topw, w_gu, w_d):
            """Routing happens inside the kernel: logits log(topw) at idx (and -1e4 elsewhere) reproduce topw."""
            logits = torch.full((w_gu.shape[0],), -1e4, device=x.device, dtype=torch.float32)
            logits[idx[0]] = topw[0].float().log()
            return moe(x[0], logits.to(x.dtype), w_gu, w_d, idx.shape[1], forced_ids=idx[0]).reshape(1, -1)
        return run

    if family == "decode_attention":
        from tkcc.kernels.attention import attention

        if shape["B"] != 1:
            raise TkccError("the Triton decode attention kernel handles one sequence per call")

        def run(q, k, v, cache_pos, scale):
            seqlen = (cache_pos + 1).to(torch.int32)
            return attention(q[0], k[0], v[0], seqlen, scale, splits=None).unsqueeze(0)
        return run
    raise TkccError(f"no Triton implementation for family {family!r}")
