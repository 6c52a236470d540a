"""Decode at long context on OLMoE's attention shape (MHA, heads of 128, q/k norm over the whole projection), CPU.

On the H200 both front-door steps of olmoe-16l were refused at context 8192 (first-step logits 0.665 and 0.27
off the captured graph, 0.03 at 128). On CPU, in fp32 under the Triton interpreter, every piece they run
matches its reference there: the attention kernels at every layout the tuners try, with the new token on a
split boundary (its split holds no cached position), and the whole lowered step with the tuning steps that
write cache rows inside the context (the fused step, since deleted, was checked the same way). Near-tied expert choices do not explain it either: one
flipped choice moves olmoe-16l's logits by 0.4-1.6%, the engine's one-rounding-step perturbation of the
cache by at most 2%. So the benchmark judges a front-door step against the captured graph run in fp32
(``judge_first_step``), where a correct bf16 step is within ~0.02, and reports how far the bf16 reference
itself is from fp32: a GPU run then says which of the three is off (tests/decode/test_long_context_gpu.py).

The interpreter must be on before triton is imported: the kernel runs are one subprocess (this file, run as a
script, started with the module).
"""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).parent))


LONG_TEST = "test_attention_at_long_context_matches_its_reference_interpreter"
STEP_TEST = "test_long_context_steps_with_their_tuning_match_the_captured_graph_interpreter"


@pytest.fixture(scope="module", autouse=True)
def interpreter_run(request):
    """The module's interpreter cases (the attention_long checks, the tuned step) in one subprocess, this file run as
    a script, started with the module (tests/decode/interp_proc.py): its imports are paid once and it runs beside
    the in-process tests. Only the parts whose tests are selected run."""
    from interp_proc import InterpRun

    wanted = {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}
    parts = [part for part, test in (("checks", LONG_TEST), ("step", STEP_TEST)) if test in wanted]
    run = InterpRun([__file__, *parts]) if parts else None
    yield run
    if run is not None:
        run.close()


def test_first_step_is_judged_against_fp32():
    """A step within rounding of the fp32 run passes even where the bf16 reference is itself off fp32; a step
    off fp32 fails and its reason gives both distances; with no fp32 run the bf16 reference judges."""
    from decode import VARIANT_TOL, judge_first_step

    g = torch.Generator().manual_seed(0)
    ref32 = torch.randn(1, 1, 500, generator=g)
    noise = lambda s: ref32 + s * ref32.norm() / 500 ** 0.5 * torch.randn(ref32.shape, generator=g)  # noqa: E731
    good, bad_ref, wrong = noise(0.02), noise(0.3), noise(0.4)
    ok, errs, why = judge_first_step(good, bad_ref, ref32)
    assert ok and why == "" and errs["vs_fp32"] < 0.05 and errs["vs_captured_graph"] > VARIANT_TOL
    assert errs["captured_graph_vs_fp32"] > VARIANT_TOL  # the report says the bf16 reference is the one off
    ok, errs, why = judge_first_step(wrong, good, ref32)
    assert not ok and errs["vs_fp32"] >= VARIANT_TOL
    assert "fp32" in why and f"{errs['vs_captured_graph']:.3g}" in why
    assert judge_first_step(good, ref32)[0] and not judge_first_step(wrong, ref32)[0]  # the bf16 reference judges


