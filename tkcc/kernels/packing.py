"""Packed weights, the reading side: whether weights are row blocks of one buffer, and that buffer as a view.

Capture packs each decoder layer's q/k/v and gate/up weights into one buffer
(``tkcc.frontend.weight_packing``, before any graph holds a weight pointer);
the fused kernels then read them in place through ``packed_view``. This half
lives in the kernel library so the kernels need nothing of the frontend.
"""
from __future__ import annotations

import torch


def is_packed(weights: list[torch.Tensor]) -> bool:
    """Whether ``weights`` are consecutive row blocks of one contiguous 2-D buffer starting at its offset 0."""
    base = weights[0]
    if base.dim() != 2 or base.storage_offset() != 0 or not all(w.is_contiguous() for w in weights):
        return False
    ptr = base.untyped_storage().data_ptr()
    off = 0
    for w in weights:
        if w.untyped_storage().data_ptr() != ptr or w.storage_offset() != off or w.shape[1] != base.shape[1]:
            return False
        off += w.numel()
    return True


def packed_view(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The [sum of rows, cols] matrix that packed ``weights`` form, as a view (None when not packed)."""
    if not is_packed(weights):
        return None
    base = weights[0]
    return torch.as_strided(base, (sum(w.shape[0] for w in weights), base.shape[1]), base.stride(), 0)
