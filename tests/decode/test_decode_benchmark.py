"""benchmarks/decode.py --smoke: the benchmark's whole CPU path (tiny model, interpreter) writes sane rows."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_decode_benchmark_smoke(tmp_path):
    out = tmp_path / "decode.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--smoke", "--contexts", "4",
                        "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {r["variant"] for r in res["rows"]} == {"lowered", "floor"}  # the default variants: FRONT_DOOR's
    for key in ("model", "context", "routing", "variant", "ms_per_token", "floor_ms_per_token", "peak_mem_bytes"):
        assert all(key in r for r in res["rows"])
    low = [r for r in res["rows"] if r["variant"] == "lowered"]  # the graph-lowered step, through tkcc.compile
    assert low and all(r["ms_per_token"] > 0 and r["context"] == 4 and r["family"] == "llama" for r in low)
    assert all(r["plan"][0]["name"] == "lowered_decode" for r in low)
    assert all(r.get("family") for r in res["rows"])
    errs = res["notes"]["llama-tiny"]["front_door"]["first_step_logits_rel_err_vs_captured_graph"]
    assert set(errs) == {"lowered ctx 4"} and all(v < 1e-4 for v in errs.values())
    g = res["greedy"]["llama-tiny"][0]
    assert g["new_tokens"] == 2 and g["lowered"] == g["hf"]
    for ref in ("lowered_vs_hf", "lowered_vs_captured_graph"):  # the lowered step's tokens, and its decode step's logits
        assert g[ref]["identical"] and g[ref]["first_divergence"] is None, g
        assert g[ref]["logits_rel_err"] is not None and g[ref]["logits_rel_err"] < 1e-4, g
    assert "greedy_errors" not in res["notes"]
    assert res["meta"]["torch"] and res["meta"]["command"]


def test_moe_gptoss_explore_smoke_checks_every_config_against_the_reference(tmp_path):
    """benchmarks/moe_gptoss_explore.py --smoke: its plumbing (the op's configs argument, forced experts, the
    reference) on CPU under the interpreter; each config's error is the kernels' against moe_gptoss_ref."""
    out = tmp_path / "moe.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_gptoss_explore.py"), "--smoke", "--out",
                        str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert len(res["configs"]) == 2 and all(r["ok"] and 0 < r["rel_err"] < 1e-5 for r in res["configs"])
    assert res["measured_on"]["commit"] and res["bytes_per_block"] > 0


def test_moe_explore_smoke_checks_each_family_shape_against_the_reference(tmp_path):
    """benchmarks/moe_explore.py --smoke: tkcc.moe's plumbing for every family's router (softmax, fp32 softmax,
    DeepSeek's grouped sigmoid) on CPU under the interpreter; each error is the kernels' against moe_ref."""
    out = tmp_path / "moe.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_explore.py"), "--smoke", "--out", str(out)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    fams = json.loads(out.read_text())["families"]
    assert {f["shape"]["router"] for f in fams.values()} == {"softmax", "softmax_fp32", "sigmoid_grouped"}
    assert all(r["ok"] and 0 < r["rel_err"] < 1e-5 for f in fams.values() for r in f["configs"]), fams


def test_a_deleted_variant_is_refused():
    """--variants names front-door variants only: a FusedDecoder variant of older commands (tkcc_v4) is refused
    before any model is built, not run as nothing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode as bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--variants", "lowered", "tkcc_v4", "--out", "/nonexistent/decode.json"])
    assert e.value.code == 2


def test_objective_merges_runs_later_rows_win(tmp_path):
    """--objective-from with several runs: a later run's row replaces an earlier one's (same model, variant,
    routing, context), compile rows come from the fresh-process files, nothing replaced is dropped, and
    the ratio is the best tkcc variant's P90 over compile's (an older run's tkcc_* rows count too)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode as bench

    def row(variant, ctx, ms, routing="router"):
        return dict(model="m", variant=variant, routing=routing, context=ctx, ms_per_token=ms, peak_mem_bytes=0)

    files = {
        "a.json": [row("lowered", 128, 2.0), row("lowered", 8192, 3.0), row("hf_compile[x]", 128, 9.0),
                   row("hf_compile[x]", 8192, 9.0)],
        "b.json": [row("lowered", 128, 1.0), row("lowered", 8192, 1.5), row("tkcc_v4", 128, 1.2),
                   row("tkcc_v4", 8192, 1.2)],
        "c.json": [row("hf_compile[x]", 128, 4.0), row("hf_compile[x]", 8192, 4.0)],
    }
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps(dict(rows=rows)))
    res = bench.merged_objective([str(tmp_path / "a.json"), str(tmp_path / "b.json")], [str(tmp_path / "c.json")])
    assert len(res["replaced_rows"]) == 4  # a's two lowered rows and its two compile rows
    assert {r["source"] for r in res["replaced_rows"]} == {"a.json"}
    p90 = {(o["trace"], o["variant"]): o["p90_decode_tokens_per_s"] for o in res["objective"]}
    assert p90 and all(v is not None for v in p90.values())
    for r in res["ratios"]:
        assert r["compile_p90"] == pytest.approx(p90[(r["trace"], "hf_compile[x]")])
        assert r["tkcc_p90"] == max(p90[(r["trace"], "lowered")], p90[(r["trace"], "tkcc_v4")])
        assert r["ratio"] == pytest.approx(r["tkcc_p90"] / r["compile_p90"])
    # at every context lowered (b) is faster than compile (c) by 2.7-4x: so is its P90
    assert all(2.5 < r["ratio"] < 4.1 for r in res["ratios"]) and res["ratios"]


PROBE = """
import sys, weakref, torch
sys.path.insert(0, "benchmarks")
import decode as bench
import tkcc.frontend.capture
from tkcc.frontend.models import build_model
cap = sys.modules["tkcc.frontend.capture"]  # the module (tkcc.frontend's attribute of that name is the function)
progs = []
capture = cap.capture
def tracked(*a, **k):
    prog = capture(*a, **k)
    progs.append(weakref.ref(prog))
    return prog
cap.capture = tracked
reset = bench.peak_reset
def tracked_reset():
    n = reset()
    print("alive", len(progs), sum(r() is not None for r in progs), flush=True)
    return n
bench.peak_reset = tracked_reset
rows, notes = bench.frontdoor_rows(build_model("llama-tiny", torch.float32, "cpu"), "llama-tiny", [4, 12], 1, 1,
                                   variants=["lowered"])
assert [r["context"] for r in rows] == [4, 12] and "variant_fallbacks" not in notes, notes
"""


def test_no_row_keeps_an_earlier_rows_cache_alive():
    """Each row's peak memory is its own: when the counter is reset for a row, no earlier context's captured
    Program (its cache) is still allocated, and once a context's rows are taken its Program is freed, though
    tkcc.compile froze it (gc.freeze) while it was alive (a leftover reference once charged a 32k cache to the
    next row)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    alive = [tuple(map(int, ln.split()[1:])) for ln in p.stdout.splitlines() if ln.startswith("alive")]
    # (Programs captured so far, still alive): the row's own only at its reset, none after each context
    assert alive == [(1, 1), (1, 0), (2, 1), (2, 0)], alive


def test_real_routing_forces_each_steps_experts_and_advances():
    """The real-routing rows' step: a copy of the lowered graph whose MoE ops take a sampled real routing table's
    row per call (a device counter it advances, wrapping), the lowered graph itself untouched. On CPU the op
    runs its reference, ``moe_ref`` with the forced ids (the kernel's forced path: tkcc.passes.lower.checks)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode as bench

    from tkcc.frontend.capture import capture_model
    from tkcc.passes.manager import apply_plan

    prog = capture_model("olmoe-tiny", "float32", "cpu", max_cache_len=32, phases=["decode"])
    new, _ = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance", check_numerics=False)
    gm = new.graphs["decode"]
    forced, why = bench.forced_routing(gm, seed=3)
    n_moe = sum(n.target is torch.ops.tkcc.moe.default for n in gm.graph.nodes)
    assert forced is not None and f"{n_moe} MoE layers" in why, why
    assert not any("forced_ids" in n.kwargs for n in gm.graph.nodes)  # the original keeps routing by itself
    table = forced.tkcc_forced_ids
    assert tuple(table.shape) == (bench.REAL_TOKENS, n_moe, prog.model.config.num_experts_per_tok)
    assert all(len(set(r.tolist())) == r.numel() for r in table.reshape(-1, table.shape[-1])[:64])  # k distinct
    state = [b.clone() for b in prog.state.buffers()]

    def step(f, pos):
        for b, v in zip(prog.state.buffers(), state):
            b.copy_(v)
        with torch.no_grad():
            return f(torch.tensor([[5]]), torch.tensor([pos])).float()

    own = step(gm, 3)
    got = [step(forced, 3) for _ in range(3)]
    assert int(forced.tkcc_forced_step) == 3  # one row a call
    assert not torch.equal(got[0], own) and not torch.equal(got[0], got[1])  # each call its own row's experts
    # row 0 again after wrapping: the same output as the first call
    forced.tkcc_forced_step.zero_()
    assert torch.equal(step(forced, 3), got[0])
    forced.tkcc_forced_step.fill_(bench.REAL_TOKENS - 1)
    step(forced, 3)
    assert int(forced.tkcc_forced_step) == 0
    # the table forced to every layer's own choice for this input gives the unforced step
    own_ids = []
    real_moe = torch.ops.tkcc.moe.default

    def spy(*a, **k):
        from tkcc.kernels.lowered import rms_norm_ref

        x = a[0].reshape(1, -1) if a[1] is None else rms_norm_ref(a[0].reshape(1, -1), a[1], a[2])
        own_ids.append(torch.topk(torch.softmax(torch.nn.functional.linear(x, a[3]).float(), -1), a[6]).indices[0])
        return real_moe(*a, **k)

    for n in gm.graph.nodes:
        if n.target is real_moe:
            n.target = spy
    gm.recompile()
    try:
        step(gm, 3)
    finally:
        for n in gm.graph.nodes:
            if n.target is spy:
                n.target = real_moe
        gm.recompile()
    forced.tkcc_forced_ids[0] = torch.stack(own_ids).to(torch.int32)
    forced.tkcc_forced_step.zero_()
    assert torch.equal(step(forced, 3), own)


def test_real_routing_forces_gpt_oss_moe_blocks_too():
    """gpt-oss's MoE blocks (``tkcc.moe_gptoss``) take the real-routing rows as ``tkcc.moe`` does: a table of
    [steps, layers, k], one row a call; on CPU the op runs ``moe_gptoss_ref`` with the forced ids (the kernel's
    forced path: ``tkcc.passes.lower.checks``)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode as bench

    from tkcc.frontend.capture import capture_model
    from tkcc.passes.manager import apply_plan

    prog = capture_model("gptoss-tiny", "float32", "cpu", max_cache_len=32, phases=["decode"])
    new, _ = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance", check_numerics=False)
    gm = new.graphs["decode"]
    n_moe = sum(n.target is torch.ops.tkcc.moe_gptoss.default for n in gm.graph.nodes)
    forced, why = bench.forced_routing(gm, seed=3)
    assert n_moe == prog.num_blocks and forced is not None and f"{n_moe} MoE layers" in why, why
    assert tuple(forced.tkcc_forced_ids.shape) == (bench.REAL_TOKENS, n_moe, prog.model.config.num_experts_per_tok)
    state = [b.clone() for b in prog.state.buffers()]

    def step(f):
        for b, v in zip(prog.state.buffers(), state):
            b.copy_(v)
        with torch.no_grad():
            return f(torch.tensor([[5]]), torch.tensor([3])).float()

    own, got = step(gm), [step(forced) for _ in range(2)]
    assert not torch.equal(got[0], own) and not torch.equal(got[0], got[1])
    forced.tkcc_forced_step.zero_()
    assert torch.equal(step(forced), got[0])


def test_real_routing_is_refused_by_name_where_the_router_is_grouped():
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode as bench
    import tkcc.kernels.lowered  # noqa: F401 - registers torch.ops.tkcc

    g = torch.fx.Graph()
    h = g.placeholder("h")
    g.output(g.call_function(torch.ops.tkcc.moe.default, (h, None, 1e-6, h, h, h, 2, True, False, h),
                             {"router": "sigmoid_grouped"}))
    forced, why = bench.forced_routing(torch.fx.GraphModule(torch.nn.Module(), g))
    assert forced is None and "grouped" in why


def test_the_hf_timer_writes_at_the_row_s_context_however_often_it_runs():
    """HF's own decode step on its StaticCache (the ``hf_eager`` and ``torch_compile`` rows): transformers 5's cache
    writes where its running count says, so without the timer putting the count back, its repeated runs wrote
    past the context and, after max_cache_len calls, past the cache (IndexError). Each run writes at context ..
    context + n - 1 and nowhere else."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode as bench
    from tkcc.frontend.models import build_model

    model = build_model("llama-tiny", torch.float32, "cpu", max_position_embeddings=64)
    context, tokens = 20, 6
    run, cache = bench.hf_decode_timer(model, context, tokens, model.forward)
    keys = cache.layers[0].keys
    for _ in range(8):  # far more calls in all than the cache has positions past the context
        keys.normal_()  # what a run writes then differs from what was there
        before = keys.clone()
        run(tokens)
        moved = (keys != before).any(dim=-1).any(dim=1)[0].nonzero().flatten().tolist()
        assert moved == list(range(context, context + tokens)), moved
    with pytest.raises(ValueError):
        run(tokens + 1)
    # a sliding-window layer (gpt-oss: window 8) past its window rolls, as it would serving that context
    oss = build_model("gptoss-tiny", torch.float32, "cpu", max_position_embeddings=64)
    rows = bench.hf_rows(oss, "gptoss-tiny", [24], 8, 3, "hf_eager", oss.forward)
    assert rows[0]["context"] == 24 and rows[0]["ms_per_token"] > 0
