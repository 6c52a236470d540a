"""transformers' linear-attention cache layers (Mamba, gated DeltaNet, short convolutions) over tkcc's state.

transformers 5 keeps a hybrid model's non-attention layers in ``LinearAttentionLayer``
s: per state index ``i``, a convolution window ``conv_states[i]`` [batch, channels,
kernel] and a recurrent state ``recurrent_states[i]``. Modeling code reads them
through the ``Cache``'s linear-attention API (``has_previous_state``,
``update_conv_state``, ``update_recurrent_state``, ``layers[i].recurrent_states``),
the same in every family, so one layer class serves them all: ``LinearStateLayer``
is that API on tkcc's ``state_<layer>_conv_<i>`` / ``state_<layer>_recurrent_<i>``
buffers, read and written through the positioned cache's slots (``tkcc.frontend.kv_cache``).

Two choices make a step one graph for any position:

- every step *has* a previous state (zeros at position 0, read as such), so the
  model always takes its continuation path: the window it convolves is the
  cached one followed by the step's tokens, as transformers does after a first
  step;
- ``record_past`` is True, so a one-token step convolves through
  ``update_conv_state`` too instead of ``causal_conv1d_update``, which writes
  the window it was given in place (here, a value read from a slot, not the
  buffer). tkcc's ``update_conv_state`` still keeps the last ``kernel`` columns
  only: nothing is recorded past them.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from tkcc.frontend.hf_cache import StateLayer
from tkcc.frontend.kv_cache import LayerState

CACHE_LAYER = "linear_attention"


def is_linear_layer(layer) -> bool:
    """A cache layer of transformers' plain linear-attention kind (not one that keeps keys and values too)."""
    return type(layer) is LinearAttentionLayer


def layer_state(layer) -> LayerState:
    """The ``LayerState`` of a ``LinearAttentionLayer`` after a probe step: its conv windows and recurrent states
    (without the batch dim), each in its own dtype; ``none`` where it kept neither."""
    tensors = {}
    for i in range(layer.number_of_states):
        for kind, held in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            t = held.get(i)
            if isinstance(t, torch.Tensor):
                tensors[f"{kind}_{i}"] = t
    if not tensors:  # a layer the family keeps a linear-attention slot for, but whose block keeps nothing (an MLP)
        return LayerState("none")
    first = next(iter(tensors.values()))
    return LayerState("recurrent", dtype=first.dtype, states=tuple((n, tuple(t.shape[1:])) for n, t in tensors.items()),
                      state_dtypes=tuple((n, t.dtype) for n, t in tensors.items() if t.dtype != first.dtype),
                      cache_layer=CACHE_LAYER)


class LinearStateLayer(StateLayer, LinearAttentionCacheLayerMixin):
    """``LinearAttentionLayer``'s API over the slots of a ``PositionedCache`` (see the module docstring).

    ``states`` are the layer's buffers (bound by the cache before each step); reads and writes go through the
    cache, which knows the step's positions."""

    keeps = "a linear-attention state only"

    def __init__(self, index: int, cache, names: list[str]):
        # not LinearAttentionCacheLayerMixin.__init__: its state dicts are properties here
        StateLayer.__init__(self, index)
        self._cache = cache
        ids = sorted({int(n.rsplit("_", 1)[1]) for n in names})
        self.number_of_states = len(ids)
        self._names = set(names)
        self.has_previous_state = dict.fromkeys(ids, True)
        self.is_conv_states_initialized = {i: f"conv_{i}" in self._names for i in ids}
        self.is_recurrent_states_initialized = {i: f"recurrent_{i}" in self._names for i in ids}
        self.conv_kernel_size = {i: None for i in ids}
        self.record_past = True
        self.device = self.dtype = None
        self.begin()

    def begin(self) -> None:
        """A step starts: nothing read or written yet."""
        self._read_states: dict[str, torch.Tensor] = {}
        self._written: set[str] = set()

    def finish(self) -> None:
        """A step ends: a state the model read but did not hand back through ``update_*_state`` is written as it is
        now, since Mamba's one-token update (``selective_state_update``) changes the tensor it was given in place,
        and a state the step left alone must be in the slot the next step reads too."""
        for name, t in self._read_states.items():
            if name not in self._written:
                self._cache.write_state(self.index, name, t)
        self.begin()

    def _get(self, name: str) -> torch.Tensor:
        """State ``name`` as this step started, one tensor per step (in-place changes to it are seen by ``finish``)."""
        if name not in self._read_states:
            self._read_states[name] = self._cache.recurrent_state(self.index, name)
        return self._read_states[name]

    def _read(self, kind: str) -> dict[int, torch.Tensor | None]:
        return {i: (self._get(f"{kind}_{i}") if f"{kind}_{i}" in self._names else None) for i in self.has_previous_state}

    @property
    def conv_states(self) -> dict[int, torch.Tensor | None]:
        return self._read("conv")

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor | None]:
        return self._read("recurrent")

    def lazy_initialization(self, *args, **kwargs) -> None:  # the buffers come from KVCache
        raise RuntimeError("LinearStateLayer is bound to KVCache buffers; it is never initialised lazily")

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """The cached window followed by the step's columns (what the model convolves); the last ``kernel``
        columns of it become the cached window."""
        name = f"conv_{state_idx}"
        window = self._get(name)
        full = torch.cat([window.to(conv_states.dtype), conv_states], dim=-1)
        self._cache.write_state(self.index, name, full[..., -window.shape[-1]:])
        self._written.add(name)
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        name = f"recurrent_{state_idx}"
        self._cache.write_state(self.index, name, recurrent_states)
        self._written.add(name)
        return recurrent_states
