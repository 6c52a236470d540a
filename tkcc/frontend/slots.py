"""A causal LM captured for B slots: B sequences decoded together, each at its own position (continuous batching).

Why a phase of its own: the batch-B ``decode`` graph (``tkcc.frontend.hf``)
takes one ``cache_position`` for every row, so rows of different requests
(different lengths) cannot advance independently, and its ``prefill`` writes
every row. A Program captured with ``capture_slots(model, B)`` has three phases:

- ``prefill`` and ``decode``: exactly the batch-1 graphs (input_ids [1, T],
  cache_position [T]), over a *staging* row of the KV cache. Golden checks,
  the engine and ``greedy_steps`` drive them as they drive any batch-1 Program.
- ``decode_slots``: input_ids [B, 1] and ``slot_positions`` [B] (int64) ->
  logits [B, 1, vocab]. Row b writes its key/value at ``slot_positions[b]``
  of slot b's cache row and attends over that row's positions
  ``<= slot_positions[b]`` (RoPE at that position); nothing of one row reaches
  another.

A request enters slot b by a prefill on the staging row, then
``SlotCache.admit(b, P)`` copies the staging row's first P positions into
slot b's row (one copy per layer; the prefill itself is the batch-1 one). The
next request's prefill can then run while slot b decodes. Positions at and past
a slot's length hold stale values of an earlier occupant; the mask hides them
until the slot's own decode step overwrites each one before reading it, as in
the batch-1 cache.

The KV cache of layer i is one tensor per key and value, [B + 1, kv_heads,
max_cache_len, head_dim]: rows 0..B-1 are the slots, row B is the staging row.
``Program.state`` is a ``SlotCache``: its own buffers ``key_<i>``/``value_<i>``
are the staging row (the names and shapes of a batch-1 KVCache, so the batch-1
graphs bind as usual), and its submodule ``slots`` holds the B slot rows that
``decode_slots`` reads and writes (``slots.key_<i>``).

The input is named ``slot_positions``, not ``cache_position``: passes and
kernels that assume one position for the whole step (split-KV decode
attention, the lowered batch-1 step) key on that name and leave this graph alone.

Bitwise: a row's logits depend only on that row's token, position and cache row,
not on the other rows' contents nor on the slot index (a GEMM computes each
output row from its own input row with one reduction order for the whole launch),
so a request gets the same tokens alone or beside others. They need not equal the
batch-1 ``decode`` graph's bits: a [B, n] matrix product may sum in another
order than a [1, n] one.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticCache

from tkcc.errors import CaptureError
from tkcc.frontend.hf_cache import PositionedLayer
from tkcc.frontend.kv_cache import KVCache

PHASE = "decode_slots"
INPUT_NAMES = ("input_ids", "slot_positions")


class SlotCache(KVCache):
    """Staging row (own buffers ``key_<i>``/``value_<i>``, [1, H, S, D]) + the B slots (``slots``, [B, H, S, D])."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """``keys``/``values``: one [B + 1, H, S, D] tensor per layer; row B is staging, rows 0..B-1 the slots."""
        n = keys[0].shape[0] - 1
        if n < 1:
            raise ValueError(f"SlotCache needs tensors of B + 1 >= 2 rows, got {keys[0].shape[0]}")
        staging = KVCache.of_tensors([k[n:] for k in keys], [v[n:] for v in values])
        super().__init__(staging.layout, dict(staging.named_buffers()), staging.max_cache_len, 1)
        self.slots = KVCache.of_tensors([k[:n] for k in keys], [v[:n] for v in values])
        self._full = (list(keys), list(values))

    @classmethod
    def allocate(cls, num_layers: int, slots: int, kv_heads: int, max_cache_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "SlotCache":
        shape = (slots + 1, kv_heads, max_cache_len, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])

    @property
    def num_slots(self) -> int:
        return self.slots.batch

    def first(self, k: int) -> "SlotCache":
        """The first k layers (same tensors: a truncated tier shares memory)."""
        return SlotCache(self._full[0][:k], self._full[1][:k])

    def admit(self, slot: int, length: int) -> None:
        """Copy the staging row's positions [0, length) into slot ``slot`` (every layer, keys and values)."""
        if not 0 <= slot < self.num_slots or not 0 < length <= self.max_cache_len:
            raise ValueError(f"admit(slot={slot}, length={length}): slot in 0..{self.num_slots - 1}, length in "
                             f"1..{self.max_cache_len}")
        n = self.num_slots
        dst = [t[slot, :, :length] for t in self._full[0] + self._full[1]]
        src = [t[n, :, :length] for t in self._full[0] + self._full[1]]
        with torch.no_grad():
            torch._foreach_copy_(dst, src)


