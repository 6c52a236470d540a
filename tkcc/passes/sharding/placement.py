"""Placements: how one logical tensor of the unsharded graph lives on the ranks.

The sharding pass walks the graph once and gives every value one of these.
They are the vocabulary of tensor parallelism, kept small on purpose:

- ``R``: replicated, every rank holds the whole tensor.
- ``S(dim, blocks)``: rank r holds chunk r of ``dim``. ``blocks`` > 1 means the
  dim is a concatenation of that many equal blocks (fused gate|up of MoE
  experts) and each block is chunked on its own, so that splitting the dim
  back into its blocks keeps every piece aligned across ranks.
- ``P``: partial sums: the logical value is the sum over ranks (the output of
  a row-parallel matmul). An all-reduce turns it into ``R``.
- ``M(mask)``: rows of dim 0 are valid where ``mask`` (a bool node of length
  dim 0) is true and junk (finite) elsewhere: expert parallelism, where each
  rank computes only the token-expert pairs whose expert it holds. Multiplying
  by the mask turns it into ``P``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    kind: str  # "R", "S", "P", "M"
    dim: int = -1
    blocks: int = 1
    mask: object = None  # fx.Node for kind "M"

    def __repr__(self) -> str:
        if self.kind == "S":
            return f"S({self.dim}{', blocks=%d' % self.blocks if self.blocks > 1 else ''})"
        if self.kind == "M":
            return f"M({getattr(self.mask, 'name', self.mask)})"
        return self.kind


R = Placement("R")
P = Placement("P")


def S(dim: int, blocks: int = 1) -> Placement:
    return Placement("S", dim, blocks)


def M(mask) -> Placement:
    return Placement("M", mask=mask)
