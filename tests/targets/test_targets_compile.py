"""Every CUDA-family template renders and compiles for every target it claims: CUDA (NVRTC, sm_90)
and HIP (gfx942, gfx950), in each dtype and variant default; the code objects are what they claim."""
import pytest
import torch

from tkcc.kernels.targets.cuda import VARIANTS, source, supported
from tkcc.kernels.targets.families import FAMILIES, model_shapes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = {**model_shapes("olmoe-16l"), "rmsnorm": dict(rows=1, D=2048, residual=True)}
KERNELS = {"rmsnorm": ["tk_rmsnorm"], "router_topk": ["tk_router_topk"],
           "moe_gemv": ["tk_moe_down", "tk_moe_gate_up"], "decode_attention": ["tk_attn_merge", "tk_attn_split"]}


def _nvrtc():
    try:
        from tkcc.kernels.targets.nvrtc import compile_cuda, nvrtc_version

        nvrtc_version()
        return compile_cuda
    except Exception as e:  # noqa: BLE001 - report why the target is unavailable
        pytest.skip(f"NVRTC unavailable: {e}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_compiles_sm90(family, dtype):
    compile_cuda = _nvrtc()
    cubin = compile_cuda(source(family, "cuda", dtype, SHAPES[family]), "sm_90", f"{family}.cu")
    assert cubin[:4] == b"\x7fELF"
    for k in KERNELS[family]:
        assert k.encode() in cubin


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_hip_compiles(family, arch):
    from tkcc.kernels.targets.hip import code_object_arch, compile_hip, kernel_symbols

    obj = compile_hip(source(family, "hip", torch.bfloat16, SHAPES[family]), arch)
    assert code_object_arch(obj) == arch
    assert kernel_symbols(obj) == sorted(KERNELS[family])


def test_variants_all_compile_for_one_family():
    compile_cuda = _nvrtc()
    fam = "decode_attention"
    for nsplit in VARIANTS[fam]["nsplit"]:
        for warps in VARIANTS[fam]["warps"]:
            compile_cuda(source(fam, "cuda", torch.bfloat16, SHAPES[fam], dict(nsplit=nsplit, warps=warps)))


def test_compile_error_names_the_problem():
    from tkcc.errors import TkccError

    compile_cuda = _nvrtc()
    with pytest.raises(TkccError, match="NVRTC compile of bad.cu"):
        compile_cuda("extern \"C\" __global__ void k() { undefined_thing(); }", "sm_90", "bad.cu")


def test_unsupported_shapes_give_a_reason():
    assert supported("moe_gemv", torch.bfloat16, dict(T=1, H=2050, I=1024, E=8, K=2))
    assert supported("moe_gemv", torch.bfloat16, SHAPES["moe_gemv"]) is None