class _RowLayer(PositionedLayer):
    """A ``PositionedLayer`` over [B, H, S, D] buffers that writes row b's one new key at ``position[b]``."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows = self.position.view(-1, 1, 1, 1)
        k = self.keys.scatter_(2, rows.expand(key_states.shape), key_states)
        v = self.values.scatter_(2, rows.expand(value_states.shape), value_states)
        return k, v


class _RowCache(StaticCache):
    def __init__(self, kv: KVCache):  # noqa: D107 - StaticCache.__init__ needs a config; not used here
        Cache.__init__(self, layers=[_RowLayer(kv.max_cache_len) for _ in range(kv.num_layers)])
        self.bind(kv, None)

    def bind(self, kv: KVCache, positions: torch.Tensor | None) -> None:
        for i, layer in enumerate(self.layers):
            layer.bind(kv.key(i), kv.value(i))
            layer.position = positions


class SlotStep(torch.nn.Module):
    """One decode step of every slot: (input_ids [B, 1], slot_positions [B]) -> logits [B, 1, vocab]."""

    def __init__(self, lm: torch.nn.Module, kv: KVCache):
        super().__init__()
        self.lm = lm
        self.kv = kv
        self._cache = _RowCache(kv)

    def forward(self, input_ids: torch.Tensor, slot_positions: torch.Tensor) -> torch.Tensor:
        self._cache.bind(self.kv, slot_positions)
        # the mask the batch-1 step builds from its one position (kv index <= query position), per row
        keys = torch.arange(self.kv.max_cache_len, device=slot_positions.device)
        mask = keys[None, None, None, :] <= slot_positions[:, None, None, None]
        out = self.lm(input_ids=input_ids, position_ids=slot_positions[:, None], attention_mask=mask,
                      past_key_values=self._cache, use_cache=True)
        return out.logits


class SlotSteps(torch.nn.Module):
    """``Program.eager`` of a slots Program: the batch-1 step for one row, the slot step for B rows."""

    def __init__(self, step: torch.nn.Module, slot_step: SlotStep):
        super().__init__()
        self.step, self.slot_step = step, slot_step

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] == 1:
            return self.step(input_ids, positions)
        return self.slot_step(input_ids, positions)


def capture_slots(model, slots: int, *, max_cache_len: int | None = None, exact: bool = True):
    """Capture an HF causal LM for ``slots`` concurrent sequences (see the module docstring)."""
    from tkcc.frontend.hf import capture_hf

    cache = _allocate(model, slots, max_cache_len)
    prog = capture_hf(model, max_cache_len=cache.max_cache_len, batch=1, exact=exact, _kv=_staging(cache))
    _add_slots(prog, model, cache)
    _export_slots(prog)
    return prog


def prepare_slots(model, slots: int, *, max_cache_len: int, exact: bool = True):
    """Everything of ``capture_slots`` but the graphs (``tkcc.load``: an artifact brings its forwards)."""
    from tkcc.frontend.hf import prepare_hf

    cache = _allocate(model, slots, max_cache_len)
    prog = prepare_hf(model, max_cache_len=cache.max_cache_len, batch=1, exact=exact, _kv=_staging(cache))
    _add_slots(prog, model, cache)
    return prog


def _allocate(model, slots: int, max_cache_len: int | None) -> SlotCache:
    from tkcc.frontend.hf import default_max_cache_len, is_hf_causal_lm
    from tkcc.frontend.hf_cache import probe_layout

    if not is_hf_causal_lm(model):
        raise CaptureError(f"capture_slots: {type(model).__name__} is not a Hugging Face causal LM")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
        raise CaptureError(f"slots={slots!r}: a slots Program serves at least 2 sequences (batch 1 is the plain "
                           "capture)")
    cfg = model.config.get_text_config()
    if max_cache_len is None:
        max_cache_len = default_max_cache_len(cfg)
    if max_cache_len < 4:
        raise CaptureError(f"max_cache_len={max_cache_len}: must be at least 4")
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    window = getattr(cfg, "sliding_window", None)
    if "sliding_attention" in kinds and window is not None and window < max_cache_len:
        raise CaptureError(f"{type(model).__name__}: sliding-window layers (window {window} < max_cache_len "
                           f"{max_cache_len}) are not supported by the slot decode step, whose mask is the full "
                           "causal one; capture with max_cache_len <= the window, or batch 1")
    param = next(model.parameters())
    layout, api = probe_layout(model, 1)
    shapes = {(ls.kind, ls.key, ls.value) for ls in layout}
    if len(shapes) != 1 or layout[0].kind != "attention" or layout[0].key != layout[0].value or api is not None:
        raise CaptureError(f"{type(model).__name__}: the slot decode step takes models whose every layer keeps "
                           f"keys and values of one shape; this one keeps {sorted(map(str, shapes))} (serve it "
                           "at batch 1)")
    heads, head_dim = layout[0].key
    return SlotCache.allocate(cfg.num_hidden_layers, slots, heads, int(max_cache_len), head_dim, param.dtype,
                              param.device)


def _staging(cache: SlotCache) -> KVCache:
    """The staging row as a plain KVCache of the same tensor objects: what the batch-1 step is exported over
    (codegen binds a graph's tensors to ``Program.state`` by identity)."""
    return KVCache.of_tensors([cache.key(i) for i in range(cache.num_layers)],
                              [cache.value(i) for i in range(cache.num_layers)])


def _add_slots(prog, model, cache: SlotCache) -> None:
    """Turn a batch-1 Program over ``cache``'s staging row into a slots Program (state, eager, inputs, meta)."""
    from tkcc.frontend.fingerprint import model_fingerprint

    n, device = cache.num_slots, cache.key_0.device
    prog.eager = SlotSteps(prog.eager, SlotStep(model, cache.slots))
    prog.state = cache
    start = int(prog.example_inputs["decode"][1][0])
    prog.example_inputs[PHASE] = (torch.zeros((n, 1), dtype=torch.long, device=device),
                                  torch.arange(start, start + n, device=device) % cache.max_cache_len)
    prog.make_inputs[PHASE] = _input_maker(cache, int(prog.meta["vocab_size"]))
    meta = prog.meta
    meta["phases"] = [p for p in meta["phases"] if p != PHASE] + [PHASE]
    meta["inputs"] = dict(meta["inputs"], **{PHASE: list(INPUT_NAMES)})
    meta["slots"] = n
    settings = dict(phases=meta["phases"], batch=1, max_cache_len=meta["max_cache_len"], slots=n)
    prog.fingerprint = model_fingerprint(model, settings)
    prog.recapture = _recapture_fn(prog, cache)


def _export_slots(prog) -> None:
    from tkcc.frontend.export import export_graph
    from tkcc.frontend.layer_map import layer_map

    with torch.no_grad():
        gm, _spec = export_graph(prog.eager.slot_step, prog.example_inputs[PHASE], what="decode_slots step of")
    use_slot_attention(gm, prog.meta.get("device", "cpu"))
    prog.graphs[PHASE] = gm
    prog.layer_map[PHASE] = layer_map(gm, prog.meta["block_container"])


_VIEWS = {torch.ops.aten.reshape.default, torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default,
          torch.ops.aten.view.default, torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default}
_ROW_WRITES = {torch.ops.aten.scatter_.src, torch.ops.aten.scatter.src}


def _cache_row_source(node):
    """Walk from an sdpa key/value argument back through ``repeat_kv``'s views to the cache rows the step wrote
    ([B, Hkv, S, D]: the ``_RowLayer`` scatter); (node, views) or None."""
    views = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        views.append(node)
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _ROW_WRITES:
        return node, views
    return None


def use_slot_attention(gm: torch.fx.GraphModule, device="cpu") -> int:
    """Each layer's ``repeat_kv`` + sdpa over the whole cache rows becomes ``tkcc.kernels.slot_attention``: the
    split-KV kernel over each row's positions ``<= slot_positions[b]`` where it runs (CUDA), the same sdpa
    op for op elsewhere (bit-exact). Only the attentions whose mask is the step's own (built from
    ``slot_positions``) and whose keys/values are the cache rows just written are rewritten; returns how many."""
    from tkcc.kernels import slot_attention as sa

    pos = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "slot_positions"), None)
    if pos is None:
        return 0
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.scaled_dot_product_attention.default:
            continue
        if len(node.args) != 4 or set(node.kwargs) - {"scale"}:
            continue  # dropout, is_causal, enable_gqa...: not the step HF writes; leave it
        q, k, v, mask = node.args
        ks, vs = _cache_row_source(k), _cache_row_source(v)
        qv = q.meta.get("val") if isinstance(q, torch.fx.Node) else None
        if ks is None or vs is None or qv is None or not isinstance(mask, torch.fx.Node) or not _derives(mask, pos):
            continue
        rows = ks[0].meta.get("val")
        if rows is None or rows.dim() != 4 or qv.shape[1] % rows.shape[1]:
            continue
        scale = node.kwargs.get("scale")
        scale = float(scale) if scale is not None else float(qv.shape[-1]) ** -0.5
        chunk = _chunk(sa, rows.shape, device)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(sa.slot_attention, (q, ks[0], vs[0], pos, mask, scale, chunk))
        new.meta = {k2: v2 for k2, v2 in node.meta.items() if k2 in ("val", "nn_module_stack", "stack_trace")}
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        for dead in ks[1] + vs[1]:  # the expanded copies nobody reads now
            if not dead.users:
                gm.graph.erase_node(dead)
        done += 1
    gm.recompile()
    return done


