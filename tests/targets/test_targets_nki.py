"""NKI kernels: parse, use only modelled APIs, and compute each family's reference when executed."""
import pytest
import torch

from tkcc.kernels.targets.families import FAMILIES
from tkcc.kernels.targets.nki import build_simulated, source
from tkcc.kernels.targets.nki_sim import check_source
from tkcc.errors import TkccError

SHAPES = {
    "rmsnorm": [dict(rows=3, D=64), dict(rows=130, D=48)],
    "router_topk": [dict(T=5, E=16, K=4), dict(T=2, E=64, K=8, normalize=True)],
    "moe_gemv": [dict(T=2, H=64, I=32, E=8, K=2), dict(T=1, H=160, I=136, E=4, K=2)],
    "decode_attention": [dict(B=1, HQ=4, HKV=2, D=16, S=300, L=200), dict(B=2, HQ=2, HKV=2, D=8, S=64, L=1)],
}


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nki_kernel_matches_reference(family, dtype):
    fam = FAMILIES[family]
    for i, shape in enumerate(SHAPES[family]):
        g = torch.Generator().manual_seed(100 + i)
        args = fam.make_inputs(shape, dtype, "cpu", g)
        want = fam.reference(*args)
        got = build_simulated(family, shape)(*args)
        want = want if isinstance(want, tuple) else (want,)
        got = got if isinstance(got, tuple) else (got,)
        rtol, atol = fam.tolerance[{torch.float32: "float32", torch.float16: "float16"}[dtype]]
        for w, o in zip(want, got):
            if w.dtype == torch.int64:
                assert torch.equal(w.sort(-1).values, o.sort(-1).values), (family, shape)
            else:
                torch.testing.assert_close(o.float(), w.float(), rtol=rtol * 5, atol=atol * 5)


def test_nki_check_rejects_unknown_api_and_syntax():
    src = source("rmsnorm", dict(rows=1, D=8))
    assert check_source(src) == ["tk_rmsnorm"]
    with pytest.raises(TkccError, match="does not model"):
        check_source(src.replace("nl.rsqrt", "nl.fancy_rsqrt"))
    with pytest.raises(TkccError, match="does not parse"):
        check_source(src + "\n  def broken(:\n")


def test_nki_partition_limit_enforced():
    from tkcc.kernels.targets.nki_sim import language as nl

    with pytest.raises(TkccError, match="partition dimension"):
        nl.zeros((129, 4), dtype="float32")
