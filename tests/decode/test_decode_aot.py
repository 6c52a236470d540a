"""Every kernel variant the decode path launches compiles for sm_90 with 16-byte loads, with no GPU present."""
import pytest


@pytest.mark.slow
def test_all_kernel_variants_compile_for_sm90():
    from tkcc.kernels.aot import compile_all, variants

    rows = compile_all(90)
    assert len(rows) == len(variants())
    # the weight-streaming kernels must use 16-byte vector loads (the JIT specialises aligned pointers the same way)
    for r in rows:
        if r["kernel"] in ("gemv_kernel", "moe_gate_up_kernel", "moe_down_kernel", "attn_partial_kernel",
                           "router_topk_kernel", "moe_gate_up_routed_kernel", "moe_down_routed_kernel",
                           "attn_rope_kernel"):
            assert r["wide_loads"] > 0, r
