"""Proposer: anything that turns past measurements into new candidates.

Two kinds sit behind this one interface: the built-in search over registered
passes' parameter spaces (``tkcc.agents.search``) and an external coding
agent given the raw material and a goal (``tkcc.agents.external``). The
campaign treats their candidates the same way: build, validate, measure.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tkcc.passes.plan import PassPlan


@dataclass
class Candidate:
    """A plan to compile, or a modified source artifact to load as is."""

    proposer: str
    plan: PassPlan = field(default_factory=PassPlan)
    artifact_dir: Path | None = None  # set when the proposer returns ready source
    note: str = ""
    eager: bool = False  # the model's own eager forward (no plan): what tkcc.compile must never be slower than
    compare: str = ""    # a forward measured beside, never shipped: "inductor" (torch.compile of the eager forward)
    serving: bool = False  # what a live server serves now: a campaign that cannot measure it replaces it with nothing

    @property
    def key(self) -> str:
        """What names the candidate in the store: the plan hash, or the artifact's own hash."""
        if self.eager:
            return "eager"
        if self.compare:
            return self.compare
        if self.artifact_dir is not None:
            from tkcc.agents.external import source_hash

            return "src-" + source_hash(self.artifact_dir)
        return self.plan.hash()


@dataclass
class Outcome:
    """What a proposer learns from: a candidate's plan and its measured objective (None if it failed)."""

    plan: PassPlan
    objective: float | None
    tier: str
    key: str = ""        # the candidate's key, when it is not its plan's hash (eager, agent source)
    start: bool = False  # a starting reference (the model's eager forward), not a plan the search proposed
    pending: bool = False  # proposed and queued, not measured yet: a proposer proposing ahead must not repeat it


class Proposer(Protocol):
    name: str

    def propose(self, n: int, history: list[Outcome]) -> list[Candidate]:
        """About n new candidates, given every outcome so far (any tier): one round, whose best the campaign
        promotes. n is what the batch asks; a proposer whose design is one round of another size may return that
        (the built-in search's screening: every pass alone)."""
        ...
