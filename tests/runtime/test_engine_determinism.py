"""The engine's start-up determinism probe and the validation mode it picks (issue 6).

A model whose forward is genuinely nondeterministic (noise of relative size
1e-4 from an unseeded generator on its outputs, as a GPU's library kernels
make bf16 logits wander) must be detected at start-up and validated in
tolerance mode, with a bound derived from its measured self-disagreement:
the baseline and a correct candidate pass, a candidate off by 5% does not.
A deterministic model stays exact; forcing exact mode on the noisy one is a
clear start-up error.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from engine_helpers import HERE, launch_engine, ready_engine, stop_engine

pytestmark = pytest.mark.timeout(180)

FACTORY = textwrap.dedent('''
    """Test models whose forward is genuinely nondeterministic: noise drawn from an unseeded generator."""
    import dataclasses
    import sys

    import torch
    import torch.fx

    sys.path.insert(0, {here!r})
    import blocks_model as bm  # noqa: E402

    REL = 1e-4
    _GEN = torch.Generator()
    _GEN.seed()  # a fresh seed from the OS: no two calls, and no two processes, draw the same noise


    @torch.fx.wrap
    def jitter(y):
        """y plus noise of relative size REL (of y's largest magnitude), different on every call."""
        noise = torch.randn(y.shape, generator=_GEN).to(device=y.device, dtype=y.dtype)
        return y + noise * (REL * y.detach().abs().amax())


    class NoisyHead(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return jitter(self.lin(x))


    @torch.fx.wrap
    def late_jitter(y):
        """Noise only once the file named by $TKCC_TEST_NOISE_FLAG exists: reproducible at start-up, not later."""
        import os

        flag = os.environ.get("TKCC_TEST_NOISE_FLAG", "")
        return jitter(y) if flag and os.path.exists(flag) else y


    class LateNoisyHead(NoisyHead):
        def forward(self, x):
            return late_jitter(self.lin(x))


    def late_noisy_blocks(dtype=torch.float32, device="cpu", max_cache_len=None, batch=1):
        prog = bm.make_program(dtype, device, max_cache_len, batch)
        model = bm.Stack(list(prog.model.blocks), LateNoisyHead(prog.model.head))
        return bm._program(model, dtype, torch.device(device), batch)


    def noisy_blocks(dtype=torch.float32, device="cpu", max_cache_len=None, batch=1):
        prog = bm.make_program(dtype, device, max_cache_len, batch)
        model = bm.Stack(list(prog.model.blocks), NoisyHead(prog.model.head))
        return bm._program(model, dtype, torch.device(device), batch)


    def _noisy_graph(gm):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            j = gm.graph.call_function(jitter, (out.args[0],))
        out.args = (j,)
        gm.recompile()
        return gm


    def _noisy(prog):
        inner = prog.recapture
        return dataclasses.replace(prog, graphs={{p: _noisy_graph(g) for p, g in prog.graphs.items()}},
                                   recapture=(lambda k: _noisy(inner(k))) if inner is not None else None)


    def noisy_lm(dtype=torch.float32, device="cpu", max_cache_len=None, batch=1):
        from tkcc.frontend import capture_model

        return _noisy(capture_model("olmoe-tiny", dtype, device, batch=batch, max_cache_len=max_cache_len or 32))
''').format(here=HERE)

ARGS = ("--timeout", "60", "--threads", "1")


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    path = tmp_path_factory.mktemp("noisy") / "noisy_models.py"
    path.write_text(FACTORY)
    return str(path)


@pytest.fixture(scope="module")
def forced_exact(factory, tmp_path_factory):
    """``tkcc serve --validation exact`` on the noisy model, started early (it overlaps the other engine's start)."""
    sock = str(tmp_path_factory.mktemp("forced") / "e.sock")
    proc = subprocess.Popen([sys.executable, "-m", "tkcc.cli", "serve", "--model", f"{factory}:noisy_blocks",
                             "--device", "cpu", "--socket", sock, "--validation", "exact", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(HERE)))
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def noisy_engine(factory, forced_exact, tmp_path_factory):
    eng = ready_engine(launch_engine(tmp_path_factory.mktemp("noisy-engine"), f"{factory}:noisy_blocks", *ARGS))
    yield eng
    stop_engine(eng)


def _cand(eng, name, body):
    return {"source": eng.forward_source(name, body)}


def test_noisy_model_is_detected_and_switched_to_tolerance(noisy_engine):
    for tier in ("fast", "slow"):
        v = noisy_engine.ready["validation"][tier]
        assert v["mode"] == "tolerance" and v["source"] == "auto" and not v["deterministic"], v
        assert v["self_disagreement_norm"] > 0 and "not bitwise reproducible" in v["why"], v
        tol = v["tolerance"]
        # the bound follows the measurement (times the safety factor), never below the dtype floor
        assert tol["floor"] == pytest.approx(1e-4) and tol["measured"] == v["self_disagreement_norm"]
        assert tol["bound"] == pytest.approx(max(tol["safety"] * tol["measured"], tol["floor"]))
        assert tol["bound"] < 0.05  # tight enough to see a 5% error
    with noisy_engine.client() as c:
        st = c.status()
    tiers = st["worker"]["tiers"]
    assert tiers["slow"]["validation"]["mode"] == "tolerance"
    assert tiers["slow"]["deterministic"]["eager_runs"] >= 2 and not tiers["slow"]["deterministic"]["deterministic"]


def test_baseline_and_a_correct_candidate_pass_a_wrong_one_fails_naming_error_and_bound(noisy_engine):
    good = _cand(noisy_engine, "good", "return base(x.clone())")
    wrong = _cand(noisy_engine, "scaled", "return base(x) * 1.05")
    with noisy_engine.client() as c:
        base = c.experiment({"baseline": True}, tiers="both", reps=5)
        ok = c.experiment(good, tiers="both", reps=5)
        bad = c.experiment(wrong, tiers="fast", reps=5)
    for res in (base, ok):
        assert res["ok"], res
        for tier in ("fast", "slow"):
            rec = res["tiers"][tier]
            v = rec["validation"]
            assert v["mode"] == "tolerance" and v["tolerance"]["bound"] > 0, v
            assert v["policy"]["mode"] == "tolerance" and v["policy"]["self_disagreement_norm"] > 0
            m = rec["measurement"]  # the measurement says which mode validated it, and why
            assert m["validation"]["policy"]["mode"] == "tolerance" and "not bitwise reproducible" in m["note"]
    assert not bad["ok"], bad
    reason = bad["tiers"]["fast"]["reason"]
    assert "of the output's scale" in reason and "exceeds the tolerance" in reason, reason
    assert "measured self-disagreement" in reason and "floor" in reason, reason


def test_a_baseline_that_stops_reproducing_itself_after_start_up_switches_the_tier(factory, tmp_path, monkeypatch):
    """The probe passed (no noise yet); later the baseline fails exact validation against the reference it is:
    the tier switches to tolerance mode (auto), says why, and a wrong candidate is still refused."""
    flag = tmp_path / "noise-on"
    monkeypatch.setenv("TKCC_TEST_NOISE_FLAG", str(flag))
    eng = ready_engine(launch_engine(tmp_path, f"{factory}:late_noisy_blocks", *ARGS))
    try:
        assert all(v["mode"] == "exact" for v in eng.ready["validation"].values()), eng.ready
        flag.write_text("on")
        with eng.client() as c:
            base = c.experiment({"baseline": True}, tiers="fast", reps=3)
            bad = c.experiment(_cand(eng, "scaled", "return base(x) * 1.05"), tiers="fast", reps=3)
            st = c.status()
    finally:
        stop_engine(eng)
    v = base["tiers"]["fast"]["validation"]
    assert base["ok"] and v["mode"] == "tolerance", base
    pol = st["worker"]["tiers"]["fast"]["validation"]
    assert pol["mode"] == "tolerance" and "found after start-up" in st["worker"]["tiers"]["fast"]["deterministic"][
        "worst"], pol
    assert pol["self_disagreement_norm"] > 0 and pol["tolerance"]["bound"] < 0.05
    assert not bad["ok"] and "exceeds the tolerance" in bad["tiers"]["fast"]["reason"], bad


def test_deterministic_model_stays_exact(blocks_engine):
    assert all(v["mode"] == "exact" and v["deterministic"] for v in blocks_engine.ready["validation"].values())
    with blocks_engine.client() as c:
        res = c.experiment({"baseline": True}, tiers="fast", reps=3)
    v = res["tiers"]["fast"]["validation"]
    assert res["ok"] and v["mode"] == "exact" and v["policy"]["mode"] == "exact" and "tolerance" not in v, res


def test_forcing_exact_on_the_noisy_model_is_a_clear_error(forced_exact):
    out, err = forced_exact.communicate(timeout=120)
    assert forced_exact.returncode != 0 and not out.strip(), out
    assert "--validation exact" in err and "not bitwise reproducible" in err, err
    assert "runs differ by up to" in err and "--validation auto or tolerance" in err, err


def test_bad_validation_mode_is_refused_before_start(tmp_path):
    from engine_helpers import BLOCKS_MODEL

    from tkcc.errors import EngineError
    from tkcc.runtime.journal import Journal
    from tkcc.runtime.supervisor import Supervisor

    with pytest.raises(EngineError, match=r"--validation 'sloppy': must be one of \['auto', 'exact', 'tolerance'\]"):
        Supervisor({"model": BLOCKS_MODEL, "device": "cpu", "validation": "sloppy"}, Journal(str(tmp_path / "j")))


def test_probe_and_scaled_tolerance_in_process(factory):
    """The probe itself, without an engine: noisy -> tolerance with the derived bound; deterministic -> exact."""
    sys.path.insert(0, os.path.dirname(factory))
    try:
        import noisy_models
    finally:
        sys.path.pop(0)
    import blocks_model

    from tkcc.errors import EngineError
    from tkcc.runtime import determinism as D
    from tkcc.runtime.validation import validate
    from tkcc.runtime.workloads import default_workload

    cpu = torch.device("cpu")
    clean = blocks_model.make_program()
    p = D.probe(clean, clean.graphs, D.probe_buckets(default_workload(clean), clean), cpu)
    assert p["deterministic"] and p["max_abs_diff"] == 0.0
    assert D.decide(p, "auto", torch.float32, "slow").exact
    forced = D.decide(p, "tolerance", torch.float32, "slow")  # forced tolerance on an exact model: the dtype floor
    assert not forced.exact and forced.tolerance.bound == pytest.approx(1e-4)

    noisy = noisy_models.noisy_blocks()
    p = D.probe(noisy, noisy.graphs, D.probe_buckets(default_workload(noisy), noisy), cpu)
    assert not p["deterministic"] and 1e-5 < p["max_norm_diff"] < 1e-2, p
    with pytest.raises(EngineError, match="not bitwise reproducible"):
        D.decide(p, "exact", torch.float32, "slow")
    pol = D.decide(p, "auto", torch.float32, "slow")
    assert pol.tolerance.bound == pytest.approx(D.SAFETY * p["max_norm_diff"])
    buckets = default_workload(noisy).buckets
    good = validate(noisy, noisy.graphs, noisy.graphs, buckets, False, 1e-4, 1e-4, 7, policy=pol)
    assert good["ok"], good
    # without the derived bound the plain fp32 tolerance rejects the model against itself (the bug this fixes)
    plain = validate(noisy, noisy.graphs, noisy.graphs, buckets, False, 1e-6, 1e-6, 7)
    assert not plain["ok"]
    off = {"forward": lambda x: noisy.graphs["forward"](x) * 1.05}
    bad = validate(noisy, noisy.graphs, off, buckets, False, 1e-4, 1e-4, 7, policy=pol)
    assert not bad["ok"] and "exceeds the tolerance" in bad["reason"]


def _swap_top2(f):
    """The forward with its two largest logits swapped at every position: a different greedy token."""
    def forward(ids, pos):
        out = f(ids, pos).clone()
        top2 = out.topk(2, dim=-1).indices
        first, second = out.gather(-1, top2[..., :1]), out.gather(-1, top2[..., 1:])
        out.scatter_(-1, top2[..., :1], second)
        out.scatter_(-1, top2[..., 1:], first)
        return out
    return forward


def test_noisy_lm_greedy_agreement_on_golden_prompts(factory):
    """An LM: the reference's golden-prompt tokens, judged where it agrees with itself; a top-2 swap fails."""
    sys.path.insert(0, os.path.dirname(factory))
    try:
        import noisy_models
    finally:
        sys.path.pop(0)
    from tkcc.runtime import determinism as D
    from tkcc.runtime.golden import reference_greedy
    from tkcc.runtime.validation import validate
    from tkcc.runtime.workloads import default_workload

    lm = noisy_models.noisy_lm(max_cache_len=32)
    w = default_workload(lm)
    p = D.probe(lm, lm.graphs, w.buckets[:2], torch.device("cpu"), eager_runs=2)
    pol = D.decide(p, "auto", torch.float32, "slow")
    assert not pol.exact
    pol.greedy = reference_greedy(lm, lm.graphs, pol.tolerance.bound, runs=2, steps=4)
    summary = pol.summary()["greedy_reference"]
    assert summary["judged"] >= 1 and summary["positions"] == 10
    ok = validate(lm, lm.graphs, lm.graphs, w.buckets[1:2], False, 1e-4, 1e-4, 3, policy=pol)
    assert ok["ok"] and ok["greedy"]["tokens"] == summary["judged"], ok
    # right on the decode shape validated, wrong in prefill: only the golden prompts' greedy tokens see it
    swapped = {"prefill": _swap_top2(lm.graphs["prefill"]), "decode": lm.graphs["decode"]}
    bad = validate(lm, lm.graphs, swapped, w.buckets[1:2], False, 1e-4, 1e-4, 3, policy=pol)
    assert not bad["ok"] and "greedy tokens differ from the reference's on golden prompt" in bad["reason"], bad


def test_campaign_evaluator_records_the_validation_mode(noisy_engine):
    from tkcc.agents.campaign import validation_modes
    from tkcc.agents.engine_eval import EngineEvaluator
    from tkcc.agents.proposer import Candidate
    from tkcc.passes.plan import PassPlan
    from tkcc.traffic.workload import Bucket, Workload

    w = Workload(buckets=[Bucket("forward", weight=1.0)], objective="mean_latency_s", source="test")
    with noisy_engine.client() as c:
        ev = EngineEvaluator(c, w, reps=3)
        modes = validation_modes(ev)
        assert set(modes) == {"fast", "slow"}
        for v in modes.values():
            assert v["mode"] == "tolerance" and v["source"] == "auto" and v["self_disagreement_norm"] > 0
            assert v["bound"] >= 4 * v["self_disagreement_norm"] * 0.999
        res = ev.measure(ev.build(Candidate("baseline", PassPlan()), "fast"), "fast")
    assert res.verdict == "measured", res
    assert res.measurement["validation"]["mode"] == "tolerance"
    assert res.measurement["validation"]["policy"]["mode"] == "tolerance"
