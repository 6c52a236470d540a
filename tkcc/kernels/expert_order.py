"""Experts stored in another order (``moe_regroup(expert_order="hot_first")``), without touching the model.

Permuting a model's expert weights in place would change what every other
graph that reads them computes with (the engine's reference, shipped
candidates), and re-pointing the parameters would free storage that captured
CUDA graphs still read. So an op that wants its experts in another order gets
permuted copies, made once per (weights, order) and kept as long as the
weights live: router rows, gate_up and down permuted together, the same
function with the experts renumbered.
"""
from __future__ import annotations

import weakref

import torch

# id(gate_up weight) -> (weak ref to it, key, (router, gate_up, down) permuted): one permuted copy per weight
# tensor, keyed by identity (a tensor's == is elementwise), dropped when the weight is freed
_PERMUTED: dict[int, tuple] = {}


def check_order(order, num_experts: int) -> tuple[int, ...]:
    """``order`` as a tuple, or a clear error when it is not a permutation of the experts."""
    order = tuple(int(i) for i in order)
    if sorted(order) != list(range(num_experts)):
        raise ValueError(f"expert order {list(order)[:8]}... is not a permutation of {num_experts} experts")
    return order


def permuted_experts(router_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, order) -> tuple:
    """(router_w, gate_up, down) with new expert i = old expert ``order[i]``; cached per weights and order."""
    order = tuple(order)
    key = (order, router_w.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
           router_w._version, gate_up._version, down._version)
    ref, old_key, hit = _PERMUTED.get(id(gate_up), (None, None, None))
    if ref is not None and ref() is gate_up and old_key == key:
        return hit  # checked when it was made: the eager path calls this once per layer per token
    order = check_order(order, router_w.shape[0])
    if order == tuple(range(len(order))):
        return router_w, gate_up, down
    idx = torch.tensor(order, device=router_w.device)
    with torch.no_grad():
        hit = tuple(w.detach().index_select(0, idx).contiguous() for w in (router_w, gate_up, down))
    if ref is None or ref() is not gate_up:
        weakref.finalize(gate_up, _PERMUTED.pop, id(gate_up), None)
    _PERMUTED[id(gate_up)] = (weakref.ref(gate_up), key, hit)  # a stale copy (other order or values) is dropped
    return hit
