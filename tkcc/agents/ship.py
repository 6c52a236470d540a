"""Ship and revert: the shipped history, and reverting a candidate that traffic made slower.

When traffic drifts, the shipped candidate is re-measured on the new workload
side by side with the one shipped before it (and the baseline). If it is now
slower than either by more than the measured noise, the best of them is
swapped back in and the store records why.
"""
from __future__ import annotations

from dataclasses import dataclass

from tkcc.agents.campaign import Evaluator
from tkcc.agents.noise import NoiseModel
from tkcc.agents.proposer import Candidate
from tkcc.agents.store import ExperimentStore
from tkcc.passes.plan import PassPlan


@dataclass
class RecheckResult:
    reverted: bool
    reason: str
    objectives: dict[str, float | None]  # candidate key -> objective on the new workload
    serving: str  # candidate key serving after the recheck


def shipped_chain(store: ExperimentStore, campaign_id: int) -> list[dict]:
    """Ship events still in force, oldest first (a revert pops the chain back to its target)."""
    chain: list[dict] = []
    for ev in store.ships(campaign_id):
        if ev["action"] == "ship":
            chain.append(ev)
        elif ev["action"] == "revert":
            while chain and chain[-1]["candidate"] != ev["candidate"]:
                chain.pop()
    return chain


def recheck_and_revert(store: ExperimentStore, campaign_id: int, evaluator: Evaluator, noise: NoiseModel,
                       tier: str = "slow", serving: bool = False) -> RecheckResult:
    """Re-measure the shipped candidate, its predecessor and the baseline on the evaluator's (new) workload.

    ``serving``: the shipped candidate is what a live server serves now. It is loaded as the server's own
    forward (``Candidate.serving``: the engine opens no isolation account for it), as a campaign's start is.
    Charged as a fresh candidate, the memory its first measurement on the new shapes warms failed the
    engine's host-memory audit (+206 MiB against 195 allowed) on the H200, and the recheck reverted a
    forward that served correctly to the slower empty plan."""
    chain = shipped_chain(store, campaign_id)
    if not chain:
        return RecheckResult(False, "nothing shipped yet", {}, "")
    current = chain[-1]
    rivals = [current] + ([chain[-2]] if len(chain) > 1 else [])
    base_key = PassPlan().hash()
    if all(r["candidate"] != base_key for r in rivals):
        rivals.append({"candidate": base_key, "plan": []})
    wfp = evaluator.workload_fingerprint()
    objs: dict[str, float | None] = {}
    for r in rivals:
        cand = Candidate("recheck", PassPlan.from_json(r["plan"]), serving=serving and r is current)
        ahash = evaluator.build(cand, tier)
        res = evaluator.measure(ahash, tier)
        objs[r["candidate"]] = res.objective if res.verdict == "measured" else None
        store.record(campaign_id, candidate=r["candidate"], plan=r["plan"], proposer="recheck", workload_fp=wfp,
                     tier=tier, verdict=res.verdict, objective=res.objective, measurement=res.measurement,
                     artifact_hash=ahash, reason=res.reason)
    cur = objs[current["candidate"]]
    best_key = max((k for k in objs if objs[k] is not None), key=lambda k: objs[k], default=None)
    if best_key is None:
        return RecheckResult(False, "no candidate measured on the new workload", objs, current["candidate"])
    if cur is not None and (best_key == current["candidate"] or not noise.decide(objs[best_key], cur)[0]):
        return RecheckResult(False, f"shipped {current['candidate']} still best within noise on workload {wfp}",
                             objs, current["candidate"])
    target = next(r for r in rivals if r["candidate"] == best_key)
    why = (f"on workload {wfp} shipped {current['candidate']} measures {cur if cur is not None else 'invalid'}, "
           f"{best_key} measures {objs[best_key]:.4g} (threshold {noise.threshold() * 100:.2f}%); reverting")
    evaluator.ship(evaluator.build(Candidate("revert", PassPlan.from_json(target["plan"])), tier))
    store.record_ship(campaign_id, best_key, target["plan"], objs[best_key], "revert", why)
    return RecheckResult(True, why, objs, best_key)
