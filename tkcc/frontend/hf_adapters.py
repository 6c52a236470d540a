"""Per-family pieces the capture of Hugging Face models needs, registered by the transformers class they serve.

Capture is generic (``tkcc.frontend.hf``): the model's own code runs on
fake tensors over tkcc's cache. Two things cannot be generic, and live here:

- ``CACHE_APIS``: a modeling file that builds and calls its *own* cache class
  (``isinstance`` checks, methods beyond ``Cache``'s). Each entry says how to
  read that class's per-layer states after a probe step, and gives the same
  methods on tkcc's state buffers. A model whose own cache class is not here
  is refused by name (``tkcc.frontend.hf_cache.probe_layout``).
- ``MODULE_FORWARDS``: a module whose forward cannot be one graph for every
  prompt length (a Python loop over the tokens), run while a step is traced or
  called as this registered forward instead: the same function, written
  without the loop. The model object itself is never changed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tkcc.frontend import hf_minimax


@dataclass(frozen=True)
class CacheAPI:
    """A model's own cache class, as tkcc offers it."""

    base: Callable[[], type]                # the class itself (imported on use)
    methods: type                           # mixin: its methods over ``PositionedCache``'s buffers
    read_states: Callable[[object, int], dict]  # (the model's own cache after a step, layer) -> {name: tensor}


CACHE_APIS: dict[str, CacheAPI] = {
    "MiniMaxCache": CacheAPI(hf_minimax.cache_class, hf_minimax.LinearCacheMethods, hf_minimax.read_states),
}

MODULE_FORWARDS: dict[str, Callable] = {
    "MiniMaxLightningAttention": hf_minimax.lightning_forward,
}


def module_forwards(model) -> list[tuple[object, Callable]]:
    """(module, registered forward) for every module of ``model`` whose class has one."""
    return [(m, MODULE_FORWARDS[type(m).__name__]) for m in model.modules() if type(m).__name__ in MODULE_FORWARDS]
