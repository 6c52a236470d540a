"""A rank's worker for a sharded model: capture, shard for this rank, generate greedily.

The smallest real engine worker ``RankGroup`` can run (``tkcc.parallel.serve``
and the tests use it): every rank builds the same built-in model from the same
seed, captures prefill/decode, applies the ``sharding`` pass for its rank, and
answers ``generate`` with the same greedy tokens on every rank (the graph
gathers the full logits).
"""
from __future__ import annotations

import torch


class LayoutWorker:
    def __init__(self, rank: int, world: int, model: str = "llama-tiny", strategy: str = "tp",
                 max_cache_len: int = 64, dtype: str = "float32", overrides: dict | None = None):
        from tkcc.frontend.hf import capture_hf
        from tkcc.frontend.models import build_model
        from tkcc.passes.sharding import shard_program

        self.rank, self.world = rank, world
        self.device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
        m = build_model(model, dtype=getattr(torch, dtype), device=self.device, **(overrides or {}))
        self.reference = capture_hf(m, max_cache_len=max_cache_len)
        self.program, self.info = shard_program(self.reference, world, strategy)
        self.model_name, self.strategy = model, strategy

    def op_ping(self) -> dict:
        return {"rank": self.rank, "world": self.world, "model": self.model_name, "strategy": self.strategy,
                "layout": self.program.meta.get("layout"), "pid": __import__("os").getpid()}

    def op_generate(self, prompt: list[int], n: int) -> list[int]:
        from tkcc.errors import TkccError
        from tkcc.frontend.generate import greedy

        limit = self.program.meta["max_cache_len"]
        if not prompt or len(prompt) + n > limit:
            raise TkccError(f"generate: prompt of {len(prompt)} tokens + {n} new does not fit max_cache_len={limit}")
        ids = torch.tensor([prompt], device=self.device)
        return greedy(self.program, ids, n)[0].tolist()

    def op_reference_generate(self, prompt: list[int], n: int) -> list[int]:
        """The unsharded program's greedy tokens on this rank (the golden answer)."""
        from tkcc.frontend.generate import greedy

        return greedy(self.reference, torch.tensor([prompt], device=self.device), n)[0].tolist()
