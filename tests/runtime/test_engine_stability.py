"""Tolerance-mode validation judges a candidate only where the reference is stable (tkcc.runtime.stability):
on a model whose output jumps with the sign of a near-zero sum of its cache (an MoE router on a near tie),
a correct candidate that sums in another order passes, a wrong one still fails, and a model that is
unstable at every input drawn is refused with that reason."""
from types import SimpleNamespace

import pytest
import torch

from tkcc.runtime.determinism import ScaledTolerance, TierPolicy
from tkcc.runtime.validation import validate


class Jumpy(torch.nn.Module):
    """out = x + 10 * sign(sum(cache)): the cache plays the KV cache, the sign the router's choice."""

    def __init__(self, tie: bool):
        super().__init__()
        self.register_buffer("cache", torch.zeros(256))
        self.tie = tie

    def make(self, bucket=None, generator=None):
        c = torch.randn(256, generator=generator)
        self.cache.copy_(c - c.mean() + 1e-7 if self.tie else c.abs() + 1)  # near-zero sum, or clearly positive
        return (torch.randn(8, generator=generator),)


def _program(tie: bool):
    m = Jumpy(tie)
    return SimpleNamespace(meta={"device": "cpu"}, state=m, inputs=lambda ph, b, g: m.make(b, g),
                           phases=["forward"], model=m)


def _reference(m):
    return lambda x: x + 10 * torch.sign(m.cache.sum())


def _reordered(m):
    """Correct, but sums the cache in another order: on a near tie its sign can differ from the reference's."""
    return lambda x: x + 10 * torch.sign(m.cache.flip(0).cumsum(0)[-1] + 1e-6 * m.cache[0])


def _policy():
    tol = ScaledTolerance(bound=0.05, measured=0.0, measured_abs=0.0, safety=4.0, floor=0.05, dtype="float32")
    return TierPolicy(mode="tolerance", source="forced", probe={}, tolerance=tol)


BUCKETS = [SimpleNamespace(phase="forward", shapes=((8,),), key=lambda i=i: f"forward/b{i}") for i in range(4)]


def test_a_correct_candidate_passes_where_the_reference_is_stable():
    p = _program(tie=False)
    ref = {"forward": _reference(p.state)}
    res = validate(p, ref, {"forward": _reordered(p.state)}, BUCKETS, False, 1e-4, 1e-4, 3, policy=_policy())
    assert res["ok"], res
    bad = validate(p, ref, {"forward": lambda x: _reference(p.state)(x) * 1.2}, BUCKETS, False, 1e-4, 1e-4, 3,
                   policy=_policy())
    assert not bad["ok"] and "exceeds the tolerance" in bad["reason"]


def _flipped(m):
    """Correct on every clear input, on the other side of every near tie (the worst a rounding can do)."""
    return lambda x: x + 10 * torch.sign(m.cache.sum()) * (-1 if abs(float(m.cache.sum())) < 1e-2 else 1)


def test_near_ties_never_fail_a_correct_candidate():
    p = _program(tie=True)
    ref = {"forward": _reference(p.state)}
    for seed in range(4):  # every input is a near tie: nothing can be judged, and validation says so
        res = validate(p, ref, {"forward": _flipped(p.state)}, BUCKETS, False, 1e-4, 1e-4, seed, policy=_policy())
        assert not res["ok"] and "no bucket could be judged" in res["reason"], res
        assert all(sh["mode"] == "not judged" for sh in res["shapes"])
    # the same candidate on clear inputs: judged and passed
    clear = _program(tie=False)
    res = validate(clear, {"forward": _reference(clear.state)}, {"forward": _flipped(clear.state)}, BUCKETS, False,
                   1e-4, 1e-4, 0, policy=_policy())
    assert res["ok"] and all(sh["mode"] == "tolerance" for sh in res["shapes"]), res


