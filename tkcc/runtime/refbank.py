"""Reference results kept per tier and shape, so the reference forward runs once per input draw, not per candidate.

Validation holds a candidate to the reference (the tier's captured baseline) on
inputs drawn after the candidate was loaded. Most of its cost was the
reference's side: its forward on each drawn input (and, on a GPU in exact mode,
a second run to see whether it reproduces its own bits there). The reference
never changes, so its result for one draw is the same for every candidate.

The bank keeps, per (tier, bucket), up to ``entries`` draws: the seed the
inputs (and the random KV-cache context) are drawn from, the reference's
outputs, what it wrote to the cache (as the elements that changed), and
whether it reproduced itself. A validation takes an entry that this candidate
has not been validated on, chosen by the validation's seed (drawn after the
candidate loaded); an entry serves ``uses`` validations and is then replaced by
a fresh draw. The inputs stay fresh in the sense issue 20 asked for: no
candidate can have seen them before its own validation, none is validated
twice on the same draw, and the timed calls of every measured bucket are still
checked on inputs no one has seen (``EngineCore._sampler``).

Trial processes are forked from the worker after the bank has entries; each
trial wipes its copy first (``wipe``), so no candidate's process holds a
reference output to return.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_ENTRY_BYTES = 256 << 20  # a draw whose outputs are larger than this is not kept (a long prefill's logits)


@dataclass
class Entry:
    seed: int
    outputs: list[torch.Tensor]
    state_diff: list[tuple[torch.Tensor, torch.Tensor]]  # per state buffer: (flat indices, values) it wrote
    reproducible: bool | None = None  # exact mode on a GPU: the reference reran to the same bits here
    uses: int = 0
    seen: set = field(default_factory=set)  # candidates validated on it

    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.outputs)
                + sum(i.numel() * i.element_size() + v.numel() * v.element_size() for i, v in self.state_diff))

    def state_after(self, before: list[torch.Tensor]) -> list[torch.Tensor]:
        """The state the reference left, rebuilt from the state before the call (freshly drawn again)."""
        out = []
        for b, (idx, vals) in zip(before, self.state_diff):
            a = b.detach().clone()
            if idx.numel():
                a.view(-1)[idx] = vals
            out.append(a)
        return out


def state_diff(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per buffer, the flat indices where ``after`` differs from ``before`` (NaN-aware) and the new values."""
    out = []
    for b, a in zip(before, after):
        fb, fa = b.reshape(-1), a.reshape(-1)
        ne = fa != fb
        if fa.is_floating_point():
            ne &= ~(torch.isnan(fa) & torch.isnan(fb))
        idx = ne.nonzero().reshape(-1)
        out.append((idx, fa[idx].clone()))
    return out


class ReferenceBank:
    def __init__(self, entries: int = 2, uses: int = 8):
        self.entries, self.uses = int(entries), int(uses)
        self.banks: dict[tuple[str, str], list[Entry]] = {}
        self.stats = {"hits": 0, "misses": 0}

    def take(self, tier: str, key: str, candidate: str, pick: int) -> Entry | None:
        """An entry of (tier, bucket) ``candidate`` was not validated on, still within its uses; or None (then
        draw fresh and ``add`` the result). ``pick``: a number drawn with the validation's seed."""
        fresh = [e for e in self.banks.get((tier, key), []) if candidate not in e.seen and e.uses < self.uses]
        if not fresh:
            self.stats["misses"] += 1
            return None
        e = fresh[pick % len(fresh)]
        e.uses += 1
        e.seen.add(candidate)
        self.stats["hits"] += 1
        return e

    def add(self, tier: str, key: str, candidate: str, entry: Entry) -> bool:
        """Keep a fresh draw's reference result (counted as this candidate's use); False when it is too big."""
        if entry.nbytes() > MAX_ENTRY_BYTES:
            return False
        entry.uses, entry.seen = 1, {candidate}
        bank = [e for e in self.banks.get((tier, key), []) if e.uses < self.uses]
        bank.append(entry)
        self.banks[(tier, key)] = bank[-self.entries:]
        return True

    def wipe(self) -> None:
        """Zero every kept tensor and forget them: what a forked trial process does first."""
        with torch.no_grad():
            for bank in self.banks.values():
                for e in bank:
                    for t in e.outputs:
                        t.zero_()
                    for i, v in e.state_diff:
                        v.zero_()
        self.banks.clear()

    def to_json(self) -> dict:
        return {**self.stats, "entries": sum(len(b) for b in self.banks.values()), "uses": self.uses}
