"""A small residual-MLP stack served by the engine in tests: a plain nn.Module captured with torch.fx.

Used as ``tkcc serve --model tests/runtime/blocks_model.py:make_program``: it
starts in a fraction of the time an HF model takes, so the survival tests
(which restart the worker several times) stay fast. It is a real Program:
one ``forward`` phase, a layer map, and ``truncate(k)`` sharing weights.
"""
from __future__ import annotations

import hashlib

import torch
import torch.fx

WIDTH = 64


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


class Stack(torch.nn.Module):
    def __init__(self, blocks: list, head: torch.nn.Module):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.head = head

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _program(model: Stack, dtype, device, batch: int, parent=None):
    from tkcc.frontend.program import Program

    gm = torch.fx.symbolic_trace(model)
    lmap = {}
    for n in gm.graph.nodes:
        if n.op in ("call_module", "get_attr") and str(n.target).startswith("blocks."):
            lmap[n.name] = int(str(n.target).split(".")[1])
    x = torch.zeros(batch, WIDTH, dtype=dtype, device=device)
    sig = f"{len(model.blocks)}:{WIDTH}:{dtype}:{device}:{batch}"

    def make(bucket=None, generator=None):
        shape = dict(bucket.shapes).get("x", (batch, WIDTH)) if bucket is not None and bucket.shapes else (batch, WIDTH)
        return (torch.randn(*shape, generator=generator).to(dtype=dtype, device=device),)

    prog = Program(graphs={"forward": gm}, example_inputs={"forward": (x,)}, layer_map={"forward": lmap},
                   num_blocks=len(model.blocks), model=model,
                   fingerprint=hashlib.sha256(sig.encode()).hexdigest()[:16],
                   meta={"device": str(device), "dtype": str(dtype).replace("torch.", ""), "exact": True,
                         "batch": None, "kind": "plain"},
                   make_inputs={"forward": make})
    root = parent or prog
    prog.recapture = lambda k: _program(Stack(list(root.model.blocks)[:k], root.model.head), dtype, device, batch,
                                        root)
    return prog


def make_program(dtype=torch.float32, device="cpu", max_cache_len=None, batch=1, num_blocks=5):
    torch.manual_seed(0)
    with torch.device(device):
        model = Stack([Block(WIDTH) for _ in range(num_blocks)], torch.nn.Linear(WIDTH, 32))
    model = model.to(dtype).eval().requires_grad_(False)
    return _program(model, dtype, torch.device(device), batch)
