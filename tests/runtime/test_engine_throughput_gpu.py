"""On a GPU: validation replays CUDA graphs that swap then reuses, the reference is kept per draw, and a
fused-kernel plan's compiles run ahead in the compile pool (prepare), so its load only loads them.

Skipped without CUDA. One in-process engine on llama-tiny (bf16) for the module, with its own kernel cache.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

FUSED = {"plan": [{"name": "dce"}, {"name": "fuse_elementwise_exact", "params": {"max_ops": 16, "num_warps": 2}}]}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from tkcc.frontend.capture import capture_model
    from tkcc.runtime.local import LocalClient

    tmp = tmp_path_factory.mktemp("gpu-throughput")
    program = capture_model("llama-tiny", dtype="bfloat16", device="cuda", max_cache_len=128)
    c = LocalClient(program, "cuda", state_dir=str(tmp / "engine"), kernel_cache=str(tmp / "kernels"),
                    compile_workers=4)
    yield c
    c.close()


def test_validation_replays_graphs_and_swap_reuses_them(client):
    res = client.experiment({"plan": [{"name": "dce"}]}, tiers="fast", reps=30)
    assert res["ok"], res.get("reason")
    rec = res["tiers"]["fast"]
    assert rec["validation"]["replays"]["graphs"] >= 1
    assert rec["swap"]["reused"] >= 1  # the graphs validation captured: not captured again
    again = client.experiment({"plan": [{"name": "cse"}]}, tiers="fast", reps=30)
    assert again["ok"] and any(sh.get("reference") for sh in again["tiers"]["fast"]["validation"]["shapes"])


def test_fused_kernels_compile_ahead_and_load_only_loads_them(client):
    prep = client.prepare(FUSED, tiers="fast")["fast"]
    assert prep["jobs"] >= 1 and prep["queued"] >= 1, prep
    res = client.experiment(FUSED, tiers="fast", reps=30)
    assert res["ok"], res.get("reason")
    rec = res["tiers"]["fast"]
    assert rec["kernels"]["ok"] and rec["kernels"]["jobs"] == prep["jobs"]
    jit = [rec[k].get("jit", {}) for k in ("load", "validation", "swap", "measurement")]
    assert sum(j.get("compiled", 0) for j in jit) == 0, jit  # every generated kernel came from the pool