def test_where_the_bf16_reference_is_itself_off_fp32_a_step_as_close_as_it_passes_and_a_far_one_fails():
    """qwen3moe-16l at 8k (random weights, router near ties): the bf16 graph 0.60 from fp32, the lowered step
    0.25 from it, refused by the plain bound. As close as the model's own bf16 graph (within AS_GOOD) passes,
    saying why; further, or unrelated logits, fail."""
    from decode import AS_GOOD, VARIANT_TOL, judge_first_step

    g = torch.Generator().manual_seed(1)
    ref32 = torch.randn(1, 1, 4000, generator=g)
    noise = lambda s: ref32 + s * ref32.norm() / 4000 ** 0.5 * torch.randn(ref32.shape, generator=g)  # noqa: E731
    off_ref = noise(0.6)
    ok, errs, why = judge_first_step(noise(0.25), off_ref, ref32)
    assert ok and why == "" and errs["vs_fp32"] > VARIANT_TOL and "itself" in errs["judged_by"]
    ok, errs, why = judge_first_step(noise(0.6 * AS_GOOD * 1.2), off_ref, ref32)
    assert not ok and "fp32" in why and "judged_by" not in errs
    unrelated = torch.randn(ref32.shape, generator=g)
    assert not judge_first_step(unrelated, noise(1.5), ref32)[0]  # however far the reference is off
    ok, errs, _ = judge_first_step(noise(0.05), off_ref, ref32)
    assert ok and "judged_by" not in errs  # within the plain bound: no excuse needed


def test_where_the_bf16_graph_jumps_under_one_rounding_step_a_step_within_the_jump_passes():
    """minimax-16l at 128 on an H200: the bf16 graph 0.019 from fp32, but 0.18 away from itself under one rounding
    step of its cache (a router near tie); the lowered step 0.105 from fp32 was refused by the plain bound. Within
    AS_GOOD times the jump it passes, saying why; past it, or with a stable graph, the bound holds."""
    from decode import AS_GOOD, VARIANT_TOL, judge_first_step

    g = torch.Generator().manual_seed(2)
    ref32 = torch.randn(1, 1, 4000, generator=g)
    noise = lambda s: ref32 + s * ref32.norm() / 4000 ** 0.5 * torch.randn(ref32.shape, generator=g)  # noqa: E731
    ref, step = noise(0.019), noise(0.105)
    assert not judge_first_step(step, ref, ref32)[0]
    ok, errs, why = judge_first_step(step, ref, ref32, jump=0.18)
    assert ok and why == "" and "rounding step" in errs["judged_by"]
    assert not judge_first_step(noise(0.18 * AS_GOOD * 1.2), ref, ref32, jump=0.18)[0]
    assert not judge_first_step(step, ref, ref32, jump=0.9 * VARIANT_TOL)[0]  # a stable graph: the plain bound


def test_a_step_refused_on_distance_is_judged_by_the_engine_s_near_tie_rule():
    """``decode.engine_opinion``, asked where ``judge_first_step`` refuses: a step that computes exactly but routes
    a near-tied token the other way passes on the fp32 graph with that choice flipped; a wrong step does not; the
    cache is left as it was."""
    from decode import engine_opinion
    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model
    from tkcc.runtime.exact_reference import decisions_of, upcast
    from tkcc.runtime.validation import StateGuard, exact_run, scaled_error

    m = build_model("olmoe-tiny", torch.bfloat16, "cpu")
    prog = capture(m, phases=["decode"], max_cache_len=48)
    up = upcast(prog.graphs["decode"])
    d = decisions_of(up)
    for seed in range(60):  # a draw with a near tie whose flip moves the logits
        g = torch.Generator().manual_seed(seed)
        prog.state.fill_random(30, g)
        tok, pos = torch.randint(0, m.config.vocab_size, (1, 1), generator=g), torch.tensor([30])
        guard = StateGuard(prog.state)
        exact, _, near = exact_run(up, (tok, pos), guard, {})
        if not near:
            continue
        d.flip = frozenset({min(near)[1:]})
        try:
            with torch.no_grad():
                flipped = up(tok, pos)
        finally:
            d.flip = frozenset()
        guard.restore()
        flipped = (flipped[0] if isinstance(flipped, (tuple, list)) else flipped).to(torch.bfloat16).float()
        moved = scaled_error(exact[0], flipped)[2]
        if moved / 2 > 1.25 * 2.0 ** -9:  # half of it is still past bf16's rounding of the logits
            break
    else:
        pytest.fail("no draw in 60 with a near tie whose flip moves the logits past bf16's rounding")
    ref = exact[0].to(torch.bfloat16).float()  # the bf16 graph agreeing with fp32 on every choice
    bound = moved / 2
    left = [b.clone() for b in prog.state.buffers()]
    ok, found = engine_opinion(prog, tok, pos, ref, flipped, torch.bfloat16, bound=bound)
    assert ok and "decided the other way" in found, found
    wrong = exact[0] * (1 + 4 * bound)
    ok, found = engine_opinion(prog, tok, pos, ref, wrong, torch.bfloat16, bound=bound)
    assert not ok and "fp32" in found
    assert all(torch.equal(a, b) for a, b in zip(prog.state.buffers(), left))


