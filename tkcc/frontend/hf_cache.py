"""The transformers side of ``Program.state``: what a model keeps per layer, and the Cache its steps run on.

``probe_layout`` runs one eager step of one token with the model's *own*
cache (the one ``generate`` would build) and reads, per layer, what that
cache kept: keys and values and their shapes (which may differ per layer and
between keys and values, as MLA's latent does), a sliding window, or a
recurrent state. Nothing is assumed from config field names, so a family
whose layers keep something else is refused here, by name, before export.

``PositionedCache`` is the ``Cache`` the captured steps run on: each layer
points at the ``KVCache`` buffers of the step being traced; keys and values
are written at ``cache_position`` (``index_copy_``), recurrent states in
place too (``index_copy_`` into the slot of the step's end). Where a family's
modeling code calls its own cache class's methods (MiniMax's
``get_linear_cache``), the cache also is an instance of that class with those
methods on tkcc's buffers (``tkcc.frontend.hf_adapters``).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicIndexedLayer, DynamicLayer, \
    DynamicSlidingWindowLayer, StaticCache, StaticLayer

from tkcc.errors import CaptureError
from tkcc.frontend.kv_cache import KVCache, LayerState

_WHERE = "tkcc.frontend.hf_cache.probe_layout"
SUPPORTED = ("decoder layers that keep attention keys and values (any shape per layer and per tensor, sliding "
             "windows), the states of transformers' LinearAttentionLayer, or the recurrent state of a cache class in "
             "tkcc.frontend.hf_adapters.CACHE_APIS")


def refuse(model, reason: str, where: str = _WHERE) -> CaptureError:
    """The CaptureError of a model tkcc cannot capture: tkcc's frame first, then the reason."""
    cfg = model.config.get_text_config()
    return CaptureError(f"{where}: cannot capture {type(model).__name__} (model_type "
                        f"{getattr(cfg, 'model_type', '?')!r}): {reason}")


def probe_layout(model, batch: int) -> tuple[list[LayerState], str | None]:
    """(what each decoder layer keeps, the name of the model's own cache class when tkcc must offer its API).

    Runs the model once, eagerly, on ``batch`` rows of one token."""
    from tkcc.frontend.hf_adapters import CACHE_APIS
    from tkcc.frontend.hf_linear_state import is_linear_layer, layer_state

    cfg = model.config.get_text_config()
    param = next(model.parameters())
    ids = torch.zeros((batch, 1), dtype=torch.long, device=param.device)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
    except Exception as exc:  # noqa: BLE001 - the model's own failure, reported with tkcc's frame
        raise refuse(model, f"one eager step of one token with the model's own cache failed: "
                            f"{type(exc).__name__}: {_first_line(exc)}") from exc
    cache = getattr(out, "past_key_values", None)
    if not isinstance(cache, Cache):
        raise refuse(model, f"its forward returned no transformers Cache (got {type(cache).__name__}); tkcc "
                            f"captures {SUPPORTED}")
    own = type(cache)
    api = None
    if own not in (DynamicCache, StaticCache):
        if own.__name__ not in CACHE_APIS:
            raise refuse(model, f"its modeling code uses its own cache class {own.__module__}.{own.__qualname__}, "
                                f"whose methods tkcc does not offer; tkcc captures {SUPPORTED} "
                                f"({', '.join(sorted(CACHE_APIS))})")
        api = own.__name__
    layout = []
    for i in range(cfg.num_hidden_layers):
        states = CACHE_APIS[api].read_states(cache, i) if api else {}
        layer = cache.layers[i] if i < len(cache.layers) else None
        if states:
            t0 = next(iter(states.values()))
            layout.append(LayerState("recurrent", dtype=t0.dtype,
                                     states=tuple((n, tuple(t.shape[1:])) for n, t in states.items())))
        elif layer is None or (type(layer) is DynamicLayer and not layer.is_initialized):
            layout.append(LayerState("none"))
        elif is_linear_layer(layer):
            layout.append(layer_state(layer))
        elif type(layer) in (DynamicLayer, DynamicSlidingWindowLayer, DynamicIndexedLayer):
            k, v = layer.keys, layer.values
            if k.dim() != 4 or v.dim() != 4 or k.shape[2] != 1 or k.shape[0] != batch:
                raise refuse(model, f"layer {i} cached keys {tuple(k.shape)} / values {tuple(v.shape)} for one "
                                    f"token of a batch of {batch}; tkcc expects [batch, heads, 1, dim]")
            window = int(layer.sliding_window) if getattr(layer, "is_sliding", False) else None
            idx = getattr(layer, "indexer_keys", None)
            if idx is not None and (idx.dim() != 3 or tuple(idx.shape[:2]) != (batch, 1)):
                raise refuse(model, f"layer {i} cached indexer keys {tuple(idx.shape)} for one token of a batch of "
                                    f"{batch}; tkcc expects [batch, 1, dim]")
            layout.append(LayerState("attention", dtype=k.dtype, key=(k.shape[1], k.shape[3]),
                                     value=(v.shape[1], v.shape[3]), window=window,
                                     indexer=int(idx.shape[2]) if idx is not None else None))
        else:
            kinds = getattr(cfg, "layer_types", None)
            kind = f" ({kinds[i]})" if isinstance(kinds, list) and i < len(kinds) else ""
            raise refuse(model, f"layer {i}{kind} keeps a {type(layer).__module__}.{type(layer).__qualname__} "
                                f"({_tensors(layer)}) in its cache; tkcc captures {SUPPORTED} "
                                f"({', '.join(sorted(CACHE_APIS))})")
    if not any(ls.kind != "none" for ls in layout):
        raise refuse(model, "no decoder layer kept any state after a step; nothing to cache")
    return layout, api


