"""Built-in model registry: the reference models of BENCH.md and tiny CPU variants.

Every model is built with random weights from a fixed seed, so the same name,
dtype and device always give the same weights (golden outputs rely on this).
MoE models pin the experts implementation, so CPU and GPU capture the same graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tkcc.errors import TkccError

# The experts implementation every built-in MoE model uses (transformers 5
# picks one by device and dtype otherwise; "eager" graph-breaks at nonzero).
EXPERTS_IMPLEMENTATION = "batched_mm"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "llama", "olmoe", "mixtral", "qwen3_moe"
    config: dict
    description: str

    @property
    def is_moe(self) -> bool:
        return self.family in ("olmoe", "mixtral", "qwen3_moe")


_NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

REGISTRY: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec(
            "olmoe-16l",
            "olmoe",
            dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
                 max_position_embeddings=4096),
            "OLMoE-1B-7B shape, 16 layers, 64 experts top-8 (BENCH.md reference)",
        ),
        ModelSpec(
            "llama-1b-16l",
            "llama",
            dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=True),
            "Llama-3.2-1B shape, 16 layers (BENCH.md reference)",
        ),
        ModelSpec(
            "olmoe-tiny",
            "olmoe",
            dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=256,
                 max_position_embeddings=1024),
            "tiny OLMoE for CPU tests and the default job",
        ),
        ModelSpec(
            "llama-tiny",
            "llama",
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024, tie_word_embeddings=True),
            "tiny Llama (GQA) for CPU tests",
        ),
        ModelSpec(
            "mixtral-tiny",
            "mixtral",
            dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                 max_position_embeddings=1024, sliding_window=None),
            "tiny Mixtral for CPU tests",
        ),
        ModelSpec(
            "qwen3moe-tiny",
            "qwen3_moe",
            dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 vocab_size=256, max_position_embeddings=1024, decoder_sparse_step=1, mlp_only_layers=[]),
            "tiny Qwen3-MoE for CPU tests",
        ),
    ]
}

DEFAULT_MODEL = "olmoe-tiny"


def _config_cls(family: str):
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "olmoe": transformers.OlmoeConfig,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[family]


def _model_cls(family: str):
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "olmoe": transformers.OlmoeForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }[family]


def get_spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise TkccError(f"unknown model {name!r}; built-in models: {', '.join(sorted(REGISTRY))}") from None


def make_config(name: str, **overrides):
    spec = get_spec(name)
    kw = dict(_NO_SPECIAL_TOKENS)
    kw.update(spec.config)
    kw.update(overrides)
    cfg = _config_cls(spec.family)(**kw)
    if spec.is_moe:
        cfg._experts_implementation = EXPERTS_IMPLEMENTATION
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                **config_overrides) -> torch.nn.Module:
    """Build a registered model with seeded random weights, in eval mode."""
    spec = get_spec(name)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TkccError(f"device {device!r} requested but no CUDA device is available")
    cfg = make_config(name, **config_overrides)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = _model_cls(spec.family)(cfg)
    model = model.to(dtype=dtype).eval()
    model.requires_grad_(False)
    model.tkcc_name = name
    return model
