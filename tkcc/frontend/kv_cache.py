"""``Program.state`` of a causal LM: what every decoder layer keeps between steps, as preallocated buffers.

Why not transformers' own ``StaticCache`` layers unchanged: they keep a
``cumulative_length`` counter tensor per layer that each forward reads and
increments, i.e. hidden state besides the keys and values. Here the write
position is the graph input ``cache_position`` itself, so a step is a pure
function of (inputs, state contents): the same inputs on the same state give
the same logits, and any position can be (re)written or replayed.

A layer keeps one of (``LayerState.kind``):

- ``attention``: buffers ``key_<i>`` [batch, key heads, max_cache_len, key dim]
  and ``value_<i>`` [batch, value heads, max_cache_len, value dim]. Keys and
  values may differ in shape (MLA keeps its compressed latent as the "key" and
  the shared rotary key as the "value"), and so may layers. A sliding-window
  layer has the same full-length buffers; the attention mask hides what lies
  outside its window, so any context up to ``max_cache_len`` is exact. A sparse-attention layer (DeepSeek
  V3.2's DSA) also keeps its indexer's keys, ``indexer_<i>`` [batch, max_cache_len, dim], written at the step's
  positions as keys and values are.
- ``recurrent``: buffers ``state_<i>_<name>`` [2, batch, ...] (a linear-attention
  layer's running ``K^T V``, a convolution's last ``kernel`` inputs; each in its
  own dtype where ``LayerState.state_dtypes`` says so): slot ``p % 2`` holds the
  state after p tokens.
  A step from position p reads slot ``p % 2`` and writes slot ``(p + T) % 2``
  in place, so a decode step read one slot and wrote the other: replayed, it
  reads what it read the first time and gives the same logits, as a step over
  keys and values does (the engine times and checks a step by replaying it). A
  step at position 0 reads zeros (a fresh sequence), whatever the slot holds.
  Only a prefill that continues a sequence by an even number of tokens
  overwrites the slot it read (run once in order, as generation does, it is
  exact; replayed, it is not).
- ``none``: nothing.

The layout comes from the model itself (``tkcc.frontend.hf_cache.probe_layout``
runs one step with the model's own cache and reads what each layer kept).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tkcc.errors import TkccError

KINDS = ("attention", "recurrent", "none")


@dataclass(frozen=True)
class LayerState:
    """What one decoder layer keeps: shapes without the batch (and, for keys/values, the position) dim."""

    kind: str
    dtype: torch.dtype | None = None
    key: tuple[int, int] | None = None      # (heads, dim) per position
    value: tuple[int, int] | None = None
    window: int | None = None               # sliding-window attention: positions a query sees
    indexer: int | None = None              # sparse attention (DeepSeek V3.2's DSA): its indexer's key dim per position
    states: tuple[tuple[str, tuple[int, ...]], ...] = ()  # recurrent: (name, shape) of each state tensor
    state_dtypes: tuple[tuple[str, torch.dtype], ...] = ()  # recurrent: a state whose dtype is not ``dtype``
    cache_layer: str | None = None  # recurrent: "linear_attention" where the model reads it through transformers'
    # linear-attention cache layer API (``tkcc.frontend.hf_linear_state``)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"LayerState kind {self.kind!r}: one of {KINDS}")

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype of recurrent state ``name`` (a gated-delta layer keeps its conv window in the model's dtype and
        its state in float32, as transformers does)."""
        return dict(self.state_dtypes).get(name, self.dtype)

    def describe(self) -> dict:
        """JSON-ready (``Program.meta["state_layout"]``)."""
        d = {"kind": self.kind, "dtype": str(self.dtype).replace("torch.", "") if self.dtype else None}
        if self.kind == "attention":
            d.update(key=list(self.key), value=list(self.value), window=self.window)
            if self.indexer:
                d["indexer"] = self.indexer
        elif self.kind == "recurrent":
            d["states"] = {n: list(s) for n, s in self.states}
            if self.state_dtypes:
                d["state_dtypes"] = {n: str(t).replace("torch.", "") for n, t in self.state_dtypes}
        return d