def test_mixed_inputs_judge_the_stable_ones():
    """Half the draws are ties: the redraws find stable inputs, a wrong candidate fails on them."""
    p = _program(tie=True)
    flips = iter(range(10**6))

    def make(bucket=None, generator=None):
        p.state.tie = next(flips) % 2 == 0
        return Jumpy.make(p.state, bucket, generator)
    p.inputs = lambda ph, b, g: make(b, g)
    ref = {"forward": _reference(p.state)}
    ok = validate(p, ref, {"forward": _flipped(p.state)}, BUCKETS, False, 1e-4, 1e-4, 5, policy=_policy())
    assert ok["ok"], ok
    assert any("redrawn" in (sh.get("note") or "") for sh in ok["shapes"])
    bad = validate(p, ref, {"forward": lambda x: -_reference(p.state)(x)}, BUCKETS, False, 1e-4, 1e-4, 5,
                   policy=_policy())
    assert not bad["ok"] and "exceeds the tolerance" in bad["reason"]


@pytest.mark.parametrize("rel", [2.0 ** -8, 2.0 ** -12])
def test_perturbation_is_one_rounding_step_and_restores_nothing_else(rel):
    from tkcc.runtime.stability import perturb_state

    b = torch.randn(1000)
    before = b.clone()
    perturb_state([b], seed=0, rel=rel)
    r = (b / before - 1).abs()
    assert torch.allclose(r, torch.full_like(r, rel), rtol=1e-3)


def _antithetic(device):
    from tkcc.runtime.stability import perturb_state

    b = torch.rand(2, 4096, device=device) + 1.0  # away from zero: each sign readable
    up, down, again, other = b.clone(), b.clone(), b.clone(), b.clone()
    perturb_state([up], seed=3)
    perturb_state([down], seed=3, flip=True)
    perturb_state([again], seed=3)
    perturb_state([other], seed=4)
    s_up, s_down = torch.sign(up / b - 1), torch.sign(down / b - 1)
    assert torch.equal(s_up, -s_down) and bool((s_up != 0).all())  # the flip is the same signs negated
    assert 0.45 < float((s_up > 0).float().mean()) < 0.55
    assert torch.equal(again, up) and not torch.equal(other, up)  # a seed draws the same signs again


def test_the_flipped_perturbation_is_the_first_negated():
    _antithetic("cpu")


@pytest.mark.gpu
def test_the_flipped_perturbation_is_the_first_negated_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _antithetic("cuda")


class JumpyCache(Jumpy):
    """Its output is smooth; what jumps is the cache it writes (``written``), as a token routed to another
    expert in one layer moves the K/V every later layer writes while the logits may stay within the bound."""

    def __init__(self, tie: bool):
        super().__init__(tie)
        self.register_buffer("written", torch.zeros(4))


def _writes(m, sign):
    def fwd(x):
        m.written.fill_(10 * float(sign(m)))
        return x * 2
    return fwd


def test_a_jump_in_the_written_cache_alone_is_judged_by_the_same_rule():
    ref_sign = lambda m: torch.sign(m.cache.sum())  # noqa: E731
    flipped = lambda m: ref_sign(m) * (-1 if abs(float(m.cache.sum())) < 1e-2 else 1)  # noqa: E731
    tie = JumpyCache(tie=True)
    p = SimpleNamespace(meta={"device": "cpu"}, state=tie, inputs=lambda ph, b, g: tie.make(b, g),
                        phases=["forward"], model=tie)
    res = validate(p, {"forward": _writes(tie, ref_sign)}, {"forward": _writes(tie, flipped)}, BUCKETS, False,
                   1e-4, 1e-4, 0, policy=_policy())
    assert not res["ok"] and "no bucket could be judged" in res["reason"], res
    clear = JumpyCache(tie=False)
    q = SimpleNamespace(meta={"device": "cpu"}, state=clear, inputs=lambda ph, b, g: clear.make(b, g),
                        phases=["forward"], model=clear)
    wrong = validate(q, {"forward": _writes(clear, ref_sign)}, {"forward": _writes(clear, lambda m: -ref_sign(m))},
                     BUCKETS, False, 1e-4, 1e-4, 0, policy=_policy())
    assert not wrong["ok"] and "cache state" in wrong["reason"], wrong
