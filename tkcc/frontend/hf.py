"""Hugging Face causal LMs -> Program with phases "prefill" and "decode" over a static state (``KVCache``).

Each phase is one whole graph of ``StepModule.forward(input_ids, cache_position)
-> logits``:

- ``prefill``: ``input_ids`` int64 [B, T], ``cache_position`` int64 [T]
  (normally ``arange(start, start + T)``), T dynamic in 1..max_cache_len;
- ``decode``: ``input_ids`` int64 [B, 1], ``cache_position`` int64 [1];
- output: logits [B, T, vocab] in the model dtype (every position, as
  ``model(...)`` returns them).

A step writes the new keys/values at ``cache_position`` into the KV buffers
(``Program.state``, a ``KVCache``; a recurrent layer's state too, see
``tkcc.frontend.kv_cache``) and attends over the cache with a causal mask from
those positions, so its result depends only on its inputs and on cache
positions < ``cache_position[-1]``. What each layer keeps is probed from the
model itself (``tkcc.frontend.hf_cache.probe_layout``).
"""
from __future__ import annotations

import contextlib
import functools
import time
import types

import torch

from tkcc.errors import CaptureError, TkccError
from tkcc.frontend.export import export_graph
from tkcc.frontend.fingerprint import model_fingerprint
from tkcc.frontend.graph_breaks import library_failure
from tkcc.frontend.layer_map import layer_map
from tkcc.frontend.program import Program
from tkcc.frontend.truncate import copied_path, keep_first_blocks
from tkcc.frontend.weight_packing import pack_projections

PHASES = ("prefill", "decode")
INPUT_NAMES = ("input_ids", "cache_position")
DEFAULT_MAX_CACHE_LEN = 4096
_EXAMPLE_PROMPT = 8


def is_hf_causal_lm(model) -> bool:
    """True for a transformers causal LM with a head: a ``*ForCausalLM``, or a class transformers' own auto mapping
    names as one (GPT-2's ``GPT2LMHeadModel``, ...; not the multimodal ``*ForConditionalGeneration``)."""
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return False
    name = type(model).__name__
    return name.endswith("ForCausalLM") or (name.endswith("LMHeadModel") and name in _auto_causal_lm_names())


def _auto_causal_lm_names() -> set:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}


def decoder_layers_path(model) -> str:
    """Path of the decoder layers' ModuleList (``"model.layers"`` for Llama-like models)."""
    n = model.config.get_text_config().num_hidden_layers
    candidates = [p for p, m in model.named_modules()
                  if isinstance(m, torch.nn.ModuleList) and p.split(".")[-1] in ("layers", "h", "blocks")
                  and len(m) == n]
    if not candidates:
        raise CaptureError(f"{type(model).__name__}: cannot find the decoder layers (a ModuleList of "
                           f"num_hidden_layers={n} named 'layers'); this model family is not supported")
    return min(candidates, key=lambda p: p.count("."))


class StepModule(torch.nn.Module):
    """One prefill/decode step of an HF causal LM over a ``KVCache``: (input_ids, cache_position) -> logits.

    Modules with a registered forward (``tkcc.frontend.hf_adapters.MODULE_FORWARDS``) run it during the
    step, and only then: the model is the user's, unchanged outside a step."""

    def __init__(self, lm: torch.nn.Module, kv):
        super().__init__()
        from tkcc.frontend.hf_adapters import function_overrides, module_forwards
        from tkcc.frontend.hf_cache import positioned_cache

        self.lm = lm
        self.kv = kv
        self._cache = positioned_cache(kv)
        self._forwards = module_forwards(lm)
        self._functions = function_overrides(lm)
        self.static_mask = False  # see ``mask_sized_by_the_cache``

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        # Point the cache at this module's buffers (during export: the traced ones) and this step's positions.
        self._cache.bind(self.kv, cache_position)
        mask = {}
        if self.static_mask:  # no padding, over the whole cache: the causal mask from the positions does the rest
            mask["attention_mask"] = torch.ones(input_ids.shape[0], self._cache.max_len, dtype=torch.long,
                                                device=input_ids.device)
        with _registered_forwards(self._forwards, self._functions):
            out = self.lm(input_ids=input_ids, position_ids=cache_position.unsqueeze(0),
                          past_key_values=self._cache, use_cache=True, **mask)
        self._cache.finish()
        return out.logits


