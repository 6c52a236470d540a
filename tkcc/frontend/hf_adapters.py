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
- ``FUNCTION_OVERRIDES``: the same for a module-level function of a modeling
  file (transformers' chunked gated delta rule, Mamba2's chunked scan),
  replaced in that file's namespace for the duration of a step, then put back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tkcc.frontend import hf_gated_delta, hf_mamba2, hf_minimax


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

# function name -> (the modeling file's own function -> its replacement during a step)
FUNCTION_OVERRIDES: dict[str, Callable[[Callable], Callable]] = {
    "torch_chunk_gated_delta_rule": lambda own: hf_gated_delta.chunk_gated_delta_rule,
    "mamba2_chunk_scan": hf_mamba2.one_chunk,
}
# Prompt tokens per prefill step a module whose modeling file defines the function takes (None: that module does not
# say): each override's memory grows with the square of a step's tokens.
PREFILL_CHUNKS: dict[str, Callable[[object], int | None]] = {
    "torch_chunk_gated_delta_rule": lambda module: hf_gated_delta.PREFILL_CHUNK,
    "mamba2_chunk_scan": hf_mamba2.prefill_chunk,
}


def module_forwards(model) -> list[tuple[object, Callable]]:
    """(module, registered forward) for every module of ``model`` whose class has one."""
    return [(m, MODULE_FORWARDS[type(m).__name__]) for m in model.modules() if type(m).__name__ in MODULE_FORWARDS]


def function_overrides(model) -> list[tuple[type, str, Callable]]:
    """(module class, function name, its override's maker) for every registered function that the forward of a module of
    ``model`` resolves by name, one class per modeling file. A class, not its namespace: a deep copy of the step
    (which copies a dict it holds) must still patch the globals the forward reads (``forward_globals``)."""
    classes = {}
    for m in model.modules():
        ns = forward_globals(type(m))
        if any(name in ns for name in FUNCTION_OVERRIDES):
            classes.setdefault(id(ns), type(m))
    return [(cls, name, fn) for cls in classes.values() for name, fn in FUNCTION_OVERRIDES.items()
            if name in forward_globals(cls)]


def forward_globals(cls: type) -> dict:
    """The globals a module class's forward resolves names in: its modeling file's, under any decorator."""
    import inspect

    return getattr(inspect.unwrap(cls.forward), "__globals__", {})


def prefill_chunk(model) -> int | None:
    """The fewest prompt tokens per prefill step any registered function of ``model``'s modeling files needs."""
    chunks = []
    for m in model.modules():
        ns = forward_globals(type(m))
        chunks += [PREFILL_CHUNKS[name](m) for name in FUNCTION_OVERRIDES if name in ns]
    chunks = [c for c in chunks if c]
    return min(chunks) if chunks else None
