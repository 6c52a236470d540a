"""The gated delta rule (Qwen3-Next, Qwen 3.5, OLMo hybrid's linear-attention layers) for a step of any length.

transformers computes a prompt's delta-rule outputs in chunks of 64 tokens, a
Python loop over ``T / 64`` chunks: not one graph for a symbolic ``T``.
``chunk_gated_delta_rule`` is the same algorithm (transformers'
``torch_chunk_gated_delta_rule``, step by step, in float32) with the whole
step as one chunk: the within-chunk system solved by a triangular solve, then
one read and one update of the state. Its memory grows as ``T^2`` per head, so
such a model's prompts go in steps of ``PREFILL_CHUNK`` tokens (``Program.meta
["prefill_chunk"]``): transformers' own chunks, each continuing from the state
the last one left, as its scan does. A one-token step is transformers' own
recurrent form.
"""
from __future__ import annotations

import torch

from tkcc.kernels.gated_delta import l2norm

PREFILL_CHUNK = 64  # transformers' chunk_size


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **kwargs):
    """``torch_chunk_gated_delta_rule``'s signature and result, over one chunk of all T tokens.

    query, key [B, T, H, Dk]; value [B, T, H, Dv]; g, beta [B, T, H]; initial_state [B, H, Dk, Dv] or None.
    Returns (output [B, T, H, Dv] in query's dtype, the state after the T tokens in float32, or None)."""
    dtype = query.dtype
    batch, _t, _h, k_dim = key.shape
    heads, v_dim = value.shape[-2:]
    q, k, v, beta, decay = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                            for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    t = q.shape[2]
    upper = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    cum = decay.cumsum(dim=-1)  # log of the decay from the step's start to each token
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    if initial_state is None:
        state = torch.zeros((batch, heads, k_dim, v_dim), dtype=new_values.dtype, device=new_values.device)
    else:
        state = initial_state.to(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    v_new = new_values - k_cumdecay @ state
    out = q @ state + intra @ v_new
    state = state * cum[..., -1].exp()[..., None, None] + k.transpose(-1, -2) @ v_new
    out = out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return out, (state if output_final_state else None)
