"""Rotary embedding: the cos/sin table of a step (``LlamaRotaryEmbedding.forward``), full or scaled.

The table is computed once per step from ``inv_freq`` and the positions, and shared by every layer; the
rewrite names it ``tkcc.rotary_cos_sin`` (same arithmetic, bit-exact), so that the attention rewrite can
see what the rotation is (which ``inv_freq``, which positions, which ``attention_scaling``) and compute it
inside the fused attention kernel instead; once every layer's attention is fused the table is dead code.
Scaled variants whose scaling lives in ``inv_freq`` (Llama 3, linear, dynamic-at-capture) are this same
pattern with another buffer; YaRN-style ``attention_scaling`` is its ``scale``.
"""
from __future__ import annotations

import torch

from tkcc.passes.lower.pattern import Rewrite

SCALE = 0.8125  # sentinel


def cos_sin(inv_freq, position_ids, *, scale, dtype):
    """As transformers writes it (autocast off: fp32 throughout, then rounded to the activations' dtype)."""
    inv_freq_expanded = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(
        dtype=torch.float, device=position_ids.device)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * scale
    sin = emb.sin() * scale
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def _to_op(inv_freq, position_ids, *, scale, dtype):
    return torch.ops.tkcc.rotary_cos_sin(inv_freq, position_ids, scale, dtype)


def _check(m) -> str | None:
    inv, pos = m.val(0), m.val(1)
    if inv.dim() != 1 or not inv.is_floating_point():
        return f"inv_freq {tuple(inv.shape)} {inv.dtype} is not a float vector"
    if pos.dim() != 2 or pos.dtype not in (torch.int64, torch.int32):
        return f"positions {tuple(pos.shape)} {pos.dtype} are not [batch, tokens] integers"
    return None


def _example(inv_dtype):
    def example(dt):
        return ((torch.empty(12, dtype=inv_dtype or dt), torch.empty(1, 1, dtype=torch.int64)),
                {"scale": SCALE, "dtype": dt})
    return example


# inv_freq kept in fp32 (a model loaded in its dtype), or cast with the model (``model.to(torch.bfloat16)``)
REWRITES = [
    Rewrite("rotary_cos_sin", cos_sin, _to_op, _example(torch.float32), region="rotary", exact=True, check=_check),
    Rewrite("rotary_cos_sin[inv_freq in the model dtype]", cos_sin, _to_op, _example(None), region="rotary",
            exact=True, check=_check),
]
