"""NKI (AWS Trainium) versions of the kernel families, rendered from jinja2 templates.

What is verified here (see nki_sim.py): each kernel parses, uses only modelled
``nki.language`` names, respects the 128-partition tile limit, and computes
the family's reference on random inputs when executed by the NumPy model.
What is not: acceptance by neuronx-cc, and anything about speed on Trainium.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from tkcc.kernels.targets.render import _env
from tkcc.errors import TkccError

KERNEL_NAMES = {"rmsnorm": "tk_rmsnorm", "router_topk": "tk_router_topk", "moe_gemv": "tk_moe_gemv",
                "decode_attention": "tk_decode_attention"}


def source(family: str, shape: dict) -> str:
    if family not in KERNEL_NAMES:
        raise TkccError(f"no NKI template for family {family!r}")
    params = dict(shape)
    if family == "rmsnorm":
        params.setdefault("residual", True)
        params.setdefault("eps", 1e-6)
    if family == "router_topk":
        params.setdefault("normalize", False)
    if family == "decode_attention":
        params.setdefault("scale", 1.0 / math.sqrt(shape["D"]))
    return _env().get_template(f"nki/{family}.py.jinja").render(**params)


def build_simulated(family: str, shape: dict) -> Callable:
    """The NKI kernel executed by the NumPy model, with the family reference's signature (CPU tensors)."""
    from tkcc.kernels.targets.nki_sim import load_kernels

    kern = load_kernels(source(family, shape))[KERNEL_NAMES[family]]

    def np_(t):
        return t.detach().cpu().numpy()

    def back(a, like):
        return torch.from_numpy(np.ascontiguousarray(a)).to(like.dtype)

    if family == "rmsnorm":
        def run(x, residual, w, eps):
            y, h = kern(np_(x), np_(residual if residual is not None else torch.zeros_like(x)), np_(w))
            return back(y, x), back(h, x)
    elif family == "router_topk":
        def run(logits, k, normalize):
            w, i = kern(np_(logits))
            return back(w, logits), torch.from_numpy(i.astype(np.int64))
    elif family == "moe_gemv":
        def run(x, idx, topw, w_gu, w_d):
            return back(kern(np_(x), np_(idx), np_(topw), np_(w_gu), np_(w_d)), x)
    else:
        def run(q, k, v, cache_pos, scale):
            return back(kern(np_(q), np_(k), np_(v), np_(cache_pos)), q)
    return run
