"""The one greedy-decoding loop: on a Program's prefill/decode graphs, or on any pair of forwards like them.

Everything that decodes greedily uses it: ``tkcc.compile``'s ``generate`` and ``stream``, the server, the
engine's ``generate``, golden records and checks (teacher-forced), the engine's greedy validation, the
sharded-layout check and its rank workers.

``forwards`` swaps in other callables per phase (a compiled artifact's forward, the eager StepModule, a
replayed CUDA graph) with the graph's signature, ``(input_ids [B, T], cache_position [T]) -> logits
[B, T, vocab]`` (or a structure whose first tensor is the logits), so the same loop drives the reference
and every candidate.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.utils._pytree as pytree

from tkcc.errors import TkccError
from tkcc.kernels.argmax import argmax
from tkcc.frontend.program import Program

PHASES = ("prefill", "decode")


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
            logits_out.append(last.to(torch.float32, copy=True))  # a replayed step's buffer is reused
    out = torch.stack(tokens, dim=1)
    return (out, torch.stack(logits_out, dim=1)) if return_logits else out


def greedy_steps(program: Program, prompt_ids: torch.Tensor, new_tokens: int,
                 forwards: dict[str, Callable] | None = None, *, force: torch.Tensor | None = None,
                 on_prompt: Callable[[torch.Tensor], None] | None = None
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The one greedy loop, one token at a time: yields (token [B], the logits [B, vocab] that chose it).

    A consumer that stops iterating (a stop sequence, a cancelled request) stops the decoding there; the
    KV cache is reset at the start of every call, so nothing carries over to the next one. ``force`` and
    ``on_prompt``: see ``greedy_loop``. The logits are valid until the next step (a self-feeding step reuses
    its buffer): copy them to keep them.
    """
    fwd = {p: program.graphs[p] for p in PHASES if p in program.graphs}
    fwd.update(forwards or {})
    missing = [p for p in PHASES if p not in fwd]
    if missing:
        raise TkccError(f"greedy() needs the phases prefill and decode; missing {missing} "
                        f"(this Program has {program.phases})")
    _check_prompt(prompt_ids)
    meta = program.meta
    batch = prompt_ids.shape[0]
    if batch != meta.get("batch", batch):
        raise TkccError(f"prompt batch {batch} != the Program's batch {meta['batch']} (capture with batch={batch})")
    device = torch.device(meta.get("device", prompt_ids.device))
    return greedy_loop(fwd, prompt_ids.to(device=device), new_tokens, reset=program.reset_state,
                       max_cache_len=meta.get("max_cache_len"), prefill_chunk=meta.get("prefill_chunk"),
                       force=force, on_prompt=on_prompt)


def greedy_loop(forwards: dict[str, Callable], prompt_ids: torch.Tensor, new_tokens: int, *,
                reset: Callable[[], None] | None = None, max_cache_len: int | None = None,
                prefill_chunk: int | None = None, force: torch.Tensor | None = None,
                on_prompt: Callable[[torch.Tensor], None] | None = None
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``greedy_steps`` on a pair of forwards without a Program (``forwards`` holds both phases).

    ``reset``: called first (the cache a new sequence starts from). ``prefill_chunk``: prompt tokens per
    prefill call (the whole prompt by default; 1 feeds it token by token). ``force`` [B, >= new_tokens-1]:
    teacher forcing, decode step i is fed ``force[:, i]`` instead of the token chosen before it; the
    yielded tokens are still the forward's own choices. ``on_prompt``: called with the logits of each
    prompt chunk, [B, chunk, vocab], in order (golden records keep every prompt position's logits).
    """
    missing = [p for p in PHASES if p not in forwards]
    if missing:
        raise TkccError(f"greedy_loop() needs forwards for the phases prefill and decode; missing {missing}")
    _check_prompt(prompt_ids)
    batch, plen = prompt_ids.shape
    if new_tokens < 1:
        raise TkccError(f"new_tokens={new_tokens}: must be at least 1")
    if max_cache_len is not None and plen + new_tokens - 1 > max_cache_len:
        raise TkccError(f"prompt of {plen} + {new_tokens} new tokens needs {plen + new_tokens - 1} cache positions; "
                        f"max_cache_len is {max_cache_len}")
    if force is not None and (force.dim() != 2 or force.shape[0] != batch or force.shape[1] < new_tokens - 1):
        raise TkccError(f"force must be [batch={batch}, >= {new_tokens - 1}] token ids (one per decode step), "
                        f"got shape {list(force.shape)}")
    prompt_ids = prompt_ids.to(dtype=torch.long)
    if force is not None:
        force = force.to(device=prompt_ids.device, dtype=torch.long)
    chunk = int(prefill_chunk or plen)
    if chunk < 1:
        raise TkccError(f"prefill_chunk={prefill_chunk}: must be at least 1")
    return _steps(forwards, prompt_ids, new_tokens, reset, chunk, force, on_prompt)


def _check_prompt(prompt_ids) -> None:
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
        shape = list(prompt_ids.shape) if isinstance(prompt_ids, torch.Tensor) else type(prompt_ids).__name__
        raise TkccError(f"prompt_ids must be [batch, length>=1], got shape {shape}")


def _logits(out) -> torch.Tensor:
    """A forward's logits: the output itself, or the first tensor of a structure (a tuple, a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise TkccError(f"a forward returned {type(out).__name__} with no tensor in it; greedy decoding needs logits")


def _steps(fwd, prompt_ids, new_tokens, reset, chunk, force, on_prompt):
    """The loop itself. The token and the position stay on the device (the position advances there), so no
    step waits for the one before: the host queues step i+1 while the device runs step i."""
    if reset is not None:
        reset()
    device = prompt_ids.device
    plen = prompt_ids.shape[1]
    with torch.no_grad():
        if plen == 1:
            logits = _logits(fwd["decode"](prompt_ids, torch.zeros(1, dtype=torch.long, device=device)))
            if on_prompt is not None:
                on_prompt(logits)
        else:  # in chunks where one whole-prompt step would need too much memory (Program.meta["prefill_chunk"])
            for start in range(0, plen, chunk):
                end = min(plen, start + chunk)
                logits = _logits(fwd["prefill"](prompt_ids[:, start:end], torch.arange(start, end, device=device)))
                if on_prompt is not None:
                    on_prompt(logits)
        last = logits[:, -1]
        pos = torch.full((1,), plen, dtype=torch.long, device=device)
        # a decode forward replayed from a CUDA graph offers ``tkcc_greedy`` (graph_replay.GreedyStep): one
        # self-feeding replay a token, the token and position kept on the device
        step = getattr(fwd["decode"], "tkcc_greedy", None) if force is None else None
        tok = argmax(last)
        for i in range(new_tokens):
            yield tok, last
            if i + 1 == new_tokens:
                break
            if step is not None:
                tok, last = step(tok[:, None], pos if i == 0 else None, position=plen + i, continued=i > 0)
                continue
            feed = tok[:, None] if force is None else force[:, i:i + 1]
            logits = _logits(fwd["decode"](feed, pos))
            last = logits[:, -1]
            tok = argmax(last)
            pos = pos + 1
