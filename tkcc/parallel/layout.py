"""Layouts as the cost model sees them: a model's split dimensions from its config, and every legal layout.

What a layout is and whether it is legal belongs to the sharding pass
(``tkcc.passes.sharding.layout``: ``ModelDims``, ``check_layout``,
``LayoutError``), re-exported here for the cost model and its callers.
"""
from __future__ import annotations

from tkcc.passes.sharding.layout import (DEGREES, STRATEGIES, STRATEGY_DOC, LayoutError, ModelDims,  # noqa: F401
                                         check_layout, legal_strategies)


def dims_from_config(cfg, name: str = "") -> ModelDims:
    """Read the split dimensions of a Llama/OLMoE/Mixtral/Qwen3-MoE config."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    moe_inter = getattr(cfg, "moe_intermediate_size", None) or (cfg.intermediate_size if experts else 0)
    return ModelDims(
        name=name or getattr(cfg, "name_or_path", "") or cfg.model_type,
        family=cfg.model_type,
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab=cfg.vocab_size,
        intermediate=0 if experts else cfg.intermediate_size,
        experts=experts,
        top_k=getattr(cfg, "num_experts_per_tok", 0) if experts else 0,
        expert_intermediate=moe_inter if experts else 0,
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )


def dims_for_model(name: str, **overrides) -> ModelDims:
    """Dims of a built-in model by name, without building its weights."""
    from tkcc.frontend.models import make_config

    return dims_from_config(make_config(name, **overrides), name)


def legal_layouts(dims: ModelDims, devices: int | None = None, degrees=DEGREES) -> list[tuple[int, str]]:
    """Every (degree, strategy) ``check_layout`` accepts."""
    out = []
    for d in degrees:
        for s in legal_strategies(dims):
            if d == 1 and s != "tp":
                continue  # at degree 1 every strategy is the unsharded model
            try:
                check_layout(dims, d, s, devices)
            except LayoutError:
                continue
            out.append((d, s))
    return out