def mask_sized_by_the_cache(exc: BaseException | None) -> bool:
    """Whether export stopped where the model sized its own attention mask by the tokens the cache has seen.

    OPT, BLOOM and BioGPT build ``torch.ones(batch, past_seen_tokens + T)`` when no mask is given; over tkcc's
    cache ``past_seen_tokens`` is the step's position, a tensor, so the mask's length is data-dependent and
    export cannot pad it to the cache's length. Given an all-ones mask of the cache's whole length (no padding:
    what ``generate`` passes over a static cache), the step is the same and its shapes are static. Other models
    are captured without one: a mask adds a padding term to every attention's mask, which the lowering's
    attention patterns do not take."""
    from tkcc.frontend.graph_breaks import failure_frame

    frame = failure_frame(exc) if exc is not None else None
    return bool(frame and frame.filename.endswith("masking_utils.py") and frame.name == "prepare_padding_mask"
                and "DataDependent" in type(exc).__name__ + str(exc))


@contextlib.contextmanager
def _registered_forwards(pairs, functions=()):
    """Each module's registered forward as its instance ``forward``, and each registered function in its modeling
    file's namespace, for the duration of one step."""
    from tkcc.frontend.hf_adapters import forward_globals

    for mod, fn in pairs:
        mod.forward = types.MethodType(fn, mod)
    saved = [(forward_globals(cls), name, forward_globals(cls)[name]) for cls, name, _make in functions]
    for (ns, name, own), (_cls, _name, make) in zip(saved, functions):
        ns[name] = make(own)
    try:
        yield
    finally:
        for mod, _fn in pairs:
            mod.__dict__.pop("forward", None)
        for ns, name, was in saved:
            ns[name] = was


def capture_hf(model, *, phases=None, max_cache_len: int | None = None, batch: int = 1, exact: bool = True,
               _parent: Program | None = None, _kv=None) -> Program:
    """Capture an HF causal LM as a Program (see module docstring for the phase conventions)."""
    from tkcc.frontend.hf_cache import SUPPORTED

    t0 = time.perf_counter()
    prog = prepare_hf(model, phases=phases, max_cache_len=max_cache_len, batch=batch, exact=exact, _parent=_parent,
                      _kv=_kv)
    step, examples = prog.eager, prog.example_inputs
    graphs, layer_maps = {}, {}
    for phase in prog.meta["phases"]:
        dyn = None
        if phase == "prefill":
            t = torch.export.Dim("T", min=1, max=prog.meta["max_cache_len"])
            dyn = ({1: t}, {0: t})
        fail = functools.partial(library_failure, model, f"the {phase} step of", where="tkcc.frontend.hf.capture_hf",
                                 supported=SUPPORTED)
        with torch.no_grad(), _experts_for(model, phase):
            try:
                gm, _spec = export_graph(step, examples[phase], dynamic_shapes=dyn, failure=fail)
            except CaptureError as e:
                if step.static_mask or not mask_sized_by_the_cache(e.__cause__):
                    raise
                step.static_mask = True  # for every phase and the eager step alike (the same arithmetic)
                gm, _spec = export_graph(step, examples[phase], dynamic_shapes=dyn, failure=fail)
        graphs[phase] = gm
        layer_maps[phase] = layer_map(gm, prog.meta["block_container"])
    prog.meta["static_mask"] = step.static_mask
    step._cache.bind(prog.state, None)  # drop references to traced tensors
    prog.graphs, prog.layer_map = graphs, layer_maps
    prog.meta["capture_seconds"] = round(time.perf_counter() - t0, 3)
    return prog


def default_max_cache_len(cfg) -> int:
    """The model's context length, capped at DEFAULT_MAX_CACHE_LEN (a cache is allocated for all of it)."""
    return min(getattr(cfg, "max_position_embeddings", DEFAULT_MAX_CACHE_LEN) or DEFAULT_MAX_CACHE_LEN,
               DEFAULT_MAX_CACHE_LEN)


