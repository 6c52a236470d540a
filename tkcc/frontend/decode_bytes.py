"""Bytes one batch-1 decode token must move: the numerator of BENCH.md's floor (floor = bytes / bandwidth).

Weights: every parameter once, except the embedding table (one row is read,
unless the LM head shares it) and routed experts (a 3-D ``[experts, ...]``
parameter under ``.experts.``, and a 2-D one with as many rows, their biases: the
``num_experts_per_tok`` experts chosen, of all). Shared experts, dense layers and routers count whole. State: what the
layout says a step at that context must read (``tkcc.frontend.kv_cache.state_bytes``:
keys and values of the positions attended to, recurrent states read and written).
"""
from __future__ import annotations


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode token reads."""
    cfg = model.config.get_text_config()
    emb = model.get_input_embeddings().weight
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    top_k = getattr(cfg, "num_experts_per_tok", None)
    n_experts = next((p.shape[0] for name, p in model.named_parameters()
                      if ".experts." in f".{name}" and p.dim() == 3), None)
    total = 0
    for name, p in model.named_parameters():
        if p is emb and not tied:
            total += p.shape[1] * p.element_size()
            continue
        b = p.numel() * p.element_size()
        if top_k and ".experts." in f".{name}" and p.dim() >= 2 and p.shape[0] == n_experts:
            b = b * int(top_k) // p.shape[0]  # (gpt-oss's [E, 2I] / [E, H] expert biases too: the k chosen rows)
        total += b
    return total


def bytes_per_token(model, context: int, layout=None) -> dict:
    """{"weights", "state", "total"} bytes for one decode token at ``context`` (batch 1). ``layout``: the
    model's state layout (``probe_layout``'s, or a Program's ``state.layout``); probed when not given."""
    from tkcc.frontend.kv_cache import state_bytes

    if layout is None:
        from tkcc.frontend.hf_cache import probe_layout

        layout, _api = probe_layout(model, 1)
    w = weight_bytes_per_token(model)
    s = state_bytes(layout, context)
    return {"weights": w, "state": s, "total": w + s}
