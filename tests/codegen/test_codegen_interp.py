"""Generated Triton kernels against their reference ops, run by the Triton interpreter on CPU (fp32, fp16).

The interpreter must be switched on before triton is imported, so the checks run in a child process
(tests/codegen/interp_check.py); this keeps the pytest process (and the AOT tests in it) interpreter-free.
"""
from __future__ import annotations

import json

import pytest

from codegen_helpers import run_python


@pytest.fixture(scope="module")
def results():
    proc = run_python("import interp_check; interp_check.main()", env_extra={"TRITON_INTERPRET": "1"}, timeout=300)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def test_every_kernel_ran_and_matched_its_reference(results):
    checked = [r for r in results if "kernels" in r]
    assert {r["dtype"] for r in checked} == {"torch.float32", "torch.float16"}
    for r in checked:
        assert r["kernels"], r
        for k in r["kernels"]:
            # several shapes per kernel, every one launched the Triton kernel (not the fallback) and matched
            assert k["cases"] >= 4 and k["kernel_runs"] == k["cases"], (r["model"], r["pass"], k)
            assert k["ok"] == k["cases"], (r["model"], r["dtype"], r["pass"], k)
        assert r["graph_ok"], r


def test_norm_and_softmax_kernels_were_generated(results):
    names = [k["name"] for r in results if r["model"] == "block" and r["pass"] == "fuse_elementwise"
             for k in r["kernels"]]
    assert any(n.startswith("fused_norm_") for n in names) and any(n.startswith("fused_softmax_") for n in names)


def test_a_view_of_leading_ones_joins_its_group(results):
    """The decode tail's four ops and the reshape between its adds are one kernel (it matched its reference at
    every shape above, and the graph matched the original)."""
    tails = [r for r in results if r["model"] == "decode_tail"]
    assert len(tails) == 2 and all(r["graph_ok"] for r in tails)
    assert all([k["ops"] for k in r["kernels"]] == [5] for r in tails), tails


def test_exact_variant_is_bitwise_equal(results):
    # interp_check compares the exact variant with torch.equal (NaNs in the same places), fp32 and fp16
    exact = [r for r in results if r.get("pass") == "fuse_elementwise_exact"]
    assert {r["dtype"] for r in exact} == {"torch.float32", "torch.float16"}
    assert all(r["graph_ok"] and all(k["ok"] == k["cases"] for k in r["kernels"]) for r in exact)
    pointwise = [r for r in exact if r["model"] == "pointwise"]
    assert all(len(r["kernels"]) == 1 and r["kernels"][0]["ops"] >= 15 for r in pointwise)


def test_unsupported_inputs_fall_back_with_a_reason(results):
    fb = next(r for r in results if r["model"] == "fallbacks")
    assert fb["reasons"]["ok"] is None
    assert "rank" in fb["reasons"]["rank"]
    assert "bfloat16" in fb["reasons"]["bf16"]
    assert "float64" in fb["reasons"]["fp64"]
    assert fb["answers_ok"]


def test_aot_compile_requested_under_the_interpreter_runs_in_a_child(results):
    aot = next(r for r in results if r["model"] == "aot_from_interpreter")
    assert aot["elf"] and aot["bytes"] > 1000