def test_front_door_check_takes_the_fp32_run_and_leaves_the_cache():
    """frontdoor_rows on a bf16 model (CPU: the steps take their reference arithmetic): the captured graph's fp32
    run judges the lowered step, the notes give its distance from it, the bf16 graph's own, and the
    bf16 graph's jump under a one-rounding-step perturbation of its cache; the perturbation is put back."""
    import decode as bench
    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model

    model = build_model("olmoe-tiny", torch.bfloat16, "cpu")
    rows, notes = bench.frontdoor_rows(model, "olmoe-tiny", [60], tokens=1, reps=1,
                                       variants=["lowered"], family="olmoe")
    assert "variant_fallbacks" not in notes, notes.get("variant_fallbacks")
    assert {r["variant"] for r in rows} == {"lowered"}
    vs32 = notes["first_step_logits_rel_err_vs_fp32"]
    assert set(vs32) == {"lowered ctx 60"} and all(0 < v < 0.05 for v in vs32.values())
    assert 0 < notes["captured_graph_vs_fp32"]["ctx 60"] < 0.05
    assert len(notes["captured_graph_jump_under_one_rounding_step"]["ctx 60"]) == 1  # stable: one draw
    assert 0 < notes["captured_graph_jump_under_one_rounding_step"]["ctx 60"][0] < 0.1

    prog = capture(model, phases=["decode"], max_cache_len=40)
    prog.state.fill_random(30, torch.Generator().manual_seed(1))
    before = [b.clone() for b in prog.state.buffers()]
    tok, pos = torch.tensor([[3]]), torch.tensor([30])
    with torch.no_grad():
        ref = prog.graphs["decode"](tok, pos).float()
        for b, v in zip(prog.state.buffers(), before):
            b.copy_(v)
    assert bench.reference_jump(prog, tok, pos, ref, seed=5) > 0
    assert all(torch.equal(a, b) for a, b in zip(before, prog.state.buffers()))


