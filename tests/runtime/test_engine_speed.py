"""What makes an engine experiment cheaper must not change what it means.

- adaptive repetitions: the median's confidence interval from order statistics, stopping early on a stable
  forward and running to the cap on a noisy one (the engine's own timing loop, on a fake clock the forwards
  advance, so the machine's load cannot change the outcome);
- the PassManager's engine mode (no per-pass numerics, no per-pass FX Python): the same rewritten graphs
  and outputs as the fully checked mode, the caller's Program untouched, a graph a pass made itself copied
  before a later pass edits it, and a numerics-breaking pass still refused, now by the engine's validation;
- kernels shared across the tiers of one plan: the same verdicts and bits as compiling each tier alone.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from engine_helpers import BLOCKS_MODEL, HERE
from tkcc.errors import PassError
from tkcc.runtime.measurement import BucketTiming, ci_tight, median_ci
from tkcc.runtime.timing import _Clock, timed_samples

ROOT = os.path.dirname(os.path.dirname(HERE))


# ------------------------------------------------------------------ adaptive repetitions
def test_median_ci_is_the_order_statistic_interval_and_covers_the_median():
    xs = list(range(1, 11))  # n = 10: [x_(2), x_(9)], coverage 1 - 2 * 11/1024
    lo, hi, cover = median_ci(xs)
    assert (lo, hi) == (2, 9) and cover == pytest.approx(1 - 2 * 11 / 1024)
    lo, hi, cover = median_ci([5.0, 1.0, 3.0, 4.0, 2.0])  # n = 5 cannot reach 95 %: [min, max], said so
    assert (lo, hi) == (1.0, 5.0) and cover < 0.95
    # the interval covers the true median at least as often as it promises, whatever the distribution
    rng = random.Random(7)
    for n in (10, 17, 30):
        hits, trials = 0, 2000
        for _ in range(trials):
            s = [rng.expovariate(1.0) for _ in range(n)]  # true median ln 2
            lo, hi, cover = median_ci(s)
            hits += lo <= 0.6931471805599453 <= hi
        assert hits / trials >= cover - 0.02, (n, hits / trials, cover)


class FakeTime:
    """A clock the timed forwards advance themselves: timing decisions tested without the machine's load."""

    def __init__(self):
        self.ns = 0

    def now(self) -> int:
        return self.ns

    def forward(self, seconds):
        """A forward that takes ``seconds`` (a number, or a function returning one per call)."""
        def fn(*_args):
            self.ns += int((seconds() if callable(seconds) else seconds) * 1e9)
        return fn


def test_adaptive_reps_stop_early_on_a_stable_forward_and_run_longer_on_a_noisy_one():
    cpu = torch.device("cpu")
    sets = [(torch.zeros(1),)]
    ft = FakeTime()
    jitter = random.Random(1)
    stable_fn = ft.forward(lambda: 0.002 * (1 + jitter.uniform(-0.001, 0.001)))  # +-0.1 %
    stable, stop = timed_samples(_Clock(stable_fn, None, sets, cpu, clock=ft.now), reps=30, warmup=2, min_reps=10,
                                 ci_rel=0.02)
    assert stop == "ci" and len(stable) == 10, (stop, len(stable))  # tight at the first look
    assert ci_tight(stable, 0.02) and all(abs(x - 0.002) < 1e-5 for x in stable)

    rng = random.Random(3)
    noisy_fn = ft.forward(lambda: rng.uniform(0.0005, 0.004))  # a forward whose time varies 8x
    noisy, stop = timed_samples(_Clock(noisy_fn, None, sets, cpu, clock=ft.now), reps=30, warmup=2, min_reps=10,
                                ci_rel=0.02)
    assert stop == "max_reps" and len(noisy) == 30
    assert not ci_tight(noisy, 0.02)

    # a forward that settles: noisy for its first calls, then stable; stops once the interval is tight
    calls = iter([rng.uniform(0.001, 0.004) for _ in range(6)] + [0.002] * 100)
    settling, stop = timed_samples(_Clock(ft.forward(lambda: next(calls)), None, sets, cpu, clock=ft.now), reps=30,
                                   warmup=0, min_reps=10, ci_rel=0.02)
    assert stop == "ci" and 10 < len(settling) < 30, (stop, len(settling))

    fixed, stop = timed_samples(_Clock(ft.forward(0.001), None, sets, cpu, clock=ft.now), reps=7, warmup=0,
                                min_reps=None)
    assert stop == "fixed" and len(fixed) == 7 and fixed == [0.001] * 7
    bt = BucketTiming.from_samples("k", "forward", 1.0, stable, False, stop="ci", warmup=2)
    assert bt.ci_low_s <= bt.median_s <= bt.ci_high_s and bt.reps == len(stable) and bt.stop == "ci"


