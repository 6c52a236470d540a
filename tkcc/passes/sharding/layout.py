"""Layouts the sharding pass takes: (degree, strategy) pairs, the model shapes they split, and the check.

A layout is legal for a model when every dimension it splits divides evenly
by the degree (attention heads, KV heads, MLP and expert widths, experts for
expert parallelism) and there are at least ``degree`` devices. A bad layout is
rejected here, before any process starts, with the dimension that does not
divide named. The cost model's view of layouts (dims from a config, every
legal layout) is ``tkcc.parallel.layout``, built on this.
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
