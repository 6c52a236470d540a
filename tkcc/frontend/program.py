"""Program: the captured forward of one model, per phase, as FX graphs.

Parameters are shared with the model, never copied: a Program's graphs reach
weights through ``get_attr`` on the model (or a module holding the same
tensors). The layer map says which nodes belong to which repeated block, so a
tier can keep the first k blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.fx


@dataclass
class Program:
    """Captured forward of one model.

    graphs:          phase name ("prefill", "decode", or "forward" for plain
                     modules) -> GraphModule. Each graph's placeholders are the
                     phase's runtime inputs (e.g. input_ids, cache_position).
    example_inputs:  phase -> tuple of example tensors the graph was captured with.
    make_inputs:     phase -> callable(bucket_or_None, generator) -> tuple of
                     fresh inputs for that phase (used by golden checks and the
                     engine); defaults to cloning example_inputs.
    layer_map:       phase -> {node name: block index}; nodes outside any
                     repeated block are absent.
    num_blocks:      number of repeated blocks (decoder layers).
    model:           the source nn.Module (weights live here).
    state:           module holding buffers the graphs mutate (e.g. a static KV
                     cache); shared, not copied.
    fingerprint:     hash of model structure + parameter shapes + dtype + device.
    meta:            family, dtype, device, max_cache_len, exactness mode, ...
    recapture:       callable(k) -> Program with the first k blocks, sharing
                     weights; set by the frontend that built this Program.
    eager:           the nn.Module whose forward each graph captured (same
                     signature, same state, same weights): the plain PyTorch
                     reference to compare a graph or a compiled artifact with.
    """

    graphs: dict[str, torch.fx.GraphModule]
    example_inputs: dict[str, tuple]
    layer_map: dict[str, dict[str, int]]
    num_blocks: int
    model: torch.nn.Module
    fingerprint: str
    meta: dict = field(default_factory=dict)
    state: torch.nn.Module | None = None
    make_inputs: dict[str, Callable] = field(default_factory=dict)
    recapture: Callable[[int], "Program"] | None = None
    eager: torch.nn.Module | None = None

    @property
    def phases(self) -> list[str]:
        return list(self.graphs)

    def truncate(self, k: int) -> "Program":
        """The same model with only its first k repeated blocks, weights shared."""
        if not 1 <= k <= self.num_blocks:
            raise ValueError(f"truncate(k={k}): k must be in 1..{self.num_blocks}")
        if k == self.num_blocks:
            return self
        if self.recapture is None:
            raise ValueError("this Program was built without a recapture function; cannot truncate")
        return self.recapture(k)

    def reset_state(self) -> None:
        """Zero the mutable state (KV cache) so a new sequence starts from an empty cache."""
        if self.state is None:
            return
        with torch.no_grad():
            for buf in self.state.buffers():
                buf.zero_()

    def with_graphs(self, graphs: dict[str, torch.fx.GraphModule]) -> "Program":
        """A copy of this Program with some graphs replaced (passes use this)."""
        merged = dict(self.graphs)
        merged.update(graphs)
        return replace(self, graphs=merged)

    def inputs(self, phase: str, bucket=None, generator: torch.Generator | None = None) -> tuple:
        """Fresh inputs for a phase (and optionally a workload bucket)."""
        fn = self.make_inputs.get(phase)
        if fn is not None:
            return fn(bucket, generator)
        return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in self.example_inputs[phase])
