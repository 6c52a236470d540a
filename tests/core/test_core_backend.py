"""torch.compile(model, backend="tkcc"): Inductor delegation, the measured choice, exact mode, bad options.

Inductor on CPU compiles C++ (tens of seconds cold on 2 cores), so only two tests compile with it, and
on the same small graph (the second hits Inductor's cache); every other test runs with
``inductor=False`` (tkcc's exact path) or drives the choice with fake timings and a fake clock.
"""
import pytest
import torch

import tkcc.backend as backend
from tkcc.backend import choose
from tkcc.backend.options import SEARCH_ENV, BackendOptions
from tkcc.errors import BackendError


class GemmGeluNorm(torch.nn.Module):
    """A chain tkcc has no kernel of its own for (gelu is not correctly rounded: no exact fusion)."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(16, 32)
        self.n = torch.nn.LayerNorm(32)

    def forward(self, x):
        return self.n(torch.nn.functional.gelu(self.l(x)) * 2.0).sum(-1)


def _inputs(n, seed, rows=4):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 16, generator=gen) for _ in range(n)]


# ---- Inductor delegation (real Inductor, CPU) --------------------------------------------------------
def test_graph_without_a_tkcc_kernel_goes_to_inductor():
    torch.manual_seed(0)
    m = GemmGeluNorm().eval()
    be = backend.make_backend()
    c = torch.compile(m, backend=be)
    with torch.no_grad():
        for x in _inputs(4, 1):
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-5)
    assert be.graphs == 1, "repeated calls must not recompile"
    (d,) = be.decisions
    assert (d.winner, d.kind, d.exact) == ("inductor", "inductor", False)
    assert d.numerics.startswith("within tolerance of eager")
    assert [t["name"] for t in d.trials if t["status"] == "ok"] == ["inductor"]
    assert {t["name"]: t["status"] for t in d.trials}["tkcc"] == "skipped"  # no search budget
    assert not d.searched


def test_search_picks_by_measurement_with_fake_timings():
    """Same graph with a budget: eager and tkcc's plan are tried too; the fake timings decide."""
    torch.manual_seed(0)
    m = GemmGeluNorm().eval()
    order = []

    def timer(fastest):
        def t(fn, args, device):
            order.append(fn)
            k = len(order) - 1  # trial order: inductor, eager, tkcc
            return [(0.5 if k == fastest else 1.0 + 0.1 * k) * 1e-3 + i * 1e-7 for i in range(20)]
        return t

    clock = iter(range(0, 10**6, 1)).__next__  # one fake second per clock reading
    be = backend.make_backend(search_s=1000, timer=timer(2), clock=clock)
    c = torch.compile(m, backend=be)
    with torch.no_grad():
        x0, x1 = _inputs(2, 2)
        c(x0)
        out = c(x1)
    (d,) = be.decisions
    assert [t["name"] for t in d.trials] == ["inductor", "eager", "tkcc"]
    assert d.winner == "tkcc" and d.exact and d.searched
    assert "x2.00 faster than inductor" in d.why
    assert torch.equal(out, m(x1)), "the exact plan's forward is bit-exact"

    order.clear()
    be = backend.make_backend(search_s=1000, timer=timer(0), clock=iter(range(0, 10**6)).__next__)
    c = torch.compile(m, backend=be)
    with torch.no_grad():
        c(x0)
    assert be.decisions[0].winner == "inductor" and "stays" in be.decisions[0].why


# ---- exact mode: tkcc's own path, no Inductor ----------------------------------------------------------
def test_exact_mode_small_module_graph_break_and_repeated_calls():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(16, 32)
            self.n = torch.nn.LayerNorm(32)

        def forward(self, x):
            y = self.l(x)
            torch._dynamo.graph_break()
            return self.n(torch.relu(y) * 2.0 + torch.relu(y) * 2.0).sum(-1)

    torch.manual_seed(0)
    m = M().eval()
    be = backend.make_backend(inductor=False)
    c = torch.compile(m, backend=be)
    with torch.no_grad():
        for seed, rows in enumerate((4, 4, 4, 2, 3)):
            x = _inputs(1, seed, rows)[0]
            assert torch.equal(c(x), m(x))
    first = [d for d in be.decisions if d.graph in (0, 1)]
    assert len(first) == 2 and all(d.winner == "tkcc" and d.exact for d in first)
    assert all("bit-exact" in d.numerics for d in first)
    assert be.graphs <= 4  # two graphs, and at most one recompile each for the new batch size