def _tensors(layer) -> str:
    """'name shape, ...' of the tensors a cache layer holds (directly or in a dict), for an error message."""
    out = []
    for name, val in vars(layer).items():
        items = val.items() if isinstance(val, dict) else [(None, val)]
        for key, t in items:
            if isinstance(t, torch.Tensor):
                out.append(f"{name}{'' if key is None else f'[{key}]'} {tuple(t.shape)}")
    return ", ".join(out) or "no tensors"


def _first_line(exc: BaseException) -> str:
    s = str(exc).strip()
    return s.splitlines()[0] if s else ""


class PositionedLayer(StaticLayer):
    """A transformers ``StaticLayer`` whose write position is the step's ``cache_position`` input.

    ``keys``/``values`` point at ``KVCache`` buffers and ``position`` at the
    current ``cache_position``; ``StepModule.forward`` sets all three before
    every call (during export they are the traced tensors).
    """

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.position: torch.Tensor | None = None
        self.indexer_keys: torch.Tensor | None = None

    def bind(self, keys: torch.Tensor, values: torch.Tensor, indexer_keys: torch.Tensor | None = None) -> None:
        self.keys, self.values, self.indexer_keys = keys, values, indexer_keys
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

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """A sparse-attention layer's indexer keys [B, T, dim] written at the step's positions; the whole buffer
        back (positions past the step are masked by the indexer's mask, as transformers' StaticIndexedLayer)."""
        if self.indexer_keys is None:
            raise CaptureError("tkcc.frontend.hf_cache.PositionedLayer.update_indexer: this layer wrote indexer keys, "
                               "but the probe step saw it keep none (its cache layout differs between steps)")
        self.indexer_keys.index_copy_(1, self.position, indexer_key_states)
        return self.indexer_keys


class StateLayer:
    """A layer without keys and values in the positioned cache: its recurrent states (maybe none)."""

    is_compileable = True
    is_sliding = False
    supports_early_init = False
    is_initialized = True
    keeps = "none"  # what the probe step saw the layer keep, for update's error

    def __init__(self, index: int):
        self.index = index
        self.states: dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        """A step starts (the cache bound ``states`` to this step's buffers)."""

    def finish(self) -> None:
        """The step's forward returned."""

    def update(self, key_states, value_states, *args, **kwargs):
        raise CaptureError(f"{type(self).__module__}.{type(self).__qualname__}.update: layer {self.index} wrote keys "
                           f"and values, but the probe step saw it keep {self.keeps} (its cache layout differs "
                           "between steps)")

    def reset(self) -> None:
        for t in self.states.values():
            t.zero_()


