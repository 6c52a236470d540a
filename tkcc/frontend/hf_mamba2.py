"""Mamba2's chunked scan (Nemotron-H, Bamba, GraniteMoeHybrid, Falcon-H1, Zamba2, Mamba2) for a step of any length.

transformers' ``mamba2_chunk_scan`` pads a step to a multiple of the layer's
``chunk_size`` and scans every chunk at once. For a symbolic ``T`` the padding
and the chunk count are guards torch.export cannot prove over the whole range
(``(T + pad) // chunk == 1`` for one chunk, ...), so the step is not one graph.
With ``chunk_size = T`` the padding is zero and there is one chunk, for any T:
``one_chunk`` calls transformers' own torch function that way. Its memory grows
as ``T^2`` per head, so such a model's prompts go in steps of the layer's own
``chunk_size`` (``prefill_chunk``), each continuing from the state the last one
left: transformers' chunks, scanned one step each.
"""
from __future__ import annotations

import inspect
from typing import Callable


def one_chunk(own: Callable) -> Callable:
    """``mamba2_chunk_scan`` over one chunk of the whole step, through transformers' torch path (not a hub or
    mamba_ssm kernel: the eager step must be the exported one)."""
    torch_path = inspect.unwrap(own)

    def scan(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs):
        return torch_path(hidden_states, dt, A, B, C, hidden_states.shape[1], *args, **kwargs)

    return scan


def prefill_chunk(module) -> int | None:
    """A Mamba2 mixer's own chunk (None for the other modules of its file)."""
    chunk = getattr(module, "chunk_size", None)
    return int(chunk) if isinstance(chunk, int) and chunk > 0 else None
