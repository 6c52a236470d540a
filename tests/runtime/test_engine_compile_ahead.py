"""Compiling ahead through the engine (``prepare``): on this CPU machine for an sm_90 target.

An in-process engine with ``compile_target`` lists a plan's kernel compiles without running them, its
supervisor's pool compiles them (real Triton compiles for sm_90), and ``load`` waits for that candidate's
compiles only. A pass whose kernel does not compile costs its candidate, with the compiler's message.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

from tkcc.codegen.kernel_cache import KernelCache  # noqa: E402
from tkcc.errors import EngineError  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PASSES = os.path.join(HERE, "passes", "tuned_pass.py")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tkcc.frontend.capture import capture_model
    from tkcc.runtime.local import LocalClient

    tmp = tmp_path_factory.mktemp("ahead")
    os.environ["TKCC_KERNEL_CACHE"] = str(tmp / "render")
    program = capture_model("llama-tiny", max_cache_len=32)
    client = LocalClient(program, "cpu", state_dir=str(tmp / "engine"), isolation="inprocess",
                         kernel_cache=str(tmp / "kernels"), compile_workers=2, compile_target="cuda:90:32")
    yield client, KernelCache(tmp / "kernels")
    client.close()


def spec(**params):
    return {"plan": [{"name": "test-tuned", "params": params}], "pass_modules": [PASSES]}


def test_prepare_lists_compiles_and_load_waits_for_them(engine):
    client, cache = engine
    prep = client.prepare(spec(blocks=3), tiers="fast")["fast"]
    assert prep["jobs"] == 3 and prep["queued"] == 3, prep  # one compile per block size, none run yet
    assert prep["launches"] >= 3 and not prep["kept"]  # the build launched kernels: it is built again
    res = client.load(spec(blocks=3), tiers="fast")["fast"]
    k = res["kernels"]
    assert k["ok"] and k["jobs"] == 3 and k["compiled"] + k["cached"] == 3 and not k["failed"], k
    assert len(cache.entries()) >= 3
    again = client.prepare(spec(blocks=3), tiers="slow")["slow"]  # the other tier: the same kernels
    assert again["jobs"] == 0 and again["cached"] == 3, again


def test_a_kernel_that_does_not_compile_fails_its_candidate_with_the_message(engine):
    client, _ = engine
    client.prepare(spec(blocks=2, broken=True), tiers="fast")
    other = client.prepare(spec(blocks=4), tiers="fast")["fast"]  # another candidate, queued behind it
    assert other["jobs"] == 1 and other["cached"] == 3, other  # three of its four block sizes were compiled before
    with pytest.raises(EngineError, match="(?s)a kernel failed to compile: .*broken_kernel.*not_defined_anywhere"):
        client.load(spec(blocks=2, broken=True), tiers="fast")
    res = client.experiment(spec(blocks=4), tiers="fast", reps=3)
    assert res["ok"], res.get("reason")
    assert res["tiers"]["fast"]["kernels"]["ok"] and res["tiers"]["fast"]["kernels"]["jobs"] == 1
    client.prepare(spec(blocks=2, broken=True), tiers="fast")
    bad = client.experiment(spec(blocks=2, broken=True), tiers="fast", reps=3)["tiers"]["fast"]
    assert bad["failure"] == "compile" and "not_defined_anywhere" in bad["reason"], bad
    assert "validation" not in bad  # no engine time spent on it


def test_cancel_and_unprepared_candidates(engine):
    client, _ = engine
    client.prepare(spec(blocks=1), tiers="fast")
    assert client.cancel(spec(blocks=1))["candidate"].startswith("plan-")
    with pytest.raises(EngineError, match="cancelled"):
        client.load(spec(blocks=1), tiers="fast")
    plain = client.prepare({"plan": [{"name": "dce"}]}, tiers="fast")["fast"]
    assert plain["jobs"] == 0 and plain["kept"], plain  # nothing launched: the build is kept, load is free
    assert client.load({"plan": [{"name": "dce"}]}, tiers="fast")["fast"]["compile_s"] >= 0
    assert client.prepare({"baseline": True}, tiers="fast")["fast"]["loaded"]  # it serves: nothing to do
    src = client.prepare({"eager": True}, tiers="fast")["fast"]
    assert src["jobs"] == 0 and "only plan candidates" in src["note"]
