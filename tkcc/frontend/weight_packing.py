"""Pack each decoder layer's q/k/v and gate/up projection weights into one buffer, before any capture.

Fused decode kernels read q/k/v (and gate/up) as one matrix. Packing them
later, by re-pointing the parameters at slices of a new buffer, frees the old
storage while CUDA graphs captured earlier (the engine's reference, shipped
candidates) still read it: those graphs then read whatever the allocator puts
there next. So packing happens once, here, before the first graph is traced;
values do not change and no copy is kept (the parameters become row slices of
one contiguous buffer, in the order q, k, v and gate, up), and fused kernels
later find the weights already packed and use them in place.
"""
from __future__ import annotations

import torch

from tkcc.kernels.packing import is_packed, packed_view  # noqa: F401 - the reading side, re-exported

PROJECTION_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def pack_group(params: list[torch.nn.Parameter]) -> bool:
    """Re-point ``params`` at consecutive row slices of one new buffer (same values); False when nothing to do."""
    if len(params) < 2 or is_packed([p.data for p in params]):
        return False
    if any(p.dim() != 2 or p.shape[1] != params[0].shape[1] or p.dtype != params[0].dtype
           or p.device != params[0].device for p in params):
        return False
    with torch.no_grad():
        cat = torch.cat([p.data for p in params], 0)
        off = 0
        for p in params:
            p.data = cat[off: off + p.shape[0]]
            off += p.shape[0]
    return True


def pack_projections(model: torch.nn.Module) -> int:
    """Pack every decoder layer's projection groups that exist and match; returns how many groups were packed."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) or []
    packed = 0
    for layer in layers:
        for parent_name, names in PROJECTION_GROUPS:
            parent = getattr(layer, parent_name, None)
            mods = [getattr(parent, n, None) for n in names]
            if parent is None or any(m is None or not isinstance(getattr(m, "weight", None), torch.nn.Parameter)
                                     for m in mods):
                continue
            packed += pack_group([m.weight for m in mods])
    return packed