def test_exact_mode_tiny_hf_model_matches_eager():
    from tkcc.frontend.models import build_model

    backend.register()
    lm = build_model("llama-tiny")
    c = torch.compile(lm, backend="tkcc", options={"inductor": False})
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = lm(ids, use_cache=False).logits
        out = c(ids, use_cache=False).logits
        out2 = c(ids, use_cache=False).logits
    assert torch.equal(out, ref) and torch.equal(out2, ref)
    assert backend.decisions() and all(d.kind != "inductor" for d in backend.decisions())


def test_fake_example_inputs_then_real_calls():
    """Dynamo may hand the backend fake tensors; the choice waits for the first real call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 4)

        def forward(self, x):
            return (torch.relu(self.l(x)) * 3,)

    m = M().eval()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(torch.empty(2, 8))]
    be = backend.make_backend(inductor=False)
    fn = be(torch.fx.symbolic_trace(m), fake)
    assert not be.decisions  # nothing measured on fake tensors
    with torch.no_grad():
        for x in [torch.randn(2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]:
            assert torch.equal(fn(x)[0], m(x)[0])
    assert len(be.decisions) == 1 and be.decisions[0].exact


def test_graph_that_writes_its_inputs_is_not_rerun():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return x * 2

    m = Counter().eval()
    be = backend.make_backend(inductor=False, search_s=60)
    c = torch.compile(m, backend=be)
    with torch.no_grad():
        for _ in range(3):
            c(torch.ones(3))
    assert float(m.calls) == 3.0, "checks and timings must not repeat the graph's side effect"
    (d,) = be.decisions
    assert "wrote to input" in d.why and d.numerics.startswith("unchecked")


def test_graph_that_draws_random_numbers_keeps_eager_stream_on_first_call():
    f = torch.compile(lambda x: x + torch.rand_like(x), backend=backend.make_backend(inductor=False, search_s=60))
    x = torch.zeros(5)
    torch.manual_seed(3)
    with torch.no_grad():
        out = f(x)
    torch.manual_seed(3)
    assert torch.equal(out, x + torch.rand_like(x))
    after_first = torch.rand(1)
    torch.manual_seed(3)
    torch.rand_like(x)
    assert torch.equal(after_first, torch.rand(1)), "the first call drew exactly what eager draws"


def test_training_graph_is_compiled_as_is():
    be = backend.make_backend(inductor=False)
    lin = torch.nn.Linear(4, 3)
    out = torch.compile(lin, backend=be)(torch.randn(2, 4))
    out.sum().backward()
    assert lin.weight.grad is not None
    assert "autograd" in be.decisions[0].why


# ---- the choice, as pure logic -------------------------------------------------------------------
def _trial(name, med, spread=0.01, n=30, status="ok"):
    return choose.Trial(name, "tkcc", True, status, samples_s=[med * (1 + spread * ((i % 7) - 3) / 3)
                                                                for i in range(n)])


def test_pick_keeps_the_baseline_within_noise_and_takes_a_clear_win():
    base = _trial("inductor", 1.0)
    assert choose.pick([base, _trial("a", 0.99)])[0] is base            # 1 % faster: within min_gain
    assert choose.pick([base, _trial("b", 0.9, spread=0.5)])[0] is base  # 10 % but intervals overlap
    win = _trial("c", 0.7)
    assert choose.pick([base, _trial("b", 0.8), win])[0] is win         # the fastest clear win
    assert choose.pick([base, _trial("d", 0.1, status="rejected")])[0] is base
    assert choose.pick([_trial("x", 1.0, status="failed")])[0] is None


def test_budget_skips_search_candidates_by_the_clock():
    now = [0.0]

    def trial(c):
        now[0] += 4.0  # each trial takes four fake seconds
        return choose.Trial(c.name, c.kind, c.exact, "ok", samples_s=[1.0] * 5)

    cands = [choose.Candidate("inductor", "inductor", False), choose.Candidate("inductor+cudagraph", "inductor", False),
             choose.Candidate("eager", "eager", True, tier="search"),
             choose.Candidate("tkcc", "tkcc", True, tier="search"),
             choose.Candidate("tuned", "inductor", False, tier="search", min_budget_s=30)]
    got = {t.name: (t.status, t.why) for t in choose.run(cands, trial, 6.0, clock=lambda: now[0])}
    assert got["inductor"][0] == got["inductor+cudagraph"][0] == "ok"  # the default tier: always, not charged
    assert got["eager"][0] == got["tkcc"][0] == "ok"                    # 6 s, then 2 s left: started
    assert got["tuned"] == ("skipped", "search budget 6 s spent")
    got = {t.name: t for t in choose.run(cands, trial, 35.0, clock=lambda: now[0])}
    assert got["tuned"].status == "skipped" and got["tuned"].why == "needs 30 s of budget, 27 s left"
    assert choose.run(cands, trial, 38.0, clock=lambda: now[0])[-1].status == "ok"
    got = {t.name: t for t in choose.run(cands, trial, 0.0, clock=lambda: now[0])}
    assert [t.status for t in got.values()] == ["ok", "ok", "skipped", "skipped", "skipped"]
    assert "no search budget" in got["eager"].why


def test_entry_point_names_the_backend():
    """``backend="tkcc"`` in an installed tkcc resolves through pyproject's entry point: it must point here."""
    import importlib
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    module, _, name = meta["project"]["entry-points"]["torch_dynamo_backends"]["tkcc"].partition(":")
    assert getattr(importlib.import_module(module), name) is backend.tkcc_backend


