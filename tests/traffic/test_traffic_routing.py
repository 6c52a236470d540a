"""MoE routing skew from the OLMoE paper counts, and sampling with that skew."""
import numpy as np
import pytest

from tkcc.errors import TraceFormatError
from tkcc.traffic import Routing
from tkcc.traffic.routing import _capped_inclusion


def test_published_imbalance():
    # ../shared/traces/README.md: OLMoE top-8 2.5..3.0 on c4, up to 7.8 on arxiv (layer 0);
    # top-1 up to 36.6 on arxiv layer 15 (57% of first choices); Mixtral top-2 1.08..1.33
    c4 = Routing.from_olmoe_counts(domain="c4")
    assert all(2.45 <= c4.imbalance(l) <= 3.05 for l in (0, 7, 15))
    arxiv = Routing.from_olmoe_counts(domain="arxiv")
    assert round(arxiv.imbalance(0), 1) == 7.8 and arxiv.imbalance() == arxiv.imbalance(0)
    top1 = Routing.from_olmoe_counts(domain="arxiv", selection="top1")
    assert round(top1.imbalance(15), 1) == 36.6 and round(top1.probs[15].max(), 2) == 0.57
    mix = [Routing.from_olmoe_counts(domain=d, model="mistralai/Mixtral-8x7B-v0.1").imbalance_per_layer()
           for d in ("arxiv", "book", "c4", "github", "wikipedia")]
    assert 1.07 <= min(m.min() for m in mix) and max(m.max() for m in mix) <= 1.34


def test_interpolated_layers():
    r = Routing.from_olmoe_counts(domain="arxiv")
    assert r.num_layers == 16 and r.measured_layers == (0, 7, 15)
    imb = r.imbalance_per_layer()
    for l in range(1, 7):  # between measured layers, the skew lies between its neighbours
        assert min(imb[0], imb[7]) - 1e-9 <= imb[l] <= max(imb[0], imb[7]) + 1e-9
    # measured layers keep expert identity; others are permuted profiles
    r2 = Routing.from_olmoe_counts(domain="arxiv", seed=1)
    assert np.array_equal(r.probs[7], r2.probs[7]) and not np.array_equal(r.probs[3], r2.probs[3])
    assert np.allclose(np.sort(r.probs[3]), np.sort(r2.probs[3]))
    small = Routing.from_olmoe_counts(domain="arxiv", num_layers=4, num_experts=16, top_k=2)
    assert small.probs.shape == (4, 16) and small.top_k == 2 and small.measured_layers == ()
    assert abs(small.imbalance(0) - r.imbalance(0)) / r.imbalance(0) < 0.35
    assert Routing.for_model(2, 8, 2).source.startswith("olmoe-paper:mistralai")


def test_errors():
    with pytest.raises(TraceFormatError, match="available"):
        Routing.from_olmoe_counts(domain="nope")
    with pytest.raises(ValueError):
        Routing(np.ones((2, 4)), top_k=5)


def test_capped_inclusion_matches_plain_reference():
    rng = np.random.default_rng(0)
    for _ in range(20):
        e = int(rng.integers(4, 64))
        k = int(rng.integers(1, e))
        p = rng.pareto(1.0, e) + 1e-3
        p /= p.sum()
        pi = _capped_inclusion(p, k)
        assert abs(pi.sum() - k) < 1e-9 and pi.max() <= 1 + 1e-12
        # plain reference: water-filling by repeated capping in a python loop
        ref = k * p
        for _ in range(e):
            over = ref > 1
            if not over.any():
                break
            free = ~(ref >= 1)
            ref = np.where(ref >= 1, 1.0, ref)
            ref[free] = p[free] / p[free].sum() * (k - (~free).sum())
        assert np.allclose(pi, ref)


@pytest.mark.parametrize("domain,selection,layer", [("arxiv", None, 0), ("c4", None, 9), ("arxiv", "top1", 15),
                                                    ("github", None, 4)])
def test_sample_topk_frequencies(domain, selection, layer):
    r = Routing.from_olmoe_counts(domain=domain, selection=selection)
    n = 40_000
    s = r.sample_topk(layer, n, np.random.default_rng(7))
    assert s.shape == (n, r.top_k) and s.dtype == np.int64
    srt = np.sort(s, axis=1)
    assert not (srt[:, 1:] == srt[:, :-1]).any()  # k distinct experts per token
    freq = np.bincount(s.ravel(), minlength=r.num_experts) / n
    pi = r.inclusion(layer)
    se = np.sqrt(pi * (1 - pi) / n)
    assert (np.abs(freq - pi) <= 5 * se + 1e-4).all()
    # the sampled loads reproduce the data's imbalance
    load = np.bincount(s.ravel(), minlength=r.num_experts)
    assert abs(load.max() / load.mean() - r.imbalance(layer)) / r.imbalance(layer) < 0.05 or r.top_k * r.probs[layer].max() > 1


def test_sample_topk_torch_generator_and_uniform():
    torch = pytest.importorskip("torch")
    r = Routing.uniform(3, 8, 2)
    g = torch.Generator().manual_seed(0)
    a = r.sample_topk(1, 1000, g)
    b = r.sample_topk(1, 1000, torch.Generator().manual_seed(0))
    assert isinstance(a, torch.Tensor) and a.dtype == torch.int64 and torch.equal(a, b)
    freq = torch.bincount(a.flatten(), minlength=8).double() / 1000
    assert torch.allclose(freq, torch.full((8,), 0.25, dtype=torch.float64), atol=0.06)
    assert r.imbalance() == pytest.approx(1.0)
    fps = {Routing.uniform(3, 8, 2).fingerprint(), Routing.uniform(3, 8, 1).fingerprint(),
           Routing.from_olmoe_counts(domain="c4").fingerprint(), Routing.from_olmoe_counts(domain="arxiv").fingerprint()}
    assert len(fps) == 4
    d = Routing.from_olmoe_counts(domain="c4").to_dict()
    assert Routing.from_dict(d).fingerprint() == d["fingerprint"]
