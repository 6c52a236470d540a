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


def _runs(seed: int, steps: int = 3, vocab: int = 50, tie_at: int | None = None, flip_at: int | None = None):
    """One reference run (prefill logits [1, 4, V], decode logits [steps, 1, V], tokens [1, steps+1]) and a
    candidate within 1e-3 of it, teacher-forced, whose chosen token is swapped for the runner-up at
    ``flip_at``; ``tie_at`` gives the reference a top-2 gap of 1e-4 there (a near tie)."""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(1, 4, vocab, generator=g, dtype=torch.float64) * 3
    dec = torch.randn(steps, 1, vocab, generator=g, dtype=torch.float64) * 3
    chosen = [pre[:, -1]] + [dec[s] for s in range(steps)]
    for j, lg in enumerate(chosen):
        top = lg[0].topk(2).indices
        lg[0, top[1]] = lg[0, top[0]] - (1e-4 if j == tie_at else 1.0)
    got_pre, got_dec = pre.clone(), dec.clone()
    got_pre += 1e-3 * torch.rand(pre.shape, generator=g, dtype=torch.float64)
    got_dec += 1e-3 * torch.rand(dec.shape, generator=g, dtype=torch.float64)
    toks = torch.stack([lg[0].argmax() for lg in chosen])[None]
    got_toks = toks.clone()
    if flip_at is not None:
        got_toks[0, flip_at] = chosen[flip_at][0].topk(2).indices[1]
    return (pre, dec, toks), (got_pre, got_dec, got_toks)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tolerance_holds_greedy_tokens_only_where_the_reference_is_decisive(seed):
    """In tolerance mode a candidate within the bound that flips a near tie (top-2 gap inside 2 x the bound x the
    scale) passes, with a note, as the engine's validation judges it; the same flip where the reference's choice
    is clear fails; exact mode and a zero bound hold every token."""
    steps = 3
    for j in range(steps + 1):
        ref, got = _runs(seed, steps, tie_at=j, flip_at=j)
        rep = golden._compare_lm("m", "tolerance", 1e-2, 1e-2, "ref", [ref], [got])
        assert rep.ok and rep.token_agreement < 1.0 and rep.first_token_mismatch is None
        assert any("near tie" in n for n in rep.notes)
        assert not golden._compare_lm("m", "tolerance", 0.0, 1e-2, "ref", [ref], [got]).ok
        assert not golden._compare_lm("m", "exact", None, None, "ref", [ref], [got]).ok
        ref, got = _runs(seed, steps, tie_at=(j + 1) % (steps + 1), flip_at=j)  # the flip where the choice is clear
        rep = golden._compare_lm("m", "tolerance", 1e-2, 1e-2, "ref", [ref], [got])
        assert not rep.ok and rep.first_token_mismatch.startswith(f"prompt 0, token {j}:")
    ref, got = _runs(seed, steps, tie_at=1)  # no flip: every token agrees
    rep = golden._compare_lm("m", "tolerance", 1e-2, 1e-2, "ref", [ref], [got])
    assert rep.ok and rep.token_agreement == 1.0 and not rep.notes
