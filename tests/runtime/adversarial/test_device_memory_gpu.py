"""Device memory on a GPU engine (``--isolation inprocess``): the derived limit is a real allocator cap, and what a
candidate keeps on the device is charged to it (tkcc.runtime.device_memory, tkcc.runtime.memory_ledger).

* a candidate that allocates past the limit (far less than the device has) fails as ``memory``, in place;
* one that keeps a device buffer in its module's globals is charged for it, and the memory is given back
  by dropping its module (the worker goes on);
* one that hides a buffer where that cannot reach is charged, and the worker restarts;
* one that lifts the cap is refused as ``tampered`` and the cap is put back.

After each, an honest candidate validates and measures. llama-tiny on cuda:0, one engine for the module.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import Adversary  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine_helpers import start_engine, stop_engine  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

MiB, GiB = 1 << 20, 1 << 30


class GpuAdversary(Adversary):
    def run(self, spec: dict, **kw) -> dict:
        with self.eng.client() as c:
            return c.experiment(spec, tiers="fast", reps=kw.pop("reps", 10), **kw)

    def status(self) -> dict:
        with self.eng.client() as c:
            return c.status()

    def restarts(self) -> int:
        return self.status()["engine"]["restarts"]

    def honest_measures(self) -> None:
        res = self.run({"source": self.source("honest", "return f(ids, pos)")})
        assert res["ok"], json.dumps({t: {k: v for k, v in r.items() if k in ("reason", "verdict", "error", "ok")}
                                      for t, r in (res.get("tiers") or {}).items()} | {"reason": res.get("reason")})
        assert res["tiers"]["fast"]["measurement"]["objective"] > 0


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    # --device inherits from launch_engine's "cpu": the later --device wins (argparse)
    eng = start_engine(tmp_path_factory.mktemp("device-memory-gpu"), "llama-tiny", "--device", "cuda",
                       "--max-cache-len", "64", "--timeout", "120", "--compile-workers", "0")
    try:
        adv = GpuAdversary(eng, None)
        adv.honest_measures()
        yield adv
    finally:
        stop_engine(eng)


def _limit(adv) -> dict:
    return adv.status()["worker"]["memory"]["device_limit"]


def test_the_limit_is_derived_from_the_device_and_the_model_and_is_on(gpu):
    lim = _limit(gpu)
    assert gpu.eng.ready["device_max_bytes"] == lim["limit_bytes"]
    assert lim["how"].startswith("derived")
    # llama-tiny holds a few MiB: the limit is the 2 GiB floor above it, far below the device
    assert lim["resident_bytes"] + 2 * GiB <= lim["limit_bytes"] < lim["device_total_bytes"] // 2


def test_a_limit_larger_than_the_device_is_refused_before_the_model_is_built(tmp_path):
    import subprocess

    from engine_helpers import HERE

    proc = subprocess.run([sys.executable, "-m", "tkcc.cli", "serve", "--model", "llama-tiny", "--device", "cuda",
                           "--device-max-mem", "100000", "--socket", str(tmp_path / "e.sock")],
                          capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(HERE)))
    assert proc.returncode != 0
    assert "--device-max-mem 100000.0 GiB is more than cuda" in proc.stderr, proc.stderr[-2000:]


def test_a_candidate_that_allocates_past_the_limit_fails_as_memory_and_the_next_honest_one_measures(gpu):
    limit = _limit(gpu)["limit_bytes"]
    before = gpu.restarts()
    body = f"big = torch.empty({limit + 256 * MiB}, dtype=torch.uint8, device=ids.device)\nreturn f(ids, pos)"
    res = gpu.run({"source": gpu.source("past_the_limit", body)})
    rec = res["tiers"]["fast"]
    assert not res["ok"] and rec["failure"] == "memory", rec
    assert "device-memory limit" in rec["reason"], rec["reason"]
    assert gpu.restarts() == before  # the allocator refused it: nothing to restart
    gpu.honest_measures()


def test_device_memory_kept_in_a_module_global_is_charged_and_given_back(gpu):
    before, held = gpu.restarts(), _limit(gpu)["allocated_bytes"]
    body = f"""
        if "keep" not in STATE:
            STATE["keep"] = torch.empty({512 * MiB}, dtype=torch.uint8, device=ids.device)
        return f(ids, pos)
    """
    res = gpu.run({"source": gpu.source("keeps_in_a_global", body)})
    assert not res["ok"] and res["unload"]["failure"] == "memory", res
    assert "MiB above" in res["reason"] and "device memory" in res["reason"] and "dropping its modules" in res["reason"]
    assert gpu.restarts() == before
    assert _limit(gpu)["allocated_bytes"] < held + 64 * MiB  # given back
    gpu.honest_measures()


def test_device_memory_hidden_outside_the_candidate_restarts_the_worker_charged_to_it(gpu):
    before = gpu.restarts()
    body = f"""
        import collections
        if not hasattr(collections, "_tkcc_keep"):
            collections._tkcc_keep = torch.empty({512 * MiB}, dtype=torch.uint8, device=ids.device)
        return f(ids, pos)
    """
    res = gpu.run({"source": gpu.source("hides_memory", body)})
    assert not res["ok"] and res["unload"]["failure"] == "memory", res
    assert "MiB above" in res["reason"], res["reason"]
    st = gpu.status()
    assert st["engine"]["restarts"] == before + 1
    assert "MiB above" in st["engine"]["recoveries"][-1]["reason"]
    gpu.honest_measures()


def test_a_candidate_that_lifts_the_cap_is_refused_and_the_cap_holds_afterwards(gpu):
    before = gpu.restarts()
    res = gpu.run({"source": gpu.source("lifts_the_cap",
                                         "torch.cuda.set_per_process_memory_fraction(1.0)\nreturn f(ids, pos)")})
    assert not res["ok"] and res["tiers"]["fast"]["failure"] == "tampered", res
    assert "device-memory cap on" in res["reason"] and "put back" in res["reason"], res["reason"]
    assert gpu.restarts() == before
    limit = _limit(gpu)["limit_bytes"]
    body = f"big = torch.empty({limit + 256 * MiB}, dtype=torch.uint8, device=ids.device)\nreturn f(ids, pos)"
    res = gpu.run({"source": gpu.source("past_the_limit_again", body)})
    assert res["tiers"]["fast"]["failure"] == "memory", res
    gpu.honest_measures()
