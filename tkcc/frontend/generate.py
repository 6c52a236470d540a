"""Greedy generation on a Program's prefill/decode graphs (golden checks, the engine, benchmarks).

``forwards`` swaps in other callables per phase (a compiled artifact's
forward, the eager StepModule) with the same signature as the graph, so the
same loop drives the reference and every candidate.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from tkcc.errors import TkccError
from tkcc.frontend.program import Program


def greedy(program: Program, prompt_ids: torch.Tensor, new_tokens: int,
           forwards: dict[str, Callable] | None = None, return_logits: bool = False):
    """Generate ``new_tokens`` tokens greedily after ``prompt_ids`` [B, P].

    Resets the KV cache, runs "prefill" on the prompt (positions 0..P-1; a
    one-token prompt goes through "decode"), then one "decode" per further
    token, feeding back the argmax. Returns tokens [B, new_tokens] (int64, on
    the program's device), and with ``return_logits`` also the logits that
    chose each token, [B, new_tokens, vocab] in float32.
    """
    tokens, logits_out = [], []
    for tok, last in greedy_steps(program, prompt_ids, new_tokens, forwards):
        tokens.append(tok)
        if return_logits:
            logits_out.append(last.float())
    out = torch.stack(tokens, dim=1)
    return (out, torch.stack(logits_out, dim=1)) if return_logits else out


def greedy_steps(program: Program, prompt_ids: torch.Tensor, new_tokens: int,
                 forwards: dict[str, Callable] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The one greedy loop, one token at a time: yields (token [B], the logits [B, vocab] that chose it).

    A consumer that stops iterating (a stop sequence, a cancelled request) stops the decoding there; the
    KV cache is reset at the start of every call, so nothing carries over to the next one. The logits are
    valid until the next step (a self-feeding step reuses its buffer): copy them to keep them.
    """
    fwd = {p: program.graphs[p] for p in ("prefill", "decode") if p in program.graphs}
    fwd.update(forwards or {})
    missing = [p for p in ("prefill", "decode") if p not in fwd]
    if missing:
        raise TkccError(f"greedy() needs the phases prefill and decode; missing {missing} "
                        f"(this Program has {program.phases})")
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
        raise TkccError(f"prompt_ids must be [batch, length>=1], got shape {list(prompt_ids.shape)}")
    batch, plen = prompt_ids.shape
    meta = program.meta
    if batch != meta.get("batch", batch):
        raise TkccError(f"prompt batch {batch} != the Program's batch {meta['batch']} (capture with batch={batch})")
    max_len = meta.get("max_cache_len")
    if new_tokens < 1:
        raise TkccError(f"new_tokens={new_tokens}: must be at least 1")
    if max_len is not None and plen + new_tokens - 1 > max_len:
        raise TkccError(f"prompt of {plen} + {new_tokens} new tokens needs {plen + new_tokens - 1} cache positions; "
                        f"max_cache_len is {max_len}")
    device = torch.device(meta.get("device", prompt_ids.device))
    prompt_ids = prompt_ids.to(device=device, dtype=torch.long)
    return _steps(program, fwd, prompt_ids, plen, new_tokens, device)


def _steps(program, fwd, prompt_ids, plen, new_tokens, device):
    """The loop itself. The token and the position stay on the device (the position advances there), so no
    step waits for the one before: the host queues step i+1 while the device runs step i."""
    program.reset_state()
    chunk = int(program.meta.get("prefill_chunk") or plen)
    with torch.no_grad():
        if plen == 1:
            logits = fwd["decode"](prompt_ids, torch.zeros(1, dtype=torch.long, device=device))
        else:  # in chunks where one whole-prompt step would need too much memory (Program.meta["prefill_chunk"])
            for start in range(0, plen, chunk):
                end = min(plen, start + chunk)
                logits = fwd["prefill"](prompt_ids[:, start:end], torch.arange(start, end, device=device))
        last = logits[:, -1]
        pos = torch.full((1,), plen, dtype=torch.long, device=device)
        # a decode forward that is one self-feeding step (the fused decode step) offers ``tkcc_greedy``: it keeps
        # the token and position on the device itself and picks its layout by the position the host knows
        step = getattr(fwd["decode"], "tkcc_greedy", None)
        tok = last.argmax(-1)
        for i in range(new_tokens):
            yield tok, last
            if i + 1 == new_tokens:
                break
            if step is not None:
                tok, last = step(tok[:, None], pos if i == 0 else None, position=plen + i, continued=i > 0)
                continue
            logits = fwd["decode"](tok[:, None], pos)
            last = logits[:, -1]
            tok = last.argmax(-1)
            pos = pos + 1