def state_bytes(layout: list[LayerState], context: int, batch: int = 1) -> int:
    """Bytes of state one decode step at ``context`` must move: the keys and values of the positions it
    attends to (``min(context, window)`` for a sliding-window layer), and each recurrent state read and
    written once (one slot each). The KV term is the one BENCH.md's floor has always counted (2 x kv heads x head dim x
    context x 2 bytes per layer in bf16)."""
    total = 0
    for ls in layout:
        size = ls.dtype.itemsize if ls.dtype is not None else 0
        if ls.kind == "attention":
            seen = min(context, ls.window) if ls.window else context
            total += batch * seen * (ls.key[0] * ls.key[1] + ls.value[0] * ls.value[1] + (ls.indexer or 0)) * size
        elif ls.kind == "recurrent":
            total += 2 * batch * sum(_numel(s) * ls.dtype_of(n).itemsize for n, s in ls.states)
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class KVCache(torch.nn.Module):
    """Every layer's state as buffers (see the module docstring); ``layout[i]`` says what layer i keeps.

    ``cache_api`` names the model's own transformers cache class when the model calls methods of it
    beyond ``Cache``'s (MiniMax's ``get_linear_cache``); ``tkcc.frontend.hf_cache`` offers them.
    """

    def __init__(self, layout: list[LayerState], tensors: dict[str, torch.Tensor], max_cache_len: int,
                 batch: int, cache_api: str | None = None):
        super().__init__()
        if not layout:
            raise ValueError("KVCache needs at least one layer")
        for name, t in tensors.items():
            self.register_buffer(name, t, persistent=False)
        self.layout = list(layout)
        self.num_layers = len(layout)
        self._max_cache_len, self._batch = int(max_cache_len), int(batch)
        self.cache_api = cache_api

    @classmethod
    def allocate(cls, layout: list[LayerState], batch: int, max_cache_len: int, device: torch.device,
                 cache_api: str | None = None) -> "KVCache":
        """Zero-filled buffers for ``layout`` (the state of a fresh sequence)."""
        tensors = {}
        for i, ls in enumerate(layout):
            if ls.kind == "attention":
                tensors[f"key_{i}"] = torch.zeros((batch, ls.key[0], max_cache_len, ls.key[1]), dtype=ls.dtype,
                                                  device=device)
                tensors[f"value_{i}"] = torch.zeros((batch, ls.value[0], max_cache_len, ls.value[1]),
                                                    dtype=ls.dtype, device=device)
                if ls.indexer:
                    tensors[f"indexer_{i}"] = torch.zeros((batch, max_cache_len, ls.indexer), dtype=ls.dtype,
                                                          device=device)
            elif ls.kind == "recurrent":
                for name, shape in ls.states:
                    tensors[f"state_{i}_{name}"] = torch.zeros((2, batch, *shape), dtype=ls.dtype_of(name),
                                                               device=device)
        return cls(layout, tensors, max_cache_len, batch, cache_api)

    @classmethod
    def of_tensors(cls, keys: list[torch.Tensor], values: list[torch.Tensor]) -> "KVCache":
        """A cache of attention layers over existing [B, H, S, D] key and value tensors (shared, not copied)."""
        layout = [LayerState("attention", dtype=k.dtype, key=(k.shape[1], k.shape[3]), value=(v.shape[1], v.shape[3]))
                  for k, v in zip(keys, values)]
        tensors = {**{f"key_{i}": k for i, k in enumerate(keys)}, **{f"value_{i}": v for i, v in enumerate(values)}}
        return cls(layout, tensors, keys[0].shape[2], keys[0].shape[0])

    def first(self, k: int) -> "KVCache":
        """A KVCache over the first k layers' buffers (the same tensors: a truncated tier shares memory)."""
        keep = {n: b for n, b in self.named_buffers() if int(n.split("_")[1]) < k}
        return KVCache(self.layout[:k], keep, self._max_cache_len, self._batch, self.cache_api)

    def kind(self, i: int) -> str:
        return self.layout[i].kind

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, ls in enumerate(self.layout) if ls.kind == "attention"]

    def key(self, i: int) -> torch.Tensor:
        self._need(i, "attention", "keys")
        return getattr(self, f"key_{i}")

    def value(self, i: int) -> torch.Tensor:
        self._need(i, "attention", "values")
        return getattr(self, f"value_{i}")

    def indexer(self, i: int) -> torch.Tensor | None:
        """Layer i's sparse-attention indexer keys [B, max_cache_len, dim], or None where it keeps none."""
        self._need(i, "attention", "indexer keys")
        return getattr(self, f"indexer_{i}", None)

    def state(self, i: int, name: str) -> torch.Tensor:
        self._need(i, "recurrent", f"a recurrent state {name!r}")
        try:
            return getattr(self, f"state_{i}_{name}")
        except AttributeError:
            have = [n for n, _s in self.layout[i].states]
            raise TkccError(f"layer {i} keeps the recurrent state(s) {have}, not {name!r}") from None

    def _need(self, i: int, kind: str, what: str) -> None:
        if not 0 <= i < self.num_layers:
            raise TkccError(f"layer {i} is outside this cache's {self.num_layers} layers")
        if self.layout[i].kind != kind:
            raise TkccError(f"layer {i} keeps {self.layout[i].kind} state, not {what}")

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    @property
    def batch(self) -> int:
        return self._batch

    def decode_bytes(self, context: int) -> int:
        """Bytes of state one decode step at ``context`` moves (``state_bytes``)."""
        return state_bytes(self.layout, context, self._batch)

    def reset(self) -> None:
        """Zero every buffer (the state a fresh request starts from)."""
        with torch.no_grad():
            for b in self.buffers():
                b.zero_()

    def fill_random(self, length: int, generator: torch.Generator | None = None, scale: float = 1.0) -> None:
        """N(0, scale) keys/values at positions [0, length) of every attention layer, zeros after; every
        recurrent state N(0, scale) when ``length > 0`` (zeros at 0).

        For timing decode at context ``length`` without running a prefill: the
        values are not those a real prompt would produce, the amount of work is.
        """
        with torch.no_grad():
            for name, b in self.named_buffers():
                b.zero_()
                if length <= 0:
                    continue
                view = b if name.startswith("state_") else b[:, :, :length]
                view.copy_(torch.randn(view.shape, generator=generator, device=b.device, dtype=torch.float32)
                           .mul_(scale).to(b.dtype))
