"""Fingerprint of a captured model: what determines its graphs and its numbers.

Model class, config, parameter and buffer names/shapes/dtypes, device, and the
capture settings (phases, batch, cache length) that shape the graphs. Not the
weight values (a fingerprint must be cheap for a 7B model) and not the torch
version (the same model on the same device keeps its name across upgrades;
artifacts record versions themselves).
"""
from __future__ import annotations

import hashlib
import json

import torch


def model_fingerprint(model: torch.nn.Module, settings: dict | None = None) -> str:
    cls = type(model)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        cfg = {k: v for k, v in cfg.to_dict().items() if k not in ("transformers_version", "_name_or_path")}
    tensors = [(n, list(t.shape), str(t.dtype)) for n, t in model.named_parameters(remove_duplicate=False)]
    tensors += [(n, list(t.shape), str(t.dtype)) for n, t in model.named_buffers(remove_duplicate=False)]
    devices = sorted({str(t.device) for t in list(model.parameters()) + list(model.buffers())})
    payload = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "config": cfg,
        "tensors": tensors,
        "devices": devices,
        "settings": settings or {},
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
