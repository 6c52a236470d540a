"""Tolerance mode's second opinion (tkcc.runtime.exact_reference): the captured graph computing in fp32 on the
same weights and cache, against an fp32 model on fresh inputs and several contexts; the rule that judges a
candidate against it; and validation asking it only where a candidate exceeds the bound against the bf16 graph."""
import pytest
import torch

from tkcc.runtime.exact_reference import closer_to_exact, upcast


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _logits(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.fixture(scope="module")
def llama():
    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model

    m = build_model("llama-tiny", torch.bfloat16, "cpu")
    m32 = build_model("llama-tiny", torch.float32, "cpu")
    m32.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    return capture(m, phases=["decode"], max_cache_len=64), capture(m32, phases=["decode"], max_cache_len=64)


@pytest.mark.parametrize("context", [5, 31, 62])
def test_upcast_graph_computes_in_fp32_on_the_same_weights(llama, context):
    prog, prog32 = llama
    gm = prog.graphs["decode"]
    up = upcast(gm)
    g = torch.Generator().manual_seed(context)
    prog.state.fill_random(context, g)
    before = [b.clone() for b in prog.state.buffers()]
    tok = torch.randint(0, 100, (1, 1), generator=g)
    pos = torch.tensor([context])
    with torch.no_grad():
        bf16 = _logits(gm(tok, pos))
        after_bf16 = [b.clone() for b in prog.state.buffers()]
        for b, s in zip(prog.state.buffers(), before):
            b.copy_(s)
        exact = _logits(up(tok, pos))
        after_up = [b.clone() for b in prog.state.buffers()]
        for b, s in zip(prog32.state.buffers(), before):
            b.copy_(s.float())
        truth = _logits(prog32.graphs["decode"](tok, pos))
    assert exact.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert _rel(exact, truth) < 0.2 * _rel(bf16, truth), (_rel(exact, truth), _rel(bf16, truth))
    # the cache keeps its dtype; the upcast graph wrote the same row the bf16 graph did, within bf16 rounding
    for a, b, s in zip(after_up, after_bf16, before):
        assert a.dtype == s.dtype
        assert torch.equal(a[..., :context, :], s[..., :context, :])  # nothing else written
        assert not torch.equal(a, s)
        assert _rel(a[..., context, :], b[..., context, :]) < 0.05
    # no weight copied: every parameter the upcast graph reads is the model's own tensor
    ptrs = {t.data_ptr() for t in gm.parameters()}
    assert ptrs and ptrs == {t.data_ptr() for t in up.parameters()}


def test_a_bitcast_has_no_fp32_twin():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten.view.dtype(x, torch.int16)

    gm = torch.fx.symbolic_trace(M())
    assert upcast(gm) is None


def test_the_rule():
    torch.manual_seed(0)
    exact = torch.randn(1000)
    ref = exact + 0.04 * torch.randn(1000)  # the low-precision reference, itself off
    close = exact + 0.01 * torch.randn(1000)  # a candidate nearer the exact result than the reference
    wrong = exact + 0.5 * torch.randn(1000)
    bound = 0.01  # both candidates are past it against ``ref``
    ok, why = closer_to_exact([ref], [close], [exact], bound)
    assert ok and "fp32" in why
    ok, why = closer_to_exact([ref], [wrong], [exact], bound)
    assert not ok and "output 0" in why
    assert closer_to_exact([ref], [ref.clone()], [exact], bound)[0]  # within the bound: not asked


def test_validation_asks_the_fp32_reference_only_past_the_bound(llama):
    """The reference here is the bf16 graph made 2% of scale off (as a bf16 MoE graph is, where routing rounds
    its own way); a candidate that computes more exactly (the upcast graph, rounded to bf16) exceeds a 1.5% bound
    against it, at inputs where the reference is stable, and passes on the fp32 reference's word; a wrong one
    (5% off) fails with it; without the second opinion the exact candidate fails."""
    from tkcc.runtime.determinism import ScaledTolerance, TierPolicy
    from tkcc.runtime.validation import validate
    from tkcc.traffic.workload import Bucket

    prog, _ = llama
    gm = prog.graphs["decode"]
    up = upcast(gm)

    def each(out, f):
        return torch.utils._pytree.tree_map(lambda t: f(t) if isinstance(t, torch.Tensor) and t.is_floating_point()
                                            else t, out)

    def zeros(t):  # exact zeros in every output alike (as in a cache past its context)
        t = t.clone()
        t.view(-1)[:8] = 0
        return t

    def off(t):
        wiggle = torch.cos(torch.arange(t.numel(), dtype=torch.float32)).view(t.shape)
        return zeros((t.float() + 0.02 * t.float().abs().amax() * wiggle).to(t.dtype))

    def coarse(*a):
        return each(gm(*a), off)

    def nudged(t):  # where the reference is exactly zero, a candidate may be off by a rounding
        t = zeros(t)
        t.view(-1)[0] = 1e-3
        return t

    def finer(*a):
        return each(up(*a), lambda t: nudged(t.to(torch.bfloat16)))

    def wrong(*a):
        return each(gm(*a), lambda t: zeros(t * 1.05))

    def exact(*a):
        return each(up(*a), zeros)

    tol = ScaledTolerance(bound=0.015, measured=0.0, measured_abs=0.0, safety=4.0, floor=0.015, dtype="bfloat16")
    policy = TierPolicy(mode="tolerance", source="forced", probe={}, tolerance=tol)
    buckets = [Bucket("decode", 1, c, 1, 1.0) for c in (7, 40)]
    ref, second = {"decode": coarse}, {"decode": exact}
    ok = validate(prog, ref, {"decode": finer}, buckets, False, 1e-2, 1e-2, 0, policy=policy, exact_reference=second)
    assert ok["ok"], ok["reason"]
    notes = [sh.get("note") or "" for sh in ok["shapes"]]
    assert all("judged against the reference run in fp32" in n for n in notes), notes
    alone = validate(prog, ref, {"decode": finer}, buckets, False, 1e-2, 1e-2, 0, policy=policy)
    assert not alone["ok"] and "exceeds the tolerance" in alone["reason"], alone["reason"]
    bad = validate(prog, ref, {"decode": wrong}, buckets, False, 1e-2, 1e-2, 0, policy=policy, exact_reference=second)
    assert not bad["ok"] and "against the reference run in fp32" in bad["reason"], bad["reason"]


def test_the_engine_asks_the_same_second_opinion_of_a_timed_call(llama):
    """The engine's check of a timed call's outputs and cache (EngineCore._exact_opinion): a candidate nearer the fp32
    result than the bf16 graph passes on its word, a wrong one does not, and the cache is left as it was."""
    from tkcc.runtime.determinism import ScaledTolerance
    from tkcc.runtime.engine import EngineCore
    from tkcc.runtime.validation import StateGuard

    prog, _ = llama
    eng = EngineCore.__new__(EngineCore)  # the second opinion's wiring only: no engine start-up
    eng.trials, eng.tp, eng.dtype, eng._upcast, eng.programs = None, 1, torch.bfloat16, {}, {"fast": prog}
    scaled = ScaledTolerance(bound=0.015, measured=0.0, measured_abs=0.0, safety=4.0, floor=0.015, dtype="bfloat16")
    prog.state.fill_random(20, torch.Generator().manual_seed(3))
    guard = StateGuard(prog.state)
    inputs = (torch.tensor([[9]]), torch.tensor([20]))
    with torch.no_grad():
        exact = _logits(eng._exact_reference(prog)["decode"](*inputs))
        guard.restore()
        wiggle = torch.cos(torch.arange(exact.numel(), dtype=torch.float32)).view(exact.shape)
        ref = (exact + 0.02 * exact.abs().amax() * wiggle).bfloat16()  # a bf16 reference 2% off
        left = guard.current()
    said = eng._exact_opinion("fast", "decode", inputs, guard, [ref], [exact.bfloat16()], scaled)
    assert said is not None and "fp32" in said
    assert eng._exact_opinion("fast", "decode", inputs, guard, [ref], [(exact * 1.05).bfloat16()], scaled) is None
    assert all(torch.equal(a, b) for a, b in zip(guard.current(), left))
    eng.trials = object()  # process isolation: this process computes nothing, so no second opinion
    eng._upcast = {}
    assert eng._exact_opinion("fast", "decode", inputs, guard, [ref], [exact.bfloat16()], scaled) is None


def test_a_timed_call_s_outputs_and_cache_share_the_fp32_run(llama):
    """One sampled check asks the fp32 reference of a call's outputs and then of the cache it wrote: the second
    opinion reuses the first's fp32 run on the same inputs (``memo``), where each used to run it again."""
    from tkcc.runtime.determinism import ScaledTolerance
    from tkcc.runtime.engine import EngineCore
    from tkcc.runtime.validation import StateGuard

    prog, _ = llama
    eng = EngineCore.__new__(EngineCore)
    eng.trials, eng.tp, eng.dtype, eng._upcast, eng.programs = None, 1, torch.bfloat16, {}, {"fast": prog}
    fp32 = eng._exact_reference(prog)["decode"]
    runs = []
    eng._upcast[id(prog)] = {"decode": lambda *a: runs.append(1) or fp32(*a)}
    scaled = ScaledTolerance(bound=0.015, measured=0.0, measured_abs=0.0, safety=4.0, floor=0.015, dtype="bfloat16")
    prog.state.fill_random(20, torch.Generator().manual_seed(4))
    guard = StateGuard(prog.state)
    inputs = (torch.tensor([[7]]), torch.tensor([20]))
    with torch.no_grad():
        exact = _logits(fp32(*inputs))
        state = guard.current()
        guard.restore()
    ref = (exact * 1.03).bfloat16()  # a bf16 reference 3% off: past the bound, so the fp32 run is asked
    memo = {}
    assert eng._exact_opinion("fast", "decode", inputs, guard, [ref], [exact.bfloat16()], scaled, memo=memo)
    assert len(runs) == 1
    ref_state = [(s.float() * 1.03).to(s.dtype) if s.is_floating_point() else s for s in state]
    said = eng._exact_opinion("fast", "decode", inputs, guard, ref_state, state, scaled, of_state=True, memo=memo)
    assert said is not None and len(runs) == 1  # the cache judged on the same fp32 run
    eng._exact_opinion("fast", "decode", inputs, guard, ref_state, state, scaled, of_state=True)
    assert len(runs) == 2  # without the memo it runs again



@pytest.mark.parametrize("shape,k,dim,largest", [((5, 8), 2, -1, True), ((7, 16, 3), 4, 1, True),
                                                 ((6, 9), 3, 0, False), ((3, 64), 8, -1, True)])
def test_the_upcast_topk_is_topk_until_told_otherwise(shape, k, dim, largest):
    """The upcast graph's top-k (exact_reference.TopK) against torch.topk on fresh random inputs and shapes; each
    near tie it records is one; a choice it is told to take the other way swaps the row's k-th for its (k+1)-th."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tkcc.runtime.exact_reference import TIE_REL, decisions_of

    x = torch.randn(shape)
    x.select(dim, 0).copy_(x.select(dim, 1) * (1 + 2.0 ** -12))  # a near tie in every row the first two meet in
    gm = make_fx(lambda t: torch.topk(t, k, dim, largest))(x)
    up = upcast(gm)
    d = decisions_of(up)
    assert d is not None and len(d.nodes) == 1
    v, i = up(x)
    want_v, want_i = torch.topk(x, k, dim, largest)
    assert torch.equal(v, want_v) and torch.equal(i, want_i)
    rows = x.movedim(dim, -1).reshape(-1, x.shape[dim])
    srt = rows.sort(-1, descending=largest).values
    margins = (srt[:, k - 1] - srt[:, k]).abs() / rows.abs().amax(-1)
    assert sorted(r for _, _, r in d.near) == (margins <= TIE_REL).nonzero().flatten().tolist()
    flip = (d.nodes[0], 0)
    d.flip = frozenset({flip})
    fv, fi = up(x)
    d.flip = frozenset()
    r_v, r_i = fv.movedim(dim, -1).reshape(-1, k), fi.movedim(dim, -1).reshape(-1, k)
    w_v, w_i = want_v.movedim(dim, -1).reshape(-1, k), want_i.movedim(dim, -1).reshape(-1, k)
    assert torch.equal(r_v[1:], w_v[1:]) and torch.equal(r_i[1:], w_i[1:])  # other rows as they were
    assert torch.equal(r_v[0, :k - 1], w_v[0, :k - 1]) and float(r_v[0, k - 1]) == float(srt[0, k])
    assert int(r_i[0, k - 1]) not in w_i[0].tolist()


@pytest.fixture(scope="module")
def olmoe():
    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model

    m = build_model("olmoe-tiny", torch.bfloat16, "cpu")
    return capture(m, phases=["decode"], max_cache_len=48), m.config.vocab_size


def test_a_router_choice_at_a_near_tie_taken_the_other_way_is_judged_on_that_choice(olmoe):
    """An MoE candidate that computes exactly but routes a near-tied token the other way (the fp32 graph with that
    choice flipped, rounded to bf16) is far from the fp32 result and passes on the fp32 result with that choice
    flipped; one that flips a choice that was not near a tie, or a wrong one, is refused."""
    from tkcc.runtime.exact_reference import decisions_of
    from tkcc.runtime.validation import StateGuard, exact_opinion, exact_run, scaled_error

    prog, vocab = olmoe
    up = upcast(prog.graphs["decode"])
    d = decisions_of(up)
    assert len(d.nodes) >= 2  # one router per layer

    def run(inputs, guard, flip):
        d.flip = frozenset(flip)
        try:
            with torch.no_grad():
                out = up(*inputs)
        finally:
            d.flip = frozenset()
        guard.restore()
        return (out[0] if isinstance(out, (tuple, list)) else out).to(torch.bfloat16)

    for seed in range(100):  # a draw with a near tie whose flip moves the logits well past bf16's rounding
        g = torch.Generator().manual_seed(seed)
        prog.state.fill_random(30, g)
        inputs = (torch.randint(0, vocab, (1, 1), generator=g), torch.tensor([30]))
        guard = StateGuard(prog.state)
        base = exact_run(up, inputs, guard, {})
        if not base[2]:
            continue
        exact, near = base[0][0], sorted(base[2])
        flipped = run(inputs, guard, {(near[0][1], near[0][2])})
        bound = scaled_error(exact, flipped.float())[2] / 2
        if bound < 1.25 * 2.0 ** -9:
            continue
        far = [run(inputs, guard, {(n, 0)}) for n in d.nodes if n not in {node for _, node, _ in near}]
        far = [f for f in far if scaled_error(exact, f.float())[2] > 2 * bound]
        if far:
            break
    else:
        pytest.fail("no draw in 100 with a near tie that moves the logits and a clear choice that moves them more")
    ref = exact.to(torch.bfloat16)  # a bf16 reference that agrees with fp32 on every choice, as on the H200
    assert scaled_error(ref.float(), flipped.float())[2] > bound
    said = exact_opinion(up, inputs, guard, [ref], [flipped], bound)
    assert said[0] and "decided the other way" in said[1], said
    said = exact_opinion(up, inputs, guard, [ref], [far[0]], bound)
    assert not said[0] and "near-tied top-k choice" in said[1], said
    wrong = (exact * (1 + 2 * bound)).to(torch.bfloat16)
    assert not exact_opinion(up, inputs, guard, [ref], [wrong], bound)[0]
    assert not closer_to_exact([ref], [flipped], [exact], bound)[0]  # the first opinion alone refuses it


def test_the_alternatives_are_tried_nearest_first():
    from tkcc.runtime.exact_reference import PAIRS_OF, SINGLES, alternatives

    near = [(0.004, "b", 0), (0.0001, "a", 3), (0.002, "c", 1)] + [(0.01 + i * 1e-4, f"n{i}", 0) for i in range(14)]
    alts = alternatives(near)
    assert alts[0] == frozenset({("a", 3)}) and alts[1] == frozenset({("c", 1)})
    assert sum(len(a) == 1 for a in alts) == SINGLES
    assert sum(len(a) == 2 for a in alts) == PAIRS_OF * (PAIRS_OF - 1) // 2
    assert frozenset({("a", 3), ("c", 1)}) in alts and alts[-1] == frozenset((n, r) for _, n, r in near)
    assert alternatives([]) == [] and alternatives([(0.001, "a", 0)]) == [frozenset({("a", 0)})]
    from tkcc.runtime.exact_reference import MAX_NEAR

    assert alternatives([(0.001 * i, "a", i) for i in range(MAX_NEAR + 1)]) == []
