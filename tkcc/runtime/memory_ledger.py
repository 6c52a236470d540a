"""Who is charged for memory a candidate left in the worker (``--isolation inprocess``: every GPU engine).

Each candidate's account opens before its first load, with a measurement of what the worker holds then
(host RSS after ``gc`` and ``malloc_trim``; device memory net of the engine's own caches:
``tkcc.runtime.device_memory``), and closes when it is gone: unloaded, or refused before it was ever
registered (a build that raised, e.g. after stashing a tensor and running out of memory). Whatever is held
above the opening measurement then is that candidate's, and no one else's: the next candidate's account
opens on a fresh measurement, so an honest candidate is never charged for an earlier one's leak, and a kept
candidate's memory is in every later opening.

A charge first tries to give the memory back: the modules the candidate's load added (``tkcc_user_*``) are
dropped with their globals, and the worker is measured again. If that frees it the charge is ``restored``
(the candidate fails as ``memory``; the worker goes on); if not, the worker cannot be proven clean and
restarts.

Windows must nest: an account is charged only when no account opened after it is still open (with the
``load`` RPC a client can interleave two candidates' loads and unloads; then whose bytes are whose cannot be
told, and the earlier one is not charged).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Charge:
    candidate: str
    reason: str
    restored: bool = False  # dropping its modules gave the memory back: the worker goes on
    dropped: list = field(default_factory=list)


class Ledger:
    """``measure()`` -> an opaque measurement; ``compare(before, after)`` -> '' or what grew, in words;
    ``modules()`` -> names of the modules candidates added; ``drop(names)`` drops them (and their globals)."""

    def __init__(self, measure, compare, modules=lambda: set(), drop=lambda names: None):
        self.measure, self.compare, self.modules, self.drop = measure, compare, modules, drop
        self.open: dict[str, tuple] = {}  # candidate -> (measurement, modules before it), in opening order
        self.skipped: list[str] = []      # candidates not charged (windows that did not nest)

    def opened(self, cid: str) -> None:
        """Before ``cid``'s first load (a no-op while its account is open)."""
        if cid not in self.open:
            self.open[cid] = (self.measure(), set(self.modules()))

    def forget(self, cid: str) -> None:
        self.open.pop(cid, None)

    def charge(self, cid: str) -> Charge | None:
        """Close ``cid``'s account now that it is gone: a Charge if it left memory behind, else None."""
        if cid not in self.open:
            return None
        later = list(self.open)[list(self.open).index(cid) + 1:]
        before, mods = self.open.pop(cid)
        if later:
            self.skipped.append(cid)
            return None
        why = self.compare(before, self.measure())
        if not why:
            return None
        added = sorted(set(self.modules()) - mods)
        if added:
            self.drop(added)
            again = self.compare(before, self.measure())
            if not again:
                return Charge(cid, f"{why}; freed by dropping its modules' globals ({', '.join(added)})", True, added)
            why = again
        return Charge(cid, why, False, added)