def _derives(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether ``source`` is among ``node``'s inputs, transitively."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is source:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _chunk(sa, rows_shape, device) -> int:
    """Positions per split for cache rows [B, Hkv, S, D] on ``device``: by its SM count on a GPU (fixed per shape)."""
    B, hkv, S = int(rows_shape[0]), int(rows_shape[1]), int(rows_shape[2])
    dev = torch.device(device)
    sms = 132
    if dev.type == "cuda" and torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return sa.choose_chunk(S, B, hkv, sms)


def _recapture_fn(prog, cache: SlotCache):
    def recapture(k: int):
        """The first k blocks, with their slots (same weights, the same first-k cache tensors)."""
        from dataclasses import replace

        from tkcc.frontend.hf import _truncated, decoder_layers_path

        sub = cache.first(k)
        plain = replace(prog, graphs={p: g for p, g in prog.graphs.items() if p != PHASE}, state=_staging(sub))
        small = _truncated(plain, decoder_layers_path(prog.model), k)
        _add_slots(small, small.model, sub)
        _export_slots(small)
        return small
    return recapture


def _input_maker(cache: SlotCache, vocab: int):
    """make_inputs["decode_slots"](bucket, generator): random ids; each slot at its own random position.

    With a decode bucket (context c), every slot sits at c with its cache filled to c (what a step at that
    context costs); without one, positions differ per slot (what the phase is for)."""
    from tkcc.errors import TkccError
    from tkcc.frontend.hf import _generator_for, _randint

    n, max_len, device = cache.num_slots, cache.max_cache_len, cache.key_0.device

    def make(bucket=None, generator: torch.Generator | None = None) -> tuple:
        ids = _randint(vocab, (n, 1), generator, device)
        if bucket is None:
            return ids, _randint(max_len, (n,), generator, device)
        if bucket.phase not in ("decode", PHASE):
            raise TkccError(f"bucket {bucket.key()} is for phase {bucket.phase!r}, not decode")
        if not 0 <= bucket.context < max_len:
            raise TkccError(f"decode at context {bucket.context} does not fit max_cache_len={max_len} "
                            f"(bucket {bucket.key()})")
        cache.slots.fill_random(bucket.context, _generator_for(device, generator))
        return ids, torch.full((n,), bucket.context, dtype=torch.long, device=device)

    return make
