"""GPU survival and CUDA graphs: out-of-memory and an illegal memory access cost only the candidate.

Skipped without CUDA. One engine (the small residual-MLP model on cuda:0) for the module.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

OOB = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _write_far(ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK).to(tl.int64)
    tl.store(ptr + i + 1099511627776, tl.zeros([BLOCK], tl.float32))  # 4 TiB past the tensor


def build(program):
    base = program.graphs["forward"]

    def forward(x):
        y = base(x)
        _write_far[(1,)](y, BLOCK=128)
        return y
    return {"forward": forward}
'''


@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory):
    from engine_helpers import BLOCKS_MODEL, stop_engine

    tmp = tmp_path_factory.mktemp("gpu-engine")
    eng = _start(tmp, BLOCKS_MODEL)
    yield eng
    stop_engine(eng)


def _start(tmp, model):
    import json
    import os
    import subprocess
    import sys

    from engine_helpers import HERE, RunningEngine

    sock = os.path.join(str(tmp), "engine.sock")
    proc = subprocess.Popen([sys.executable, "-m", "tkcc.cli", "serve", "--model", model, "--device", "cuda",
                             "--dtype", "float32", "--socket", sock, "--json", "--timeout", "120"],
                            stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(HERE)))
    return RunningEngine(proc, json.loads(proc.stdout.readline()), sock, tmp)


def _ok_after(eng):
    with eng.client() as c:
        res = c.experiment({"baseline": True}, tiers="both", reps=30)
        assert res["ok"], res
        return c.status(), res


def test_baseline_is_measured_from_cuda_graphs(gpu_engine):
    _, res = _ok_after(gpu_engine)
    for tier in ("fast", "slow"):
        rec = res["tiers"][tier]
        assert rec["swap"]["graphs"] >= 1 and not rec["swap"]["eager"]
        # adaptive repetitions: at least MIN_REPS, at most the 30 asked for, stopping on a tight interval
        assert all(b["cuda_graph"] and 10 <= b["reps"] <= 30 and b["stop"] in ("ci", "max_reps")
                   for b in rec["measurement"]["buckets"])
        assert rec["measurement"]["env"]["device"].startswith("cuda")


def test_out_of_memory_costs_only_the_candidate(gpu_engine):
    body = "big = torch.empty(1 << 46, device=x.device)\n        return base(x) + big[:1]"
    path = gpu_engine.forward_source("oom", body)
    with gpu_engine.client() as c:
        before = c.status()["engine"]["restarts"]
        res = c.experiment({"source": path}, tiers="slow", reps=5)
    assert not res["ok"] and res["tiers"]["slow"]["failure"] == "memory", res
    st, _ = _ok_after(gpu_engine)
    assert st["engine"]["restarts"] == before  # OOM is recoverable in place


def test_illegal_memory_access_restarts_the_worker_and_the_engine_keeps_serving(gpu_engine):
    path = gpu_engine.source("oob", OOB)
    with gpu_engine.client() as c:
        before = c.status()["engine"]["restarts"]
        res = c.experiment({"source": path}, tiers="slow", reps=5)
    rec = res["tiers"]["slow"]
    assert not res["ok"] and rec["failure"] in ("corrupted", "crashed"), rec
    assert rec["recovery"]["recovery_s"] > 0
    st, _ = _ok_after(gpu_engine)
    assert st["engine"]["restarts"] == before + 1
