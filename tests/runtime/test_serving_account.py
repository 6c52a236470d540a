"""The worker's memory ledger and ``serving`` (``tkcc.runtime.worker._Single``): a candidate loaded as what serves
already is never charged for what its first load leaves, even when its compiles were discovered first (on a GPU
engine ``prepare`` runs ``discover`` before the load, and discover opens the account); one loaded without it is.
The worker's op routing is real; its engine core and its memory are stand-ins, so the measurement is exact."""
from __future__ import annotations

import pytest
import torch

from tkcc.runtime import candidates as cands
from tkcc.runtime import global_state
from tkcc.runtime.memory_ledger import Ledger
from tkcc.runtime.worker import _Single

SPEC = {"plan": [{"name": "dce"}]}


class _Core:
    device = torch.device("cpu")
    max_bytes = 1 << 20
    device_memory = None  # no device: the ledger here is the stand-in's

    def __init__(self, held: list):
        self.candidates, self.held = {}, held

    def op_discover(self, spec, tier):
        return {"compiles": []}

    def op_load(self, spec, tier, serving=False):
        cid = cands.candidate_id(spec, self.max_bytes)
        self.candidates[cid] = spec
        self.held[0] += 300  # what the first load leaves: compiled kernels, CUDA modules loaded once
        return {"candidate": cid, "tier": tier}

    def op_unload(self, candidate):
        self.candidates.pop(candidate)
        return {"unloaded": True}


def _worker():
    held = [1000]
    w = _Single.__new__(_Single)
    w.core, w.found, w.base = _Core(held), None, global_state.take()
    w.ledger = Ledger(lambda: held[0], lambda b, a: f"{a - b} above" if a - b > 64 else "")
    return w


@pytest.mark.parametrize("discover_first", [False, True])
@pytest.mark.parametrize("serving", [False, True])
def test_what_serves_is_not_charged_for_its_first_load_and_anything_else_is(serving, discover_first):
    w = _worker()
    if discover_first:
        w.run("discover", {"spec": SPEC, "tier": "slow"})
    cid = w.run("load", {"spec": SPEC, "tier": "slow", **({"serving": True} if serving else {})})["candidate"]
    out = w.run("unload", {"candidate": cid})
    if serving:
        assert out == {"unloaded": True}
    else:
        assert out["leaked"] == f"candidate {cid}: 300 above" and out["fatal"], out
