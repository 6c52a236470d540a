"""The device-memory limit and the per-candidate memory account, on a CPU with a fake device (fake_device.py).

What a GPU engine does with them end to end is tests/runtime/test_device_memory_gpu.py's.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_device  # noqa: E402
from fake_device import GiB, MiB, FakeDevice  # noqa: E402

from tkcc.errors import EngineError  # noqa: E402
from tkcc.runtime import device_memory as dm  # noqa: E402
from tkcc.runtime.memory_ledger import Ledger  # noqa: E402


# ------------------------------------------------------------------------------------ the limit
def test_the_derived_limit_is_the_resident_model_plus_headroom_within_the_device():
    total = 141 * GiB
    # a 1B model in bf16 (2.5 GiB weights + cache), 3 GiB resident with the reference's graphs: 2x the model wins
    assert dm.derived_limit(total, 3 * GiB, int(2.5 * GiB), int(0.5 * GiB)) == 3 * GiB + 5 * GiB
    # a tiny model: the 2 GiB floor
    assert dm.derived_limit(total, 100 * MiB, 10 * MiB) == 100 * MiB + 2 * GiB
    # a start-up whose activations dwarf the weights (long prefill logits): 2x the transient peak
    assert dm.derived_limit(total, 4 * GiB, 1 * GiB, 6 * GiB) == 4 * GiB + 12 * GiB
    # a model filling the device: never past the device less its reserve (5 %), never below what is resident
    assert dm.derived_limit(total, 100 * GiB, 90 * GiB) == total - int(total * 0.05)
    assert dm.derived_limit(total, 138 * GiB, 130 * GiB) == 138 * GiB
    # a small device: the reserve is at least 1 GiB
    assert dm.derived_limit(8 * GiB, 5 * GiB, 4 * GiB) == 7 * GiB
    # a device mostly free (a 1B model's watcher beside its server on an H200): half of what is free, less the
    # reserve, so that a served long prompt's buckets fit; the other half stays with the server
    assert dm.derived_limit(total, 3 * GiB, int(2.5 * GiB), int(0.5 * GiB), free=120 * GiB) == \
        3 * GiB + int(0.5 * (120 * GiB - int(total * 0.05)))
    # ... and where little is free, the model's own rule
    assert dm.derived_limit(total, 3 * GiB, int(2.5 * GiB), int(0.5 * GiB), free=12 * GiB) == 3 * GiB + 5 * GiB


def test_start_measures_the_resident_model_and_puts_the_cap_on():
    dev = FakeDevice(total=80 * GiB)
    dev.others = 66 * GiB                  # the device is mostly another process's: the model's own rule
    weights = dev.alloc(3 * GiB)           # resident: weights, cache, the reference's graphs
    scratch = dev.alloc(1 * GiB)           # the start-up's activations, freed again
    del scratch
    b = dm.DeviceBudget.start(dev, 0, model_bytes=int(2.5 * GiB), device="cuda:0")
    assert b.resident == 3 * GiB
    assert b.limit == 3 * GiB + max(2 * GiB, 5 * GiB, 2 * GiB)
    dev.others = 0                         # the same start on a device mostly free: half of its free memory
    free = dev.read().free
    assert dm.DeviceBudget.start(dev, 0, model_bytes=int(2.5 * GiB)).limit == \
        3 * GiB + int(0.5 * (free - 4 * GiB))
    b.enforce()                            # that second start capped the device at its own limit: b's cap back on
    assert dev.fraction() == pytest.approx(b.limit / dev.total)  # the allocator's cap is the limit
    assert "derived" in b.how and "resident 3.00 GiB" in b.how
    ok = dev.alloc(b.limit - 3 * GiB - 1)  # up to the limit: allowed
    with pytest.raises(fake_device.OutOfMemoryError):
        dev.alloc(2)                       # past it: the allocation fails (the candidate's own OOM)
    del ok, weights


def test_the_override_sets_the_limit_and_a_nonsensical_one_is_refused_with_the_cause():
    dev = FakeDevice(total=80 * GiB)
    keep = dev.alloc(3 * GiB)
    b = dm.DeviceBudget.start(dev, 10 * GiB, model_bytes=GiB)
    assert b.limit == 10 * GiB and b.how == "--device-max-mem"
    assert dev.fraction() == pytest.approx(10 / 80)
    with pytest.raises(EngineError, match=r"below what the engine already holds on cuda.*3\.00 GiB"):
        dm.DeviceBudget.start(dev, 2 * GiB, model_bytes=GiB)
    del keep
    assert dm.check_given(0, 80 * GiB, "cuda:0") == 0
    assert dm.check_given(12 * GiB, 80 * GiB, "cuda:0") == 12 * GiB
    with pytest.raises(EngineError, match=r"more than cuda:1 has \(80\.0 GiB\)"):
        dm.check_given(500 * GiB, 80 * GiB, "cuda:1")
    for bad in (-GiB, float("nan")):
        with pytest.raises(EngineError, match="must be 0"):
            dm.check_given(bad, 80 * GiB, "cuda:0")


def test_the_serve_flag_is_checked_before_any_engine_starts():
    from tkcc.cli import main
    from tkcc.commands.engine_cmd import _device_max_bytes
    from tkcc.runtime.supervisor import check_device_max

    assert _device_max_bytes(0, "cuda") == 0
    assert _device_max_bytes(1.5, "cuda:0") == int(1.5 * GiB)
    with pytest.raises(EngineError, match="must be 0"):
        _device_max_bytes(-1, "cuda")
    with pytest.raises(EngineError, match="applies to a CUDA device; this engine runs on cpu"):
        _device_max_bytes(4, "cpu")
    with pytest.raises(EngineError, match="must be 0"):
        check_device_max(-5, "cuda")
    assert main(["serve", "--model", "llama-tiny", "--device", "cuda", "--device-max-mem", "-2"]) != 0


# ------------------------------------------------------------------------------------ the account
class _Modules:
    """Candidate modules: name -> its globals (what it stashes there goes when the module is dropped)."""

    def __init__(self):
        self.mods: dict[str, dict] = {}

    def names(self) -> set:
        return set(self.mods)

    def drop(self, names) -> None:
        for n in names:
            self.mods.pop(n, None)


def _ledger(dev: FakeDevice, budget: dm.DeviceBudget, mods: _Modules) -> Ledger:
    return Ledger(budget.held, budget.leak, mods.names, mods.drop)


@pytest.fixture
def device():
    dev = FakeDevice(total=80 * GiB)
    resident = dev.alloc(2 * GiB)
    owned: list = []  # the engine's own caches (the reference's graphs for new shapes)
    budget = dm.DeviceBudget.start(dev, 0, model_bytes=GiB, owned=lambda: sum(b.nbytes for b in owned))
    yield dev, budget, owned
    del resident


def test_a_leak_is_charged_to_the_candidate_that_made_it_and_not_to_the_next_honest_one(device):
    dev, budget, owned = device
    mods = _Modules()
    ledger = _ledger(dev, budget, mods)

    ledger.opened("leaky")
    mods.mods["tkcc_user_leaky"] = {"KEEP": dev.alloc(300 * MiB)}   # stashed in its module's globals
    work = dev.alloc(1 * GiB)                                       # what it used while it ran
    del work
    charge = ledger.charge("leaky")
    assert charge is not None and charge.candidate == "leaky" and "300 MiB above" in charge.reason
    assert charge.restored and charge.dropped == ["tkcc_user_leaky"]  # dropping its module gave it back
    assert dev.allocated == 2 * GiB

    ledger.opened("honest")
    mods.mods["tkcc_user_honest"] = {}
    graphs = dev.alloc(500 * MiB)  # its own graphs, dropped at unload
    owned.append(dev.alloc(200 * MiB))  # meanwhile the engine captured the reference at a new shape: its own
    del graphs
    assert ledger.charge("honest") is None


def test_memory_that_dropping_the_modules_cannot_free_is_not_restored(device):
    dev, budget, _ = device
    mods = _Modules()
    ledger = _ledger(dev, budget, mods)
    hidden = []  # somewhere outside its modules (another library's global)
    ledger.opened("hider")
    mods.mods["tkcc_user_hider"] = {}
    hidden.append(dev.alloc(256 * MiB))
    charge = ledger.charge("hider")
    assert charge is not None and not charge.restored and "256 MiB above" in charge.reason
    # below the slack nothing is charged (allocator rounding, a lazily created handle)
    ledger.opened("rounding")
    hidden.append(dev.alloc(32 * MiB))
    assert ledger.charge("rounding") is None


def test_a_kept_candidates_memory_is_not_charged_to_later_ones_and_is_its_own_when_it_goes(device):
    dev, budget, _ = device
    mods = _Modules()
    ledger = _ledger(dev, budget, mods)
    ledger.opened("kept")
    mods.mods["tkcc_user_kept"] = {"KEEP": dev.alloc(400 * MiB)}  # kept serving: its memory stays while it does
    for name in ("next1", "next2"):  # honest candidates measured while it serves
        ledger.opened(name)
        w = dev.alloc(100 * MiB)
        del w
        assert ledger.charge(name) is None
    charge = ledger.charge("kept")  # unloaded at last: the 400 MiB it still holds is its own
    assert charge is not None and "400 MiB above" in charge.reason and charge.restored


def test_interleaved_windows_charge_no_one_for_what_cannot_be_told_apart(device):
    dev, budget, _ = device
    ledger = Ledger(budget.held, budget.leak)
    ledger.opened("a")
    ledger.opened("b")
    held_by_b = dev.alloc(300 * MiB)
    assert ledger.charge("a") is None and ledger.skipped == ["a"]  # b's bytes are not a's
    assert ledger.charge("b") is not None
    del held_by_b


# ------------------------------------------------------------------------------------ the watchdog
def test_the_idle_check_puts_a_lifted_cap_back_and_trips_on_memory_past_the_limit(device):
    dev, budget, _ = device
    assert budget.idle() == ("", False)
    dev.set_fraction(1.0)  # a candidate lifted the cap
    why, fatal = budget.idle()
    assert "was changed" in why and "put back" in why and not fatal
    assert dev.fraction() == pytest.approx(budget.limit / dev.total)
    dev.set_fraction(1.0)
    kept = dev.alloc(budget.limit)  # ... and then held more than the limit
    why, fatal = budget.idle()
    assert fatal and "over its limit" in why, why
    assert budget.breaches == 1
    del kept
    junk = dev.alloc(budget.limit - 2 * GiB)  # reserved past the limit only as freed cache: not a breach
    dev.frac = 1.0
    more = dev.alloc(3 * GiB)
    del junk, more
    budget.fraction = dev.frac
    assert budget.idle() == ("", False)


def test_held_by_counts_each_storage_once_and_skips_modules_and_functions():
    import torch

    a = torch.zeros(256)  # 1 KiB
    view = a[10:]
    b = torch.zeros(128, dtype=torch.float64)  # 1 KiB

    class Graph:
        def __init__(self):
            self.static_outputs = [view, b]
            self.fn = lambda: torch.ones(1 << 20)

    roots = [{"k": Graph(), "again": [a, (b,)]}, torch.nn.Linear(1024, 1024)]
    assert dm.held_by(roots, "cpu") == 2048
    assert dm.held_by(roots, "cuda") == 0


def test_held_by_counts_what_a_callable_graph_object_keeps():
    """A reference's CapturedCall is callable, and its static buffers are the engine's: counted (they were
    charged to the candidate measured when they were made); its fn, a closure or a module, is not descended."""
    import functools

    import torch

    from tkcc.kernels.graph_replay import CapturedCall

    big = torch.zeros(1 << 20)  # 4 MiB, reached only through the function's closure and the partial
    logits = torch.zeros(512)   # 2 KiB

    class Replay:
        def __init__(self):
            self.static_outputs = [logits]
            self.fn = lambda: big
            self.partial = functools.partial(torch.add, big)

        def __call__(self):
            return self.fn()

    assert dm.held_by([{"ref": Replay()}], "cpu") == 2048
    call = CapturedCall.__new__(CapturedCall)  # a capture's attributes without a device to capture on
    call.__dict__.update(static_outputs=[logits], fn=lambda: big)
    assert callable(call) and dm.held_by([call], "cpu") == 2048


# ------------------------------------------------------------------------------------ the worker, end to end
LEAKY = '''
import fake_device
def build(program):
    base = program.graphs["forward"]
    def forward(x):
        global KEEP
        KEEP = fake_device.alloc({nbytes})   # a device buffer kept in a module global
        return base(x)
    return {{"forward": forward}}
'''


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """The in-process worker (what a GPU engine runs: candidates in the worker, audited), on a CPU, with the
    fake device as its device memory."""
    import torch

    from engine_helpers import BLOCKS_MODEL
    from tkcc.runtime.worker import _Single

    threads = torch.get_num_threads()
    tmp = tmp_path_factory.mktemp("device-memory")
    dev = FakeDevice(total=80 * GiB)
    fake_device.CURRENT = dev
    resident = dev.alloc(GiB)
    runner = _Single({"model": BLOCKS_MODEL, "device": "cpu", "dtype": "float32", "threads": 1,
                      "isolation": "inprocess", "state_dir": str(tmp), "timeout_s": 60})
    runner.core.device_memory = dm.DeviceBudget.start(dev, 0, model_bytes=GiB)
    try:
        yield runner, dev, tmp
    finally:
        import gc

        gc.unfreeze()  # the worker froze start-up's objects (for its ledger's collections): not this process's job
        fake_device.CURRENT = None
        del resident
        torch.set_num_threads(threads)


def _source(tmp, name: str, body: str) -> dict:
    import hashlib

    os.makedirs(os.path.join(str(tmp), name), exist_ok=True)
    path = os.path.join(str(tmp), name, "candidate.py")
    with open(path, "w") as f:
        f.write(body)
    return {"source": path, "sha256": hashlib.sha256(body.encode()).hexdigest()}


def _experiment(runner, spec: dict) -> dict:
    r = runner.run("load", {"spec": spec, "tier": "fast"})
    cid = r["candidate"]
    v = runner.run("validate", {"candidate": cid, "tier": "fast"})
    assert v["ok"], v
    return runner.run("unload", {"candidate": cid})


def test_the_worker_charges_a_leak_to_its_candidate_frees_it_and_the_next_honest_one_is_clean(worker):
    from engine_helpers import WRAP

    runner, dev, tmp = worker
    held = dev.allocated
    out = _experiment(runner, _source(tmp, "leaky", LEAKY.format(nbytes=300 * MiB)))
    assert out["unloaded"] and "300 MiB above" in out["leaked"] and out["restored"], out
    assert not out.get("fatal") and dev.allocated == held  # dropping its module freed it: the worker goes on
    out = _experiment(runner, _source(tmp, "honest", WRAP.format(body="return base(x)")))
    assert out == {"unloaded": True}


def test_the_worker_charges_a_candidate_refused_at_load_for_what_it_kept(worker):
    from tkcc.runtime.worker import Leaked

    runner, dev, tmp = worker
    body = ("import collections, fake_device\n"
            "def build(program):\n"
            "    collections._tkcc_test_keep = fake_device.alloc(200 << 20)   # outside its own module\n"
            "    raise MemoryError('pretend the next allocation failed')\n")
    with pytest.raises(Leaked) as e:
        runner.run("load", {"spec": _source(tmp, "refused", body), "tier": "fast"})
    assert not e.value.charge.restored and "200 MiB above" in str(e.value) and "MemoryError" in str(e.value)
    import collections

    del collections._tkcc_test_keep


def test_the_worker_ping_trips_on_device_memory_between_requests(worker):
    runner, dev, _ = worker
    assert "leaked" not in runner.run("ping", {})
    budget = runner.core.device_memory
    dev.set_fraction(1.0)
    out = runner.run("ping", {})
    assert "between requests" in out["leaked"] and not out.get("fatal")
    dev.set_fraction(1.0)
    kept = dev.alloc(budget.limit)
    out = runner.run("ping", {})
    assert out.get("fatal") and "over its limit" in out["reason"] and "restarts" in out["reason"], out
    del kept
    budget.enforce()


def test_the_engine_raising_its_own_cap_is_not_a_candidates_tampering_but_a_candidate_lifting_it_is(worker):
    """The H200 serve run: validation raised the limit for a reference at a served long prompt, inside an op that
    ran candidate code, and the audit called that the candidate's change, put the old cap back and refused it."""
    runner, dev, tmp = worker
    budget = runner.core.device_memory
    limit = budget.limit
    try:
        budget.limit = 10 * GiB  # a cap well inside the device (an earlier test may have left it wide open)
        budget.enforce()
        budget.limit += GiB  # what DeviceBudget.reference does for a reference that needs more room
        budget.enforce()
        runner.found = None
        a = runner._audit()
        assert not any("device-memory cap" in r for r in a.restored + a.unproven), a.to_json()
        assert dev.fraction() == pytest.approx(11 / 80)  # the raise stands
        dev.set_fraction(1.0)  # a candidate lifting the cap
        runner.found = None
        a = runner._audit()
        assert any("device-memory cap on" in r and "put back" in r for r in a.restored), a.to_json()
        assert dev.fraction() == pytest.approx(11 / 80)  # put back to the engine's own cap
    finally:
        budget.limit = limit
        budget.enforce()
        runner.found = None
