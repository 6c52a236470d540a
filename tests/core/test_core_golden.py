"""Golden record/check (exact), tampering, a deliberately perturbed pass detected and bisected."""
import json

import pytest
import torch

from tkcc.errors import GoldenError, PassError
from tkcc.passes import PassPlan, register
from tkcc.passes.graph_pass import GraphPass
from tkcc.passes.manager import PassManager
from tkcc.runtime import golden

aten = torch.ops.aten


@register
class PerturbOneMul(GraphPass):
    """Adds 1e-3 to the scalar of the first ``mul(x, scalar)`` (or to the first mul's result): wrong on purpose."""

    name = "test-perturb-mul"
    exact = True  # it claims exactness; the checks must catch the lie
    params = {"amount": [1e-3, 1e-7]}

    def rewrite(self, gm, info, phase, amount=1e-3):
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is aten.mul.Tensor:
                with gm.graph.inserting_after(n):
                    bumped = gm.graph.call_function(aten.add.Tensor, (n, amount))
                n.replace_all_uses_with(bumped)
                bumped.args = (n, amount)
                info.matched += 1
                return


@pytest.fixture(scope="module")
def recorded(llama_program, tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    path = golden.record("llama-tiny", "float32", "cpu", steps=4, root=root, program=llama_program)
    return root, path


def test_record_then_check_exact(llama_program, recorded):
    root, path = recorded
    assert path == root / "llama-tiny" / "cpu-float32"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["steps"] == 4 and meta["sha256"] and meta["torch_version"] == torch.__version__
    assert (path / "outputs.pt").stat().st_size < 64 * 1024  # kilobytes, not megabytes
    rep = golden.check(llama_program, root=root)
    assert rep.ok and rep.exact and rep.mode == "exact"
    assert rep.token_agreement == 1.0 and rep.compared == 2 * (1 + 4)
    assert rep.max_abs_err == 0.0 and rep.first_diff is None
    # the general passes keep the golden verdict
    out, _ = PassManager().run(llama_program, PassPlan.of("host-sync-removal", "noop-elim", "cse", "dce"))
    assert golden.check(out, root=root).exact


def test_perturbed_pass_is_caught_checked_and_bisected(llama_program, recorded):
    root, _ = recorded
    plan = PassPlan.of("noop-elim", "cse", "test-perturb-mul", "dce")
    # 1. the PassManager's own numerics check names the pass
    with pytest.raises(PassError, match="test-perturb-mul.*plan step 3"):
        PassManager().run(llama_program, plan)
    # 2. unchecked, the golden check fails and says where
    bad, _ = PassManager(check_numerics=False).run(llama_program, plan)
    rep = golden.check(bad, root=root)
    assert not rep.ok and not rep.exact and rep.max_abs_err > 0
    assert rep.first_diff.startswith("prompt 0, prefill")
    # tolerance mode: a tolerance below the error rejects it, one above accepts it
    err = rep.max_abs_err
    assert not golden.check(bad, mode="tolerance", rtol=0.0, atol=err / 2, root=root).ok
    assert golden.check(bad, mode="tolerance", rtol=0.0, atol=err * 2, root=root).ok
    # 3. bisection finds the step
    b = golden.bisect(llama_program, plan, golden.load("llama-tiny", root=root))
    assert b.step == 2 and b.pass_name == "test-perturb-mul" and not b.report.ok
    assert golden.bisect(llama_program, PassPlan.of("cse", "dce"), golden.load("llama-tiny", root=root)).step is None


def test_check_against_eager_on_fresh_inputs(llama_program):
    bad, _ = PassManager(check_numerics=False).run(llama_program, PassPlan.of("test-perturb-mul"))
    # one-token prompts: the captured graphs are bit-exact with eager there
    rep = golden.check_against_eager(bad, mode="exact", seeds=(11,), steps=2, prompt_lens=(1,))
    assert not rep.ok and not rep.exact and "eager" in rep.reference
    assert golden.check_against_eager(llama_program, mode="exact", seeds=(11,), steps=2, prompt_lens=(1,)).exact
    good = golden.check_against_eager(llama_program, mode="tolerance", seeds=(11,), steps=2, prompt_lens=(6,))
    assert good.ok and good.max_abs_err < 1e-4


def test_tampered_or_missing_golden_is_refused(llama_program, recorded, tmp_path):
    root, path = recorded
    import shutil

    copy = tmp_path / "llama-tiny" / "cpu-float32"
    shutil.copytree(path, copy)
    data = bytearray((copy / "outputs.pt").read_bytes())
    data[-100] ^= 0xFF
    (copy / "outputs.pt").write_bytes(bytes(data))
    with pytest.raises(GoldenError, match="sha256 does not match"):
        golden.check(llama_program, root=tmp_path)
    with pytest.raises(GoldenError, match="no golden record.*tkcc golden record --model llama-tiny"):
        golden.check(llama_program, root=tmp_path / "empty")


@pytest.mark.parametrize("threads", [1, 3])
def test_repository_golden_data_matches(llama_program, threads):
    """golden/llama-tiny/cpu-float32 in the repository: exact with the torch that recorded it, else tolerance,
    whatever thread count the process runs with (one thread sums a GEMM otherwise than several: the check runs
    with the record's count, and gives the process its own back)."""
    g = golden.load("llama-tiny", "float32", "cpu")
    same = (g.meta["torch_version"] == torch.__version__
            and g.meta.get("max_cache_len") == llama_program.meta["max_cache_len"])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rep = golden.check(llama_program, mode="exact" if same else "tolerance", golden=g)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert rep.ok, rep.summary()
    assert rep.token_agreement == 1.0
    assert g.meta["cpu_threads"] == golden.CPU_THREADS and not rep.notes, rep.notes
