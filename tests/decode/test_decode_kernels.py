"""Every kernel family against its PyTorch reference on fresh random inputs.

CPU: the Triton interpreter must be switched on before triton is imported, and
other tests import triton normally, so each family runs in a subprocess with
TRITON_INTERPRET=1 (fp32 and fp16; one process, interp_kernels.py). GPU: bf16 in this process.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from interp_proc import module_run  # noqa: E402

FAMILIES = ["gemv", "argmax", "rmsnorm", "router", "moe", "attention", "rope", "moe_routed", "attention_rope",
            "cache_bounds"]


# fp16 runs each family's first shape: its masks and tiles are the fp32 run's, its arithmetic is fp16's.
# fp16: the families the lowered step does not reach. gemv, attention_rope and moe_routed run in fp16 under the
# interpreter as the lowered rewrites' replacements, against their patterns (test_lowered.py's CHECKS)
INTERP = {"float32": (FAMILIES, ""), "float16": (["argmax", "attention", "rope"], ":1")}


@pytest.fixture(scope="module", autouse=True)
def interpreter_run(request):
    """Both dtypes' runs in one subprocess started with the module (interp_proc.py): its imports paid once."""
    groups = [f"{dt}:{','.join(fams)}{first}" for dt, (fams, first) in INTERP.items()]
    yield from module_run(request, ("test_kernels_match_reference_interpreter",),
                          [str(HERE / "interp_kernels.py"), *groups])


def test_checks_detect_a_wrong_kernel():
    """The comparison itself must be able to fail: a perturbed output exceeds every tolerance."""
    from tkcc.kernels.checks import TOL, rel_err

    ref = torch.randn(1000, dtype=torch.float64)
    bad = ref.clone()
    bad[::10] += 0.5
    assert rel_err(bad, ref) > max(TOL.values())
    bad[3] = float("nan")
    assert rel_err(bad, ref) == float("inf")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pdl", [False, True])
def test_kernels_match_reference_gpu_bf16(family, pdl):
    from tkcc.kernels.checks import run_checks

    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    rows = run_checks("cuda", torch.bfloat16, [family], pdl=pdl)
    bad = [r for r in rows if not r["ok"]]
    assert rows and not bad, bad


def test_the_argmax_check_fails_a_kernel_that_breaks_ties_the_other_way(monkeypatch):
    """torch.argmax gives the first of equal values: an argmax that gives the last fails the check's tie rows."""
    import tkcc.kernels.argmax as am
    from tkcc.kernels.checks import check_argmax

    def last_of_ties(x, block=None):
        return x.shape[-1] - 1 - x.flip(-1).argmax(-1)

    monkeypatch.setattr(am, "argmax", last_of_ties)
    rows = check_argmax("cpu", torch.float32, torch.Generator().manual_seed(0), shapes=((2, 300, 64),))
    bad = {r["kernel"] for r in rows if not r["ok"]}
    assert "argmax:ties" in bad and "argmax:random" not in bad


def test_gemv_ends_fall_back_with_the_same_meaning():
    """Where no kernel can run (plain CPU, bf16), the gather and argmax hooks take the reference path with a
    logged reason and keep their meaning: the row is gathered and copied out, the token is the first
    maximal row, the position and sequence length advance by one."""
    from tkcc.kernels.common import fallbacks
    from tkcc.kernels.gemv import ArgmaxState, gemv

    g = torch.Generator().manual_seed(3)
    table = torch.randn(9, 32, generator=g).bfloat16()
    w = torch.randn(50, 32, generator=g).bfloat16()
    w[7] = w[11] = torch.sign(table[4])  # rows 7 and 11 tie at the maximum: the first wins
    tok = torch.zeros(1, dtype=torch.long)
    pos, seq = torch.tensor([5], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    xout = torch.empty(32).bfloat16()
    y = gemv(table, w, gather=(torch.tensor([4]), xout), argmax=(tok, ArgmaxState("cpu"), pos, seq))
    ref = torch.nn.functional.linear(table[4], w)
    assert torch.equal(y, ref) and torch.equal(xout, table[4])
    assert int(tok) == int(torch.argmax(ref)) == 7 and int(pos) == 6 and int(seq) == 7
    assert any(k.startswith("gemv: ") for k in fallbacks()), fallbacks()


def test_gemv_gather_needs_a_table():
    from tkcc.errors import TkccError
    from tkcc.kernels.gemv import gemv

    with pytest.raises(TkccError, match=r"\[rows, K\] table"):
        gemv(torch.randn(32), torch.randn(8, 32), gather=(torch.tensor([0]), torch.empty(32)))


# ---- under the interpreter (one subprocess, started with the module: this reads it, last) ----------------------

@pytest.mark.parametrize("dtype", list(INTERP))
def test_kernels_match_reference_interpreter(interpreter_run, dtype):
    (res,) = [r for r in interpreter_run.lines() if r["dtype"] == dtype]
    assert res["n"] > 0
    assert not res["failed"], json.dumps(res["failed"], indent=1)