# ---- options ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    ({"serch_s": 1}, "unknown option 'serch_s' \\(did you mean 'search_s'\\?\\)"),
    ({"search_s": -1}, "options\\['search_s'\\]=-1 must be a finite number of seconds >= 0"),
    ({"search_s": "soon"}, "options\\['search_s'\\]='soon' is not a duration in seconds"),
    ({"search_s": True}, "must be a finite number of seconds"),
    ({"mode": "max-autotune"}, "mode 'max-autotune' is not one of \\['exact', 'tolerance'\\]"),
    ({"inductor": "yes"}, "options\\['inductor'\\] must be True or False"),
    ({"tolerance": 2}, "options\\['tolerance'\\] must be a number in \\(0, 1\\)"),
    ({"reps": 5}, "options\\['reps'\\] must be an integer >= 6"),
    ({"inductor_options": {"max_autotun": True}}, "'max_autotun' is not an Inductor config option \\(did you mean "
                                                  "'max_autotune'\\?\\)"),
    ({"plan": '[{"name": "fuse_elementwise"}]'}, "pass is not bit-exact and mode is 'exact'"),
    ({"plan": '[{"name": "no-such-pass"}]'}, "options\\['plan'\\]: plan step 1 \\('no-such-pass'\\)"),
])
def test_bad_options_name_the_cause(options, match):
    with pytest.raises(BackendError, match=match):
        backend.TkccBackend(options)


def test_search_budget_from_the_environment_and_torch_compile_mode():
    assert BackendOptions.parse({}, env={SEARCH_ENV: "2.5s"}).search_s == 2.5
    assert BackendOptions.parse({"search_s": 1}, env={SEARCH_ENV: "9"}).search_s == 1.0  # the option wins
    assert BackendOptions.parse({}, env={}).search_s == 0.0
    with pytest.raises(BackendError, match=f"\\${SEARCH_ENV}='x' is not a duration"):
        BackendOptions.parse({}, env={SEARCH_ENV: "x"})
    assert BackendOptions.parse({}, mode="tolerance", env={}).mode == "tolerance"
    with pytest.raises(BackendError, match="disagree"):
        BackendOptions.parse({"mode": "exact"}, mode="tolerance", env={})
    with pytest.raises(BackendError, match="options must be a dict"):
        BackendOptions.parse([("search_s", 1)], env={})


def test_bad_options_through_torch_compile_fail_at_the_first_call():
    backend.register()
    f = torch.compile(lambda x: x + 1, backend="tkcc", options={"serch_s": 1})
    with pytest.raises(Exception, match="unknown option 'serch_s'"):
        f(torch.ones(2))


def test_replay_candidate_without_cuda_says_why():
    from tkcc.backend import candidates

    r = candidates.replayed(lambda x: (x * 2,), (torch.ones(2),), "t", dynamic=False)
    assert torch.equal(r(torch.ones(2))[0], torch.full((2,), 2.0))  # runs eagerly, same result
    assert "no CUDA tensor" in r.refused()  # what the backend records as the candidate's failure


# ---- GPU: the CUDA-graph replay candidate (skips without CUDA) --------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.gpu
def test_cuda_replay_of_inductor_is_measured_and_keeps_inductors_bits():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                            torch.nn.Linear(64, 8)).cuda().eval()
    be = backend.make_backend()
    c = torch.compile(m, backend=be)
    ind = torch.compile(m)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for rows in (4, 4, 4):
            x = torch.randn(rows, 64, device="cuda", generator=gen)
            out = c(x)
            torch.testing.assert_close(out, m(x), rtol=1e-4, atol=1e-5)
    (d,) = be.decisions
    trials = {t["name"]: t for t in d.trials}
    assert [t["name"] for t in d.trials][:3] == ["inductor", "inductor+cudagraph", "eager"]
    assert trials["inductor+cudagraph"]["status"] == "ok", trials["inductor+cudagraph"]["why"]
    assert all(trials[n]["median_ms"] for n in ("inductor", "inductor+cudagraph", "eager"))
    assert d.winner in ("inductor", "inductor+cudagraph", "eager")
    if d.winner == "eager":
        assert d.exact and torch.equal(c(x), m(x))
