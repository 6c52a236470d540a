"""Greedy decoding of up to B sequences that come and go, on a slots Program (``tkcc.frontend.slots``).

``greedy_steps`` is the loop for one batch that starts and ends together.
``SlotBatch`` is its counterpart for continuous batching: ``admit(prompt)``
prefills a sequence into a free slot and returns its first token,
``step()`` advances every live slot by one token in one ``decode_slots``
call, and ``release(slot)`` frees a slot the moment its sequence is done, so the
next prompt can take it while the others keep decoding. The server's scheduler
drives it; ``generate_slots`` drives it for a fixed set of prompts (what
``CompiledModel.generate`` does on a slots model).

The step's inputs stay on the device: each slot's next input token is the
argmax the step itself produced, and its position advances there, so no step
waits on the host. A free slot is fed token 0 at position 0; it writes only its
own row, which its next occupant's admission overwrites.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from tkcc.errors import TkccError
from tkcc.frontend.slots import PHASE


class SlotBatch:
    """The slots of one slots Program, decoded greedily with ``forwards`` (phase -> callable)."""

    def __init__(self, program, forwards: dict[str, Callable]):
        n = int(program.meta.get("slots") or 0)
        missing = [p for p in ("prefill", "decode", PHASE) if p not in forwards]
        if n < 2 or missing:
            raise TkccError(f"SlotBatch needs a slots Program (tkcc.frontend.slots.capture_slots) and forwards for "
                            f"prefill, decode and {PHASE}; got slots={n}, missing {missing}")
        self.program, self.slots = program, n
        self.cache = program.state
        self.max_len = int(program.meta["max_cache_len"])
        self.device = torch.device(program.meta.get("device", "cpu"))
        self.chunk = program.meta.get("prefill_chunk")
        self.forwards = forwards
        self.tokens = torch.zeros((n, 1), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((n,), dtype=torch.long, device=self.device)
        self.live = torch.zeros((n,), dtype=torch.long, device=self.device)
        self.free = list(range(n))
        self.used: set[int] = set()

    @property
    def num_live(self) -> int:
        return len(self.used)

    def rebind(self, forwards: dict[str, Callable]) -> None:
        """Decode with other forwards of the same Program from now on (only while no slot is live)."""
        if self.used:
            raise TkccError(f"cannot change the forwards of a SlotBatch while slots {sorted(self.used)} are live")
        self.forwards = forwards

    def admit(self, prompt: list[int] | torch.Tensor) -> tuple[int, torch.Tensor]:
        """Prefill ``prompt`` into the lowest free slot: (slot, its first token as a 0-dim device tensor)."""
        ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1).to(self.device)
        plen = ids.shape[1]
        if not self.free:
            raise TkccError(f"all {self.slots} slots are live; release one first")
        if not 1 <= plen <= self.max_len:
            raise TkccError(f"a prompt of {plen} tokens does not fit the KV cache ({self.max_len} positions)")
        slot = self.free.pop(0)
        with torch.no_grad():
            if plen == 1:  # as greedy_steps does: a one-token prompt is a decode step at position 0
                logits = self.forwards["decode"](ids, torch.zeros(1, dtype=torch.long, device=self.device))
            else:
                chunk = int(self.chunk or plen)
                for start in range(0, plen, chunk):
                    end = min(plen, start + chunk)
                    logits = self.forwards["prefill"](ids[:, start:end], torch.arange(start, end, device=self.device))
            self.cache.admit(slot, plen)
            tok = logits[0, -1].argmax(-1)
            self.tokens[slot, 0] = tok
            self.positions[slot] = plen
            self.live[slot] = 1
        self.used.add(slot)
        return slot, tok

    def step(self) -> torch.Tensor:
        """One decode step of every slot: the next token of each ([slots] on the device; free slots' are junk)."""
        with torch.no_grad():
            logits = self.forwards[PHASE](self.tokens, self.positions)
            nxt = logits[:, -1].argmax(-1)
            self.tokens.copy_(nxt[:, None])
            # a live slot moves on; one whose sequence just used the last position stays there (its extra
            # step, if the host reads one step late, writes only its own row)
            self.positions.add_(self.live).clamp_(max=self.max_len - 1)
        return nxt

    def release(self, slot: int) -> None:
        """Free ``slot`` now: the next ``admit`` may take it."""
        if slot not in self.used:
            raise TkccError(f"slot {slot} is not live")
        self.used.discard(slot)
        self.live[slot] = 0
        self.positions[slot] = 0
        self.free.append(slot)
        self.free.sort()


def generate_slots(program, forwards: dict[str, Callable], prompt_ids: torch.Tensor,
                   new_tokens: int) -> Iterator[torch.Tensor]:
    """Greedy decoding of the rows of ``prompt_ids`` [n, P] (n <= slots) together: yields each step's [n] tokens."""
    n, plen = prompt_ids.shape if prompt_ids.dim() == 2 else (0, 0)
    slots = int(program.meta.get("slots") or 0)
    if prompt_ids.dim() != 2 or not 1 <= n <= slots or plen < 1:
        raise TkccError(f"prompt_ids must be [n, length>=1] with n in 1..{slots} (the slots of this model), got "
                        f"shape {list(prompt_ids.shape)}")
    if new_tokens < 1:
        raise TkccError(f"new_tokens={new_tokens}: must be at least 1")
    max_len = int(program.meta["max_cache_len"])
    if plen + new_tokens - 1 > max_len:
        raise TkccError(f"prompt of {plen} + {new_tokens} new tokens needs {plen + new_tokens - 1} cache positions; "
                        f"max_cache_len is {max_len}")
    batch = SlotBatch(program, forwards)
    rows = [batch.admit(prompt_ids[i]) for i in range(n)]
    idx = torch.tensor([s for s, _ in rows], device=batch.device)
    yield torch.stack([t for _, t in rows])
    for _ in range(new_tokens - 1):
        yield batch.step()[idx]
