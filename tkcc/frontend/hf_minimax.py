"""MiniMax's lightning (linear) attention under capture.

Its layers keep ``S = sum_s r^(t-s) k_s^T v_s`` per head ([batch, heads, head dim,
head dim]), stored through ``MiniMaxCache.get_linear_cache``/``set_linear_cache``.
``LinearCacheMethods`` gives those two methods on tkcc's state buffer
``state_<i>_linear`` (a write is an in-place ``copy_``, so the decode graph
updates ``Program.state`` itself).

transformers runs a step of T tokens as a Python loop: over the tokens when a
state exists (decode), over blocks of ``block_size`` tokens when it does not
(a fresh prompt). Neither is one graph for a symbolic T, so a step of more than
one token runs ``lightning_forward``: the block algorithm of transformers with
one block of T tokens, from the layer's current state (zeros for a fresh
sequence), in tensor ops only. A one-token step is transformers' own forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def cache_class() -> type:
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    return MiniMaxCache


def read_states(cache, layer_idx: int) -> dict[str, torch.Tensor]:
    """The state a ``MiniMaxCache`` kept for layer ``layer_idx`` after a step ({} for an attention layer)."""
    lc = getattr(cache, "linear_cache", None) or []
    t = lc[layer_idx] if layer_idx < len(lc) else None
    return {"linear": t} if isinstance(t, torch.Tensor) else {}


class LinearCacheMethods:
    """``MiniMaxCache``'s methods on a ``tkcc.frontend.hf_cache.PositionedCache``."""

    def get_linear_cache(self, layer_idx: int):
        return self.recurrent_state(layer_idx, "linear")

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.write_state(layer_idx, "linear", linear_cache)


def lightning_block(q, k, v, state, slope_rate, block_slope=None):
    """T tokens of lightning attention from ``state``: (output [B, H, T, D], state after the T tokens).

    q, k, v [B, H, T, D]; state [B, H, D, D]; slope_rate [H, 1, 1] (the decay is ``exp(-slope)`` per token).
    The decays are the ones ``MiniMaxLightningAttention.decay_factors`` computes for a block of T: in the
    slope's dtype (transformers computes them in float32 at init), then in q's. ``block_slope``: the slope
    the state's decay over the block uses (transformers: the module's buffer, in the model dtype)."""
    t = q.shape[2]
    pos = torch.arange(t, device=q.device) + 1
    query_decay = torch.exp(-slope_rate * pos[:, None]).to(q.dtype)
    key_decay = torch.exp(-slope_rate * (t - pos[:, None])).to(q.dtype)
    diagonal = pos[:, None] - pos[None, :]
    diagonal = slope_rate * diagonal[None, None, :, :]
    diagonal_decay = torch.exp(torch.where(diagonal >= 0, -diagonal, float("-inf"))).to(q.dtype)
    intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * diagonal_decay, v)
    inter = torch.matmul(q * query_decay, state)
    block_slope = slope_rate if block_slope is None else block_slope
    new_state = state * torch.exp(-block_slope * t) + torch.matmul((k * key_decay).transpose(-1, -2), v)
    return inter + intra, new_state


def lightning_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                      past_key_values=None, **kwargs):
    """``MiniMaxLightningAttention.forward`` for a step of any length over a cache that always has a state."""
    batch_size, seq_len, _hidden = hidden_states.shape
    if (isinstance(seq_len, int) and seq_len == 1) or past_key_values is None:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask,
                                  past_key_values=past_key_values, **kwargs)
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    if attention_mask is not None:  # transformers' apply_mask_to_padding_states
        qkv = (qkv * attention_mask[:, :, None]).to(qkv.dtype)
    qkv = qkv.reshape(batch_size, seq_len, self.num_attention_heads, 3 * self.head_dim)
    q, k, v = (x.transpose(1, 2) for x in torch.split(qkv, self.head_dim, dim=3))
    state = past_key_values.get_linear_cache(self.layer_idx)
    # the decays from the float32 slope transformers' decay_factors used, as its precomputed buffers were
    slope = self.get_slope_rate().to(device=q.device, dtype=torch.float32)
    out, state = lightning_block(q, k, v, state, slope, block_slope=self.slope_rate)
    out = out.transpose(1, 2).reshape(batch_size, seq_len, self.num_attention_heads * self.head_dim)
    out = self.norm(out)
    out = F.sigmoid(self.output_gate(hidden_states)) * out
    out = self.out_proj(out)
    past_key_values.set_linear_cache(self.layer_idx, state)
    return out, state
