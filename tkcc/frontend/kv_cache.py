"""Static KV cache for captured Hugging Face models: preallocated buffers written in place.

Why not transformers' own ``StaticCache`` layers unchanged: they keep a
``cumulative_length`` counter tensor per layer that each forward reads and
increments, i.e. hidden state besides the keys and values. Here the write
position is the graph input ``cache_position`` itself, so a step is a pure
function of (inputs, cache contents): the same inputs on the same cache give
the same logits, and any position can be (re)written or replayed. The
arithmetic is the one transformers' ``StaticLayer`` does: ``index_copy_`` of
the new keys/values at the given positions, attention over the whole
``max_cache_len`` with the causal mask hiding positions not yet written.

``KVCache`` (an ``nn.Module``) owns the tensors as buffers ``key_<i>`` and
``value_<i>`` of shape ``[batch, kv_heads, max_cache_len, head_dim]``; the
transformers-side ``Cache`` object only points at them. The captured graphs
read and write these buffers (``get_attr`` + ``index_copy_``): they are
``Program.state``.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticCache, StaticLayer


class KVCache(torch.nn.Module):
    """Per-layer key/value buffers ``key_<i>``, ``value_<i>``: [batch, kv_heads, max_cache_len, head_dim]."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        super().__init__()
        if len(keys) != len(values) or not keys:
            raise ValueError(f"KVCache needs one key and one value tensor per layer, got {len(keys)}/{len(values)}")
        for i, (k, v) in enumerate(zip(keys, values)):
            self.register_buffer(f"key_{i}", k, persistent=False)
            self.register_buffer(f"value_{i}", v, persistent=False)
        self.num_layers = len(keys)

    @classmethod
    def allocate(cls, num_layers: int, batch: int, kv_heads: int, max_cache_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (batch, kv_heads, max_cache_len, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])

    def first(self, k: int) -> "KVCache":
        """A KVCache over the first k layers' buffers (the same tensors: a truncated tier shares memory)."""
        return KVCache([self.key(i) for i in range(k)], [self.value(i) for i in range(k)])

    def key(self, i: int) -> torch.Tensor:
        return getattr(self, f"key_{i}")

    def value(self, i: int) -> torch.Tensor:
        return getattr(self, f"value_{i}")

    @property
    def max_cache_len(self) -> int:
        return self.key_0.shape[2]

    @property
    def batch(self) -> int:
        return self.key_0.shape[0]

    def reset(self) -> None:
        """Zero every key/value (the state a fresh request starts from)."""
        with torch.no_grad():
            for b in self.buffers():
                b.zero_()

    def fill_random(self, length: int, generator: torch.Generator | None = None, scale: float = 1.0) -> None:
        """Write N(0, scale) values at positions [0, length) of every layer, zeros after.

        For timing decode at context ``length`` without running a prefill: the
        values are not those a real prompt would produce, the amount of work is.
        """
        with torch.no_grad():
            for b in self.buffers():
                b.zero_()
                if length > 0:
                    view = b[:, :, :length]
                    view.copy_(torch.randn(view.shape, generator=generator, device=b.device, dtype=torch.float32)
                               .mul_(scale).to(b.dtype))


class PositionedLayer(StaticLayer):
    """A transformers ``StaticLayer`` whose write position is the step's ``cache_position`` input.

    ``keys``/``values`` point at ``KVCache`` buffers and ``position`` at the
    current ``cache_position``; ``StepModule.forward`` sets all three before
    every call (during export they are the traced tensors).
    """

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.position: torch.Tensor | None = None

    def bind(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers come from KVCache
        raise RuntimeError("PositionedLayer is bound to KVCache buffers; bind() it before use")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.position, key_states)
        self.values.index_copy_(2, self.position, value_states)
        return self.keys, self.values

    def get_seq_length(self):
        # Tokens before this step = the first position written (a 0-dim tensor, as StaticLayer returns).
        return self.position[0]


class PositionedCache(StaticCache):
    """A ``StaticCache`` made of ``PositionedLayer`` s over a ``KVCache``."""

    def __init__(self, kv: KVCache):  # noqa: D107 - StaticCache.__init__ needs a config; not used here
        layers = [PositionedLayer(kv.max_cache_len) for _ in range(kv.num_layers)]
        Cache.__init__(self, layers=layers)
        self.bind(kv, None)

    def bind(self, kv: KVCache, cache_position: torch.Tensor | None) -> None:
        for i, layer in enumerate(self.layers):
            layer.bind(kv.key(i), kv.value(i))
            layer.position = cache_position
