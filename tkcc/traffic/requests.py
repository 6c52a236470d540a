"""Per-request token counts as an engine serves them: clipped to the model's context window.

One rule, used by both the Workload builder and the request-by-request
metrics, so the two agree on what was served: a prompt keeps at most
``max_context - 1`` tokens (the last ones: a server truncates from the left)
and generation stops when the KV cache is full, so output <= max_context -
input. A prompt of 0 tokens counts as 1 (there is always a first token).
Every changed request is counted; nothing is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tkcc.errors import TkccError


@dataclass
class Requests:
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    clipped: int = 0           # requests whose input or output was cut
    clipped_input: int = 0     # requests whose prompt was cut
    max_context: int | None = None

    def __len__(self) -> int:
        return int(self.input_tokens.shape[0])


def clip_requests(input_tokens, output_tokens, max_context: int | None, on_overflow: str = "clip",
                  source: str = "") -> Requests:
    """Clip to the context window (``on_overflow="clip"``) or refuse (``"error"``) with a count and an example."""
    L = np.maximum(np.asarray(input_tokens, dtype=np.int64), 1)
    O = np.asarray(output_tokens, dtype=np.int64).copy()
    if max_context is None:
        return Requests(L, O)
    if max_context < 2:
        raise TkccError(f"max_context must be >= 2, got {max_context}")
    over = (L + O) > max_context
    n_over = int(over.sum())
    if n_over and on_overflow == "error":
        i = int(np.nonzero(over)[0][0])
        raise TkccError(f"{source or 'trace'}: {n_over} of {L.size} requests exceed max_context={max_context} "
                        f"(first: request {i} with {L[i]} input + {O[i]} output tokens); "
                        f"use on_overflow='clip' or a model with a longer context")
    if on_overflow not in ("clip", "error"):
        raise TkccError(f"on_overflow must be 'clip' or 'error', got {on_overflow!r}")
    cut_in = L > max_context - 1
    L2 = np.minimum(L, max_context - 1)
    O2 = np.minimum(O, max_context - L2)
    return Requests(L2, O2, clipped=n_over, clipped_input=int(cut_in.sum()), max_context=max_context)
