"""Layouts: (degree, strategy) pairs, the model shapes they split, and which are legal.

A layout is legal for a model when every dimension it splits divides evenly
by the degree (attention heads, KV heads, MLP and expert widths, experts for
expert parallelism) and there are at least ``degree`` devices. A bad layout is
rejected here, before any process starts, with the dimension that does not
divide named.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tkcc.errors import PlanError

DEGREES = (1, 2, 4, 8)
STRATEGIES = ("tp", "tp_ep")
STRATEGY_DOC = {
    "tp": "attention by heads, dense MLP column|row, MoE experts split inside each expert",
    "tp_ep": "attention by heads, MoE experts placed whole on ranks (expert parallelism)",
}


class LayoutError(PlanError):
    """A (degree, strategy) the model or the hardware cannot run."""


@dataclass(frozen=True)
class ModelDims:
    """The shapes a layout splits and the cost model counts (from a transformers config)."""

    name: str
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # dense MLP width (0 for an all-MoE model)
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    tied_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def to_json(self) -> dict:
        return asdict(self)


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


def legal_strategies(dims: ModelDims) -> tuple[str, ...]:
    return STRATEGIES if dims.is_moe else ("tp",)


def check_layout(dims: ModelDims, degree: int, strategy: str, devices: int | None = None,
                 where: str = "sharding") -> None:
    """Raise LayoutError naming the first dimension ``degree`` does not divide."""
    if degree not in DEGREES:
        raise LayoutError(f"{where}: degree={degree} is not one of {DEGREES}")
    if strategy not in STRATEGIES:
        raise LayoutError(f"{where}: strategy={strategy!r} is not one of {STRATEGIES}")
    if strategy == "tp_ep" and not dims.is_moe:
        raise LayoutError(f"{where}: strategy 'tp_ep' places experts on ranks, but {dims.name} has no experts "
                          f"(use 'tp')")
    if devices is not None and degree > devices:
        raise LayoutError(f"{where}: degree={degree} needs {degree} devices, only {devices} present")
    if degree == 1:
        return
    checks = [("num_attention_heads", dims.heads), ("num_key_value_heads", dims.kv_heads),
              ("vocab_size", dims.vocab)]
    if dims.intermediate:
        checks.append(("intermediate_size", dims.intermediate))
    if dims.is_moe:
        if strategy == "tp":
            checks.append(("expert intermediate size", dims.expert_intermediate))
        else:
            checks.append(("num_experts", dims.experts))
    for field, value in checks:
        if value % degree:
            raise LayoutError(f"{where}: degree={degree} does not divide {field}={value} of {dims.name} "
                              f"(strategy {strategy!r}); legal degrees: "
                              f"{[d for d in DEGREES if all(v % d == 0 for _, v in checks)]}")


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