def _step_check():
    """The subprocess of the slow test above (TRITON_INTERPRET=1): one JSON line per step."""
    import random

    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model
    from tkcc.kernels import gemv as gemv_mod, moe_routed as mr
    from tkcc.passes.lower import tune as tuning
    from tkcc.passes.manager import apply_plan

    c = 200
    model = build_model("olmoe-tiny", torch.float32, "cpu", hidden_size=128, num_attention_heads=1,
                        num_key_value_heads=1, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                        num_hidden_layers=1, vocab_size=64)
    prog = capture(model, phases=["decode"], max_cache_len=c + 40)
    prog.state.fill_random(c, torch.Generator().manual_seed(c))
    bufs = list(prog.state.buffers())
    snap = [b.clone() for b in bufs]
    tok, pos = torch.tensor([[11]]), torch.tensor([c])
    first = lambda x: (x[0] if isinstance(x, (tuple, list)) else x).float().reshape(-1)  # noqa: E731
    with torch.no_grad():
        ref = first(prog.graphs["decode"](tok, pos))
    for b, s in zip(bufs, snap):
        b.copy_(s)
    rng, calls = random.Random(0), [0]

    def clock(fn, *_a, **_k):  # every candidate runs (and writes what it writes); the times are made up
        calls[0] += 1
        fn()
        return rng.random()

    def changed():  # the state buffers whose contents tuning left different (before the step itself writes c)
        return [i for i, (b, s) in enumerate(zip(bufs, snap)) if not torch.equal(b, s)]

    def report(variant, rows_changed, got, **kw):
        print(json.dumps(dict(variant=variant, timer_calls=calls[0], rows_changed=rows_changed,
                              rel_err=float((got - ref).norm() / ref.norm()), **kw)), flush=True)
        for b, s in zip(bufs, snap):
            b.copy_(s)

    # two candidates of each kernel config list, each one an interpreted launch. Both of a few large programs:
    # the interpreter runs a launch's programs one by one in Python (the lists' first configs, 1-4 rows each, made
    # this run ~100 programs a launch and ~2.5 minutes long); what is checked is what tuning leaves, not a config
    gemv_mod.CONFIGS[:] = [gemv_mod.INTERP_CONFIG, (32, 256, 8)]
    mr.ROUTER_CONFIGS[:] = [(4, 8), (2, 4)]
    mr.GATE_UP_CONFIGS[:] = [(16, 4), (8, 8)]
    mr.DOWN_CONFIGS[:] = [(16, 4), (32, 4)]
    new, _ = apply_plan(prog, [{"name": "lowered_decode", "params": {"tune": False}}], mode="tolerance",
                        check_numerics=False)
    gm = new.graphs["decode"]
    with torch.no_grad():
        tuned = tuning.tune_gemvs(gm, clock)
        tuning.tune_moes(gm, clock)
        att = tuning.tune_attention(gm, clock, 128, ["64x4", "16x4"])
        tuning.refine_in_step(gm, clock, tuned, 128)
        gm.recompile()
        left = changed()
        got = first(gm(tok, pos))
    report("lowered", left, got, tuned_at=att["context"])


def _checks():
    """The attention_long family of tkcc.kernels.checks (fp32), one JSON line {"checks": n, "failed"}."""
    from tkcc.kernels.checks import run_checks

    rows = run_checks("cpu", torch.float32, ["attention_long"])
    print(json.dumps({"checks": len(rows), "failed": [r for r in rows if not r["ok"]]}), flush=True)


if __name__ == "__main__":  # the module's subprocess (TRITON_INTERPRET=1): the parts named, in order
    if "checks" in sys.argv[1:]:
        _checks()
    if "step" in sys.argv[1:]:
        _step_check()


# ---- under the interpreter (one subprocess, started with the module: these read it, last) ----------------------

def test_attention_at_long_context_matches_its_reference_interpreter(interpreter_run):
    """tkcc.kernels.checks' attention_long family (fp32): MHA heads of 128 with the whole-projection q/k norm
    and a GQA head, the new token on a split boundary and inside a split, 19 splits (combine launch), 10
    (merged in the kernel), 3, a grid laid out for a shorter span; the fused kernel and the separate path,
    one layout's scratch over several layers' caches."""
    (res,) = [r for r in interpreter_run.lines(timeout=900) if "checks" in r]
    assert res["checks"] >= 16 and not res["failed"], json.dumps(res["failed"], indent=1)


@pytest.mark.slow
def test_long_context_steps_with_their_tuning_match_the_captured_graph_interpreter(interpreter_run):
    """A one-layer OLMoE-like model with OLMoE's attention (MHA, a head of 128) at context 200 (fp32,
    interpreter): the lowered step after its tuners ran (a fake clock that calls every candidate: GEMVs, MoE,
    the attention layout at context 128, the GEMVs again in the whole step) leaves every cache row as it was and
    gives the captured graph's logits."""
    got = {r["variant"]: r for r in interpreter_run.lines(timeout=900) if "variant" in r}
    assert set(got) == {"lowered"}
    r = got["lowered"]
    assert r["timer_calls"] > 5 and r["rows_changed"] == [] and r["rel_err"] < 1e-4, r
    assert r["tuned_at"] == 129  # the attention layout was timed at a position inside the context