class PositionedCache(StaticCache):
    """A ``StaticCache`` over a ``KVCache``: ``PositionedLayer`` s for attention layers, ``LinearStateLayer`` s for
    transformers' linear-attention layers, ``StateLayer`` s else."""

    def __init__(self, kv: KVCache):  # noqa: D107 - StaticCache.__init__ needs a config; not used here
        from tkcc.frontend.hf_linear_state import CACHE_LAYER, LinearStateLayer

        def layer(i: int, ls: LayerState):
            if ls.kind == "attention":
                return PositionedLayer(kv.max_cache_len)
            if ls.cache_layer == CACHE_LAYER:
                return LinearStateLayer(i, self, [n for n, _s in ls.states])
            return StateLayer(i)

        layers = [layer(i, ls) for i, ls in enumerate(kv.layout)]
        Cache.__init__(self, layers=layers)
        self.max_len = kv.max_cache_len
        self.position: torch.Tensor | None = None
        self.bind(kv, None)

    def bind(self, kv: KVCache, cache_position: torch.Tensor | None) -> None:
        self.position = cache_position
        for i, layer in enumerate(self.layers):
            if isinstance(layer, PositionedLayer):
                layer.bind(kv.key(i), kv.value(i), kv.indexer(i))
                layer.position = cache_position
            else:  # a StateLayer
                layer.states = {n: kv.state(i, n) for n, _s in kv.layout[i].states}
                layer.begin()

    def __len__(self) -> int:
        return len(self.layers)

    def finish(self) -> None:
        """The step's forward returned: each linear-attention layer writes what it read and changed in place."""
        for layer in self.layers:
            if isinstance(layer, StateLayer):
                layer.finish()

    # Every layer sees the same positions: the step's, over the whole max_cache_len (masked past the step).
    def get_seq_length(self, layer_idx: int = 0):
        return self.position[0]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.max_len, 0

    def recurrent_state(self, layer_idx: int, name: str) -> torch.Tensor | None:
        """Layer ``layer_idx``'s state ``name`` as this step starts (None for a layer without such a state).

        The state after p tokens is in slot ``p % 2`` of the buffer (``tkcc.frontend.kv_cache``). A step at
        position 0 starts a sequence: it reads zeros, whatever the buffer holds, so a fresh prompt depends on
        its inputs only, as with keys and values (slots at or after the step's are masked)."""
        buf = self._state_buffer(layer_idx, name)
        if buf is None:
            return None
        start = self.position[0]
        slot = buf.index_select(0, (start % 2).reshape(1))[0]
        return torch.where(start > 0, slot, torch.zeros((), dtype=buf.dtype, device=buf.device))

    def write_state(self, layer_idx: int, name: str, value: torch.Tensor) -> torch.Tensor:
        """Write layer ``layer_idx``'s state ``name`` after this step, in place: slot ``end % 2`` (end = the
        step's last position + 1), so a decode step read slot ``p % 2`` and wrote the other one: replaying
        it reads what it read the first time."""
        buf = self._state_buffer(layer_idx, name)
        if buf is None:
            raise CaptureError(f"tkcc.frontend.hf_cache.PositionedCache.write_state: layer {layer_idx} keeps no "
                               f"recurrent state {name!r} (the probe step saw none)")
        end = (self.position[-1] + 1) % 2
        buf.index_copy_(0, end.reshape(1), value.unsqueeze(0).to(buf.dtype))
        return buf

    def _state_buffer(self, layer_idx: int, name: str) -> torch.Tensor | None:
        layer = self.layers[layer_idx]
        return layer.states.get(name) if isinstance(layer, StateLayer) else None


_CLASSES: dict[str, type] = {}


def positioned_cache(kv: KVCache) -> PositionedCache:
    """A ``PositionedCache`` over ``kv``; an instance of the model's own cache class too where ``kv.cache_api``
    names one (its modeling code checks ``isinstance`` and calls that class's methods)."""
    if kv.cache_api is None:
        return PositionedCache(kv)
    if kv.cache_api not in _CLASSES:
        from tkcc.frontend.hf_adapters import CACHE_APIS

        api = CACHE_APIS[kv.cache_api]
        _CLASSES[kv.cache_api] = type(f"Positioned{kv.cache_api}", (api.methods, PositionedCache, api.base()), {})
    return _CLASSES[kv.cache_api](kv)
