"""CUDA kernels against their references on the GPU: fresh random inputs, several shapes, bf16 included;
and a launch inside a captured CUDA graph."""
import pytest
import torch

from tkcc.kernels.targets import kernel
from tkcc.kernels.targets.families import FAMILIES, dtype_name, model_shapes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

SHAPES = {
    "rmsnorm": [dict(rows=1, D=2048), dict(rows=7, D=4096), dict(rows=3, D=100, residual=False)],
    "router_topk": [dict(T=1, E=64, K=8), dict(T=9, E=128, K=8, normalize=True), dict(T=4, E=8, K=2)],
    "moe_gemv": [model_shapes("olmoe-16l")["moe_gemv"], dict(T=4, H=1024, I=768, E=16, K=4),
                 dict(T=2, H=64, I=32, E=8, K=2)],
    "decode_attention": [model_shapes("olmoe-16l")["decode_attention"], model_shapes("llama-1b-16l")["decode_attention"],
                         dict(B=2, HQ=8, HKV=2, D=128, S=32768, L=30001), dict(B=1, HQ=4, HKV=4, D=64, S=128, L=1)],
}


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_matches_reference(family, dtype):
    fam = FAMILIES[family]
    for i, shape in enumerate(SHAPES[family]):
        g = torch.Generator().manual_seed(1000 + i)
        args = fam.make_inputs(shape, dtype, "cuda", g)
        want = fam.reference(*args)
        fn = kernel(family, "cuda", dtype, shape)
        got = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        torch.cuda.synchronize()
        want = want if isinstance(want, tuple) else (want,)
        got = got if isinstance(got, tuple) else (got,)
        rtol, atol = fam.tolerance[dtype_name(dtype)]
        for w, o in zip(want, got):
            if w.dtype == torch.int64:
                assert torch.equal(w.sort(-1).values, o.sort(-1).values), (family, shape)
            else:
                assert not torch.isnan(o).any()
                torch.testing.assert_close(o.float(), w.float(), rtol=rtol, atol=atol, msg=f"{family} {shape}")


def test_cuda_kernel_in_cuda_graph():
    fam = FAMILIES["decode_attention"]
    shape = dict(B=1, HQ=16, HKV=16, D=128, S=4096, L=100)
    q, k, v, pos, scale = fam.make_inputs(shape, torch.bfloat16, "cuda", torch.Generator().manual_seed(0))
    fn = kernel("decode_attention", "cuda", torch.bfloat16, shape)
    fn(q, k, v, pos, scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, k, v, pos, scale)
    for L in (5, 100, 4000):  # the context length is read from device memory at each replay
        pos.fill_(L - 1)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), fam.reference(q, k, v, pos, scale).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("model", ["olmoe-16l", "llama-1b-16l"])
def test_decode_attention_every_variant_at_every_context(model):
    """Each (nsplit, warps, unroll) a campaign can pick, on the model's real head shapes, from one position to
    a nearly full cache: a split count that leaves some splits empty or short must still give the reference."""
    import itertools

    from tkcc.kernels.targets.cuda import VARIANTS

    fam = FAMILIES["decode_attention"]
    base = dict(model_shapes(model)["decode_attention"])
    q, k, v, pos, scale = fam.make_inputs(base, torch.bfloat16, "cuda", torch.Generator().manual_seed(7))
    refs = {L: fam.reference(q, k, v, torch.tensor([L - 1], device="cuda"), scale).float() for L in (1, 6, 1466, 4001)}
    bad = {}
    vs = VARIANTS["decode_attention"]
    for nsplit, warps, unroll in itertools.product(vs["nsplit"], vs["warps"], vs["unroll"]):
        fn = kernel("decode_attention", "cuda", torch.bfloat16, base, dict(nsplit=nsplit, warps=warps, unroll=unroll))
        for L, ref in refs.items():
            got = fn(q, k, v, torch.tensor([L - 1], device="cuda"), scale).float()
            err = float((got - ref).abs().max() / ref.abs().max())
            if not err < 2e-2:
                bad[(nsplit, warps, unroll, L)] = round(err, 4)
    assert not bad, bad
