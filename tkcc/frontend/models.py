"""Built-in model registry: the reference models of BENCH.md and tiny CPU variants.

Every model is built with random weights from a fixed seed, so the same name,
dtype and device always give the same weights (golden outputs rely on this).
MoE models pin the experts implementation, so CPU and GPU capture the same graph.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tkcc.errors import TkccError

# The experts implementation every built-in MoE model uses (transformers 5
# picks one by device and dtype otherwise; "eager" graph-breaks at nonzero).
EXPERTS_IMPLEMENTATION = "batched_mm"


# family -> (transformers config class, model class, whether its blocks are sparse MoE)
FAMILIES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", False),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", True),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", True),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", True),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", True),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", True),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", True),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", True),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", True),
}

# The attention implementation each family is captured with: sdpa, except where the family's own arithmetic
# is only in another (gpt-oss's per-head sink logits are in its eager attention; transformers refuses sdpa).
ATTENTION_IMPLEMENTATION: dict[str, str] = {"gpt_oss": "eager"}

# Buffers a checkpoint fills but random initialisation leaves at zero; seeded random values make the
# reference models exercise them (DeepSeek-V3's router bias that corrects expert selection).
_CHECKPOINT_BUFFERS = ("e_score_correction_bias",)
# Parameters a checkpoint fills but initialisation leaves at zero (or near it), per family: leaf name -> std of the
# seeded values (None: the config's initializer_range). gpt-oss: its q/k/v/o and expert biases (zeros) and its
# sink logits (std 0.02: the sink would take no mass).
_CHECKPOINT_PARAMS: dict[str, dict[str, float | None]] = {
    "gpt_oss": {"sinks": 1.0, "bias": None, "gate_up_proj_bias": None, "down_proj_bias": None}}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # a key of FAMILIES
    config: dict
    description: str

    @property
    def is_moe(self) -> bool:
        return FAMILIES[self.family][2]


_NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

# The specs are data (tkcc/data/models.json) so that `tkcc --help` can list them without importing torch.
_SPECS = json.loads((Path(__file__).resolve().parents[1] / "data" / "models.json").read_text())
REGISTRY: dict[str, ModelSpec] = {
    d["name"]: ModelSpec(d["name"], d["family"], d["config"], d["description"]) for d in _SPECS["models"]}
DEFAULT_MODEL: str = _SPECS["default"]


def _config_cls(family: str):
    import transformers

    return getattr(transformers, FAMILIES[family][0])


def _model_cls(family: str):
    import transformers

    return getattr(transformers, FAMILIES[family][1])


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
    cfg._attn_implementation = ATTENTION_IMPLEMENTATION.get(spec.family, "sdpa")
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
        with torch.no_grad():
            for path, buf in model.named_buffers():
                if path.rsplit(".", 1)[-1] in _CHECKPOINT_BUFFERS:
                    buf.normal_(0.0, cfg.initializer_range)
            filled = _CHECKPOINT_PARAMS.get(spec.family, {})
            for path, prm in model.named_parameters():
                leaf = path.rsplit(".", 1)[-1]
                if leaf in filled:
                    prm.normal_(0.0, filled[leaf] if filled[leaf] is not None else cfg.initializer_range)
    model = model.to(dtype=dtype).eval()
    model.requires_grad_(False)
    model.tkcc_name = name
    return model