def test_ranks_that_vote_stop_at_the_same_repetition():
    """--tp: each rank times its own forward, and a rank that stopped early would leave the others waiting
    in a collective. With ``agree`` (an all-reduce of the votes; here two threads and a barrier) a stable
    rank keeps timing as long as a noisy one does."""
    votes, barrier, out = {}, threading.Barrier(2, timeout=60), {}

    def agree_for(rank):
        def agree(tight):
            votes[rank] = tight
            barrier.wait()
            both = all(votes.values())
            barrier.wait()
            return both
        return agree

    rng = random.Random(5)
    clocks = {0: FakeTime(), 1: FakeTime()}
    fns = {0: clocks[0].forward(0.002), 1: clocks[1].forward(lambda: rng.uniform(0.0005, 0.004))}
    sets = [(torch.zeros(1),)]

    def rank(r):
        out[r] = timed_samples(_Clock(fns[r], None, sets, torch.device("cpu"), clock=clocks[r].now), reps=24,
                               warmup=1, min_reps=10, ci_rel=0.02, agree=agree_for(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(out[0][0]) == len(out[1][0]) == 24 and out[0][1] == out[1][1] == "max_reps"
    assert ci_tight(out[0][0], 0.02)  # rank 0 alone would have stopped at 10


def test_clock_rotates_inputs_across_chunks():
    seen = []
    sets = [(torch.tensor(float(i)),) for i in range(4)]
    clock = _Clock(lambda x: seen.append(int(x)), None, sets, torch.device("cpu"))
    clock.warm(3)
    clock.take(2)
    clock.take(3)
    assert seen == [0, 1, 2, 3, 0, 1, 2, 3]


# ------------------------------------------------------------------ engine core, in process
@pytest.fixture(scope="module")
def core(tmp_path_factory):
    from tkcc.runtime.engine import EngineCore

    tmp = tmp_path_factory.mktemp("speed")
    threads = torch.get_num_threads()
    try:
        yield EngineCore({"model": BLOCKS_MODEL, "device": "cpu", "dtype": "float32", "threads": 1,
                          "state_dir": str(tmp)})
    finally:
        torch.set_num_threads(threads)  # the core set this process's thread count; later tests expect the default


def test_engine_measure_is_adaptive_by_default_and_fixed_on_request(core):
    m = core.op_measure("fast", reps=12, warmup=1)
    for b in m["buckets"]:
        assert 10 <= b["reps"] <= 12 and b["stop"] in ("ci", "max_reps") and b["warmup"] == 1
        assert b["ci_low_s"] <= b["median_s"] <= b["ci_high_s"]
    m = core.op_measure("fast", reps=6, warmup=0, min_reps=None)
    assert all(b["reps"] == 6 and b["stop"] == "fixed" for b in m["buckets"])


BAD_PASS = '''
import operator
from tkcc.passes.base import register
from tkcc.passes.graph_pass import GraphPass

@register
class AddToSub(GraphPass):
    """Wrong on purpose: the residual add becomes a subtraction."""
    name = "test-speed-add-to-sub"
    exact = True
    params = {}

    def rewrite(self, gm, info, phase):
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is operator.add:
                n.target = operator.sub
                info.matched += 1
'''


def test_engine_mode_compile_leaves_numerics_to_validation(core, tmp_path):
    from tkcc.passes.manager import PassManager

    path = tmp_path / "bad_pass.py"
    path.write_text(BAD_PASS)
    spec = {"plan": [{"name": "test-speed-add-to-sub"}], "pass_modules": [str(path)]}
    r = core.op_load(spec, "fast")
    info = r["info"]
    assert "validation" in info["numerics"] and set(info["phases_s"]) >= {"passes_s", "codegen_s"}
    v = core.op_validate(r["candidate"], "fast")
    assert not v["ok"] and "bucket" in v["reason"]  # refused before any swap or measurement
    core.op_unload(r["candidate"])
    with pytest.raises(PassError, match="changed the outputs"):  # the checked mode still names the pass
        PassManager().run(core.programs["fast"], [{"name": "test-speed-add-to-sub"}])

    good = core.op_load({"plan": [{"name": "dce"}, {"name": "cse"}]}, "slow")
    assert core.op_validate(good["candidate"], "slow")["ok"]
    core.op_unload(good["candidate"])


# ------------------------------------------------------------------ PassManager engine mode
@pytest.fixture(scope="module")
def olmoe():
    from tkcc.frontend import capture_model

    return capture_model("olmoe-tiny", torch.float32, "cpu", max_cache_len=64)


@pytest.mark.parametrize("plan", [["dce"], ["cse", "dce"], ["noop-elim", "cse", "dce"]])
def test_engine_mode_rewrites_exactly_like_the_checked_mode(olmoe, plan):
    from tkcc.passes.manager import PassManager
    from tkcc.runtime.timing import bucket_inputs
    from tkcc.runtime.validation import StateGuard, clone_all, tensors_of
    from tkcc.traffic.workload import Bucket

    before = {ph: gm.code for ph, gm in olmoe.graphs.items()}
    plan = [{"name": n} for n in plan]
    checked, logs_c = PassManager().run(olmoe, plan)
    fast, logs_f = PassManager(check_numerics=False, log_code=False).run(olmoe, plan)
    assert {ph: gm.code for ph, gm in olmoe.graphs.items()} == before  # the caller's Program is untouched
    assert all(fast.graphs[ph].code == checked.graphs[ph].code for ph in olmoe.graphs)
    assert [lg.removed for lg in logs_f] == [lg.removed for lg in logs_c]
    assert all(p.check == "skipped" and p.code_after == "" for lg in logs_f for p in lg.phases.values())
    assert all(p.check in ("exact", "unchanged") and p.code_after for lg in logs_c for p in lg.phases.values())
    gen = torch.Generator().manual_seed(11)
    for b in (Bucket("prefill", 1, 7, 0, 1.0), Bucket("decode", 1, 9, 4, 1.0)):
        inputs = bucket_inputs(olmoe, b, gen, 1)[0]
        guard = StateGuard(olmoe.state)
        outs = []
        for prog in (olmoe, checked, fast):
            guard.restore()
            with torch.no_grad():
                outs.append([t.clone() for t in tensors_of(prog.graphs[b.phase](*clone_all(inputs)))])
        guard.restore()
        for got in outs[1:]:
            assert all(torch.equal(a, c) for a, c in zip(outs[0], got))


FOREIGN_PASSES = '''
import copy
import torch
import torch.fx
from tkcc.passes.base import Pass, RewriteInfo, register
from tkcc.passes.graph_pass import GraphPass

MADE = []

@register
class MakesItsOwnGraphs(Pass):
    """Returns graph modules the manager did not give it (and keeps them)."""
    name = "test-speed-own-graphs"
    params = {}

    def apply(self, program, **params):
        new = {ph: torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)) for ph, gm in program.graphs.items()}
        MADE.extend(new.values())
        return program.with_graphs(new), RewriteInfo()

@register
class AddsADeadNode(GraphPass):
    """Edits in place: one unused node before the output."""
    name = "test-speed-dead-node"
    params = {}

    def rewrite(self, gm, info, phase):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            gm.graph.call_function(torch.ops.aten.zeros.default, ([1],))
        info.matched += 1
'''


def test_a_graph_a_pass_made_is_copied_before_the_next_pass_edits_it(core, tmp_path):
    from tkcc.passes.manager import PassManager, load_pass_module

    path = tmp_path / "foreign_passes.py"
    path.write_text(FOREIGN_PASSES)
    load_pass_module(str(path))
    mod = next(m for name, m in sys.modules.items() if name.startswith("tkcc_user_passes_")
               and hasattr(m, "MADE") and m.__file__ == str(path))
    prog = core.programs["fast"]
    n_before = len(prog.graphs["forward"].graph.nodes)
    for kw in ({}, {"check_numerics": False, "log_code": False}):
        mod.MADE.clear()
        out, _ = PassManager(**kw).run(prog, [{"name": "test-speed-own-graphs"}, {"name": "test-speed-dead-node"}])
        assert len(out.graphs["forward"].graph.nodes) == n_before + 1
        assert len(mod.MADE[0].graph.nodes) == n_before  # what the first pass returned was not edited in place
    assert len(prog.graphs["forward"].graph.nodes) == n_before


# ------------------------------------------------------------------ kernels shared across tiers
SHARED_KERNELS = r'''
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from tkcc.codegen import artifact
from tkcc.runtime.engine import EngineCore
from tkcc.runtime.timing import bucket_inputs
from tkcc.runtime.validation import StateGuard, clone_all, tensors_of
from tkcc.runtime.workloads import workload_to_json

core = EngineCore({"model": "olmoe-tiny", "device": "cpu", "dtype": "float32", "max_cache_len": 64,
                   "threads": 1, "fast_blocks": 1, "state_dir": sys.argv[1]})
plan = [{"name": "dce"}, {"name": "fuse_elementwise_exact", "params": {"max_ops": 8, "block_elems": 512}}]

def kernels(info):
    pkg = "tkcc_artifact_" + info["artifact_hash"][:16] + ".kernels."
    return {k[len(pkg):]: id(m) for k, m in sys.modules.items() if k.startswith(pkg)}

def run(plan, tier):
    """Load + validate on `tier`; return the verdict, the kernel modules used and outputs on fixed inputs."""
    r = core.op_load({"plan": plan}, tier)
    v = core.op_validate(r["candidate"], tier)
    prog = core.programs[tier]
    fwd = core.candidates[r["candidate"]].forwards[tier]
    gen = torch.Generator().manual_seed(5)
    outs = []
    for b in core.default_workload.buckets:
        inputs = bucket_inputs(prog, b, gen, 1)[0]
        guard = StateGuard(prog.state)
        with torch.no_grad():
            outs.append([t.tolist() for t in tensors_of(fwd[b.phase](*clone_all(inputs)))])
        guard.restore()
    ks = kernels(r["info"])
    core.op_unload(r["candidate"])
    return {"ok": v["ok"], "mode": v["mode"], "reason": v["reason"], "kernels": ks, "outs": outs}

shared = {t: run(plan, t) for t in ("fast", "slow")}   # one plan, both tiers: kernel modules shared
artifact._KERNEL_MODULES.clear()
alone_slow = run(plan + [{"name": "dce", "params": {"get_attr": "keep"}}], "slow")  # compiled anew
print(json.dumps({"shared": shared, "alone_slow": alone_slow}))
'''


def test_kernels_shared_across_tiers_give_the_same_verdicts_and_bits(tmp_path):
    script = tmp_path / "shared.py"
    script.write_text(textwrap.dedent(SHARED_KERNELS))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "state")], capture_output=True, text=True,
                         cwd=ROOT, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    fast, slow, alone = res["shared"]["fast"], res["shared"]["slow"], res["alone_slow"]
    assert fast["ok"] and slow["ok"] and alone["ok"], (fast["reason"], slow["reason"], alone["reason"])
    assert fast["kernels"] and set(fast["kernels"]) <= set(slow["kernels"])
    assert all(slow["kernels"][k] == v for k, v in fast["kernels"].items())  # one module per kernel, both tiers
    assert set(alone["kernels"]) == set(slow["kernels"])
    assert all(alone["kernels"][k] != slow["kernels"][k] for k in slow["kernels"])  # executed anew
    assert (slow["mode"], slow["outs"]) == (alone["mode"], alone["outs"])  # same verdict, same bits