def prepare_hf(model, *, phases=None, max_cache_len: int | None = None, batch: int = 1, exact: bool = True,
               _parent: Program | None = None, _kv=None) -> Program:
    """Everything of a captured Program but its graphs: packed weights, the KV cache, the eager step, the
    fingerprint and the input makers. ``capture_hf`` adds the exported graphs; ``tkcc.load`` needs none
    (an artifact brings its forwards), so a loaded model is ready without exporting anything."""
    from tkcc.frontend.hf_cache import probe_layout
    from tkcc.frontend.kv_cache import KVCache

    phases = tuple(phases or PHASES)
    bad = [p for p in phases if p not in PHASES]
    if bad:
        raise CaptureError(f"unknown phase(s) {bad} for a causal LM; phases are {list(PHASES)}")
    cfg = model.config.get_text_config()
    if max_cache_len is None:
        max_cache_len = default_max_cache_len(cfg)
    if max_cache_len < 4:
        raise CaptureError(f"max_cache_len={max_cache_len}: must be at least 4")
    if batch < 1:
        raise CaptureError(f"batch={batch}: must be at least 1")
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    container = decoder_layers_path(model)
    num_layers = cfg.num_hidden_layers
    if _parent is None:
        pack_projections(model)  # before any graph holds a weight pointer (see tkcc.frontend.weight_packing)
    if _kv is None:
        layout, api = probe_layout(model, batch)
        _kv = KVCache.allocate(layout, batch, max_cache_len, device, cache_api=api)
    step = StepModule(model, _kv)

    example_t = min(_EXAMPLE_PROMPT, max_cache_len // 2)
    ids = torch.zeros((batch, example_t), dtype=torch.long, device=device)
    examples = {
        "prefill": (ids, torch.arange(example_t, device=device)),
        "decode": (ids[:, :1].clone(), torch.tensor([example_t], device=device)),
    }
    settings = dict(phases=list(phases), batch=batch, max_cache_len=max_cache_len)
    prog = Program(
        graphs={},
        example_inputs={p: examples[p] for p in phases},
        layer_map={},
        num_blocks=num_layers,
        model=model,
        fingerprint=model_fingerprint(model, settings),
        meta=dict(
            kind="causal_lm",
            family=getattr(cfg, "model_type", type(model).__name__),
            name=getattr(model, "tkcc_name", None) or getattr(model.config, "_name_or_path", "") or None,
            model_class=type(model).__name__,
            dtype=str(dtype).replace("torch.", ""),
            device=str(device),
            max_cache_len=max_cache_len,
            batch=batch,
            vocab_size=cfg.vocab_size,
            num_layers=num_layers,
            num_params=sum(p.numel() for p in model.parameters()),
            exact=exact,
            phases=list(phases),
            inputs={p: list(INPUT_NAMES) for p in phases},
            block_container="lm." + container,
            torch_version=torch.__version__,
            truncated_from=_parent.meta["num_layers"] if _parent is not None else None,
            prefill_chunk=_prefill_chunk(model),
            state_layout=[ls.describe() for ls in _kv.layout],
        ),
        state=_kv,
        make_inputs={p: _input_maker(p, _kv, cfg.vocab_size, examples[p]) for p in phases},
        eager=step,
    )
    prog.recapture = lambda k: _truncated(prog, container, k)
    return prog


def _truncated(parent: Program, container: str, k: int) -> Program:
    """The parent's model with its first k decoder layers, same weights and same first-k KV buffers."""
    model = parent.model
    small = keep_first_blocks(model, container, k)
    import copy

    cfg = copy.deepcopy(model.config)
    text = cfg.get_text_config()
    text.num_hidden_layers = k
    for attr in ("layer_types", "mlp_only_layers"):
        val = getattr(text, attr, None)
        if isinstance(val, list) and attr == "layer_types":
            setattr(text, attr, val[:k])
        elif isinstance(val, list):
            setattr(text, attr, [i for i in val if i < k])
    for mod in copied_path(small, container):
        if hasattr(mod, "config"):
            mod.config = cfg
    if hasattr(model, "tkcc_name"):
        small.tkcc_name = f"{model.tkcc_name}[:{k}]"
    return capture_hf(small, phases=parent.phases, max_cache_len=parent.meta["max_cache_len"],
                      batch=parent.meta["batch"], exact=parent.meta["exact"], _parent=parent,
                      _kv=parent.state.first(k))


def _prefill_chunk(model) -> int | None:
    """Prompt tokens per prefill step when a whole prompt at once would not fit: the ``batched_mm`` experts
    (pinned for the built-in MoE models, so CPU and GPU capture one graph) gather every token's top-k expert
    weights, tens of MB per token for OLMoE, so the prompt goes in chunks of this many tokens; a registered
    function may need fewer (``tkcc.frontend.hf_adapters.prefill_chunk``)."""
    from tkcc.frontend.hf_adapters import prefill_chunk

    cfg = model.config.get_text_config()
    chunks = [c for c in (256 if getattr(cfg, "_experts_implementation", None) == "batched_mm" else None,
                          prefill_chunk(model)) if c]
    return min(chunks) if chunks else None


@contextlib.contextmanager
def _experts_for(model, phase: str):
    """The MoE experts implementation a phase is captured with (``capture_experts``), set on every config of the
    model for the export of that phase only, then put back: the model's own eager forward keeps its setting."""
    impl = capture_experts(model, phase)
    if impl is None:
        yield
        return
    configs = experts_configs(model)
    saved = [c._experts_implementation for c in configs]
    try:
        for c in configs:
            c._experts_implementation = impl
        yield
    finally:
        for c, was in zip(configs, saved):
            c._experts_implementation = was


def experts_configs(model) -> list:
    """Every distinct config of ``model`` (its own, its text config, its modules') that names an experts
    implementation: transformers' experts modules read theirs at each call."""
    configs = {id(c): c for c in (model.config, model.config.get_text_config(),
                                  *(getattr(m, "config", None) for m in model.modules()))
               if c is not None and hasattr(c, "_experts_implementation")}
    return list(configs.values())


def capture_experts(model, phase: str) -> str | None:
    """The experts implementation ``phase`` of ``model`` is captured with, or None for the model's own."""
    cfg = model.config.get_text_config()
    param = next(model.parameters(), None)
    if param is None:
        return None
    return experts_for_phase(getattr(cfg, "_experts_implementation", None), phase, param.device, param.dtype)


def experts_for_phase(impl: str | None, phase: str, device, dtype: torch.dtype) -> str | None:
    """On CUDA in bf16, a model set to transformers' ``batched_mm`` or ``grouped_mm`` experts has its prefill
    captured with ``grouped_mm`` and its decode with ``batched_mm``; anywhere else, or another setting, None.

    Why: ``batched_mm`` gathers every token's k experts' weights before a bmm, 64 MiB per token for OLMoE: on an
    H200 a 256-token prefill chunk of olmoe-16l took 222.5 ms and 24 GiB that way, 8.3 ms and 25 MiB grouped
    (``benchmarks/prefill.py``). For one token the gather reads the same bytes as the experts themselves, and the
    lowered decode step's MoE patterns match ``batched_mm``'s ops: so decode takes it, also for a model loaded
    with transformers' default on a GPU (``grouped_mm``). Both compute the same function with other roundings:
    the captured graphs are the reference every candidate is held to, and the model's own eager forward (its
    own setting) is one candidate among them, validated within tolerance of it. On a CPU, or in fp32 (where
    transformers' grouped path falls back to a per-expert loop that synchronises with the host), the model's
    own setting stays."""
    dev = torch.device(device)
    if dev.type != "cuda" or dtype != torch.bfloat16 or impl not in ("batched_mm", "grouped_mm"):
        return None
    if phase == "prefill" and impl == "batched_mm" and _grouped_mm_available(dev):
        return "grouped_mm"
    if phase == "decode" and impl == "grouped_mm":
        return "batched_mm"
    return None


def _grouped_mm_available(device: torch.device) -> bool:
    """transformers' ``grouped_mm`` experts run torch's grouped GEMM (not its per-expert Python fallback, which
    synchronises with the host): torch has one and the GPU is sm80 or newer."""
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _generator_for(device: torch.device, generator: torch.Generator | None) -> torch.Generator | None:
    """A generator on ``device`` seeded from ``generator`` (so CPU seeds drive GPU fills deterministically)."""
    if generator is None or generator.device.type == device.type:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    return torch.Generator(device=device).manual_seed(seed)


def _randint(high: int, shape: tuple, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Random token ids drawn on the generator's device (CPU by default: the same ids on every device)."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.randint(0, high, shape, generator=generator, device=gen_device).to(device)


def _input_maker(phase: str, kv, vocab: int, example: tuple):
    """make_inputs[phase](bucket, generator) for a causal LM (see docs/frontend.md)."""
    max_len, batch = kv.max_cache_len, kv.batch
    device = example[0].device

    def make(bucket=None, generator: torch.Generator | None = None) -> tuple:
        if bucket is not None:
            if bucket.phase != phase:
                raise TkccError(f"bucket {bucket.key()} is for phase {bucket.phase!r}, not {phase!r}")
            if bucket.batch != batch:
                raise TkccError(f"bucket {bucket.key()}: batch {bucket.batch}, but this Program was captured with "
                                f"batch={batch}; capture with batch={bucket.batch}")
        if phase == "prefill":
            t = bucket.context if bucket is not None else example[0].shape[1]
            if not 1 <= t <= max_len:
                raise TkccError(f"prefill of {t} tokens does not fit max_cache_len={max_len}"
                                + (f" (bucket {bucket.key()})" if bucket is not None else ""))
            ids = _randint(vocab, (batch, t), generator, device)
            return ids, torch.arange(t, device=device)
        pos = bucket.context if bucket is not None else int(example[1][0])
        if not 0 <= pos < max_len:
            raise TkccError(f"decode at context {pos} does not fit max_cache_len={max_len}"
                            + (f" (bucket {bucket.key()})" if bucket is not None else ""))
        ids = _randint(vocab, (batch, 1), generator, device)
        if bucket is not None:
            kv.fill_random(pos, _generator_for(device, generator))
        return ids, torch.tensor([pos], device=device)

    return make
