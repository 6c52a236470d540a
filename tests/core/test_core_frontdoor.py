"""The front door: tkcc.compile runs the loop and returns its winner, which saves, loads, and never loses to eager.

A fake clock decides every timing here (``tkcc.runtime.timing._perf_counter_ns``), so what serves is known
in advance and nothing depends on the machine's load.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tkcc
from tkcc.errors import ArtifactError, TkccError
from tkcc.runtime import timing

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    """Each timed call costs ``slow_ns``; a call of the model's own eager forward costs ``eager_ns``."""

    def __init__(self, eager_ns: int, slow_ns: int):
        self.t, self.eager_ns, self.slow_ns, self.last_eager = 0, eager_ns, slow_ns, False

    def __call__(self) -> int:
        self.t += self.eager_ns if self.last_eager else self.slow_ns
        self.last_eager = False
        return self.t


def _mark_eager(program, clock, monkeypatch):
    step = program.eager
    inner = step.forward

    def forward(*a, **k):
        out = inner(*a, **k)
        clock.last_eager = True
        return out
    monkeypatch.setattr(step, "forward", forward)


@pytest.fixture(scope="module")
def llama():
    """One capture for the module (seconds each): every test here starts from a prefill, which rewrites the
    cache it reads, and none keeps what it changed on the program (the eager hook is undone after its test)."""
    from tkcc.frontend import capture_model

    return capture_model("llama-tiny", max_cache_len=64)


@pytest.mark.parametrize("eager_fast", [True, False])
def test_compile_serves_what_measured_fastest_never_slower_than_eager(llama, monkeypatch, tmp_path, eager_fast):
    clock = FakeClock(eager_ns=1_000_000 if eager_fast else 9_000_000, slow_ns=3_000_000)
    _mark_eager(llama, clock, monkeypatch)
    monkeypatch.setattr(timing, "_perf_counter_ns", clock)
    compiled = tkcc.compile(llama.model, "azure-conv", program=llama, budget=0, progress=False, out_dir=tmp_path / "o")
    loop = compiled.report(print_report=False).loop
    side = loop["side_by_side"]
    assert side["eager"] is not None and side["captured graphs"] is not None
    assert side["winner"] >= side["eager"]  # invariant 7, on the loop's own numbers
    assert compiled.serves == ("eager" if eager_fast else "artifact")
    assert loop["serving"] == ("eager" if eager_fast else compiled.plan.hash())
    assert loop["note"].startswith("references only")  # budget 0: no search candidate ran
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    from tkcc.frontend import greedy

    assert torch.equal(compiled.generate(ids, 4), greedy(llama, ids, 4))


def test_a_tolerance_compile_judges_candidates_in_tolerance_on_a_reproducible_reference(llama, tmp_path):
    """The CPU reference reproduces its own bits, so ``auto`` validation would hold every candidate to them and
    refuse each inexact pass the tolerance search proposes (olmoe-16l's lowered step on an H200); the engine of
    a tolerance compile judges in tolerance (with the reference's greedy tokens), an exact one bit for bit."""
    for mode, want in (("tolerance", "validation tolerance (forced"), ("exact", "validation exact: the reference")):
        compiled = tkcc.compile(llama.model, "azure-conv", program=llama, budget=0, mode=mode, progress=False,
                                out_dir=tmp_path / mode)
        log = compiled.report(print_report=False).loop["log"]
        assert any(want in line for line in log), (mode, log)


def test_compile_call_returns_what_the_model_returns(llama, tmp_path):
    compiled = tkcc.compile(llama.model, program=llama, measure=False, out_dir=tmp_path / "o")
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = llama.model(ids)
    out = compiled(ids)
    assert type(out) is type(ref)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5, rtol=1e-4)
    assert isinstance(compiled(ids, return_dict=False), tuple)
    # a call the compiled prefill does not take is the model's own, unchanged
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, 0] = 0
    padded = compiled(ids, attention_mask=mask)
    with torch.no_grad():
        assert torch.equal(padded.logits, llama.model(ids, attention_mask=mask).logits)


_LOAD = textwrap.dedent("""
    import json, sys, torch
    import tkcc
    from tkcc.frontend.models import build_model
    model = build_model("llama-tiny", dtype=torch.float32)
    c = tkcc.load(sys.argv[1], model)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    print(json.dumps({"tokens": c.generate(ids, 6).tolist(), "serves": c.serves,
                      "captured": "prefill" in c.program.graphs}))
""")


def _load_in_subprocess(path, env=None):
    r = subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_save_then_load_in_a_fresh_process_exact_plan(llama, tmp_path):
    compiled = tkcc.compile(llama.model, program=llama, measure=False, out_dir=tmp_path / "o")
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    want = compiled.generate(ids, 6).tolist()
    compiled.save(tmp_path / "saved")
    got = _load_in_subprocess(tmp_path / "saved")
    assert got == {"tokens": want, "serves": "artifact", "captured": False}  # no graphs exported at load


_LOWERED = textwrap.dedent("""
    import json, sys, torch
    import tkcc
    from tkcc.kernels.common import fallbacks
    from tkcc.frontend.models import build_model
    model = build_model("llama-tiny", dtype=torch.float32)
    plan = [{"name": "lowered_decode", "params": {"attn_tile": "32x4", "attn_chunk": 64}}]
    c = tkcc.compile(model, plan=plan, mode="tolerance", measure=False, check=False, max_cache_len=48)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    c.save(sys.argv[1])
    print(json.dumps({"tokens": c.generate(ids, 8).tolist(), "fallbacks": fallbacks(),
                      "captured": tkcc.frontend.greedy(c.program, ids, 8).tolist(),
                      "source": c.artifact.source("decode")}))
""")


def test_save_then_load_in_a_fresh_process_lowered_decode_step_interpreted(tmp_path):
    """The graph-lowered step (its kernels live under the interpreter) is generated source like any candidate:
    saved, then loaded in a fresh process with no search, it gives the captured graphs' greedy tokens."""
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _LOWERED, str(tmp_path / "saved")], capture_output=True, text=True,
                       timeout=600, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    built = json.loads(r.stdout.strip().splitlines()[-1])
    assert "torch.ops.tkcc.attention_rope.default(" in built["source"] and "call_module" not in built["source"]
    assert built["fallbacks"] == {}  # every kernel ran (under the interpreter), none fell back to its reference
    assert built["tokens"] == built["captured"]
    manifest = json.loads((tmp_path / "saved" / "artifact" / "manifest.json").read_text())
    assert "tkcc.kernels.lowered" in manifest["runtime"]
    got = _load_in_subprocess(tmp_path / "saved", env)
    assert got["tokens"] == [built["tokens"][0][:6]] and got["serves"] == "artifact"


def test_load_refuses_another_model_versions_device_and_tampering(llama, tmp_path):
    compiled = tkcc.compile(llama.model, program=llama, measure=False, out_dir=tmp_path / "o")
    saved = compiled.save(tmp_path / "saved")
    from tkcc.frontend.models import build_model

    with pytest.raises(ArtifactError, match="saved for a LlamaForCausalLM, got a OlmoeForCausalLM"):
        tkcc.load(saved, build_model("olmoe-tiny"))
    with pytest.raises(ArtifactError, match="another model"):
        tkcc.load(saved, build_model("llama-tiny", num_hidden_layers=3))

    def edited(name, fn):
        d = tmp_path / name
        shutil.copytree(saved, d)
        fn(d)
        return d

    def meta_edit(key, value):
        def fn(d):
            m = json.loads((d / "tkcc.json").read_text())
            m[key] = value(m[key]) if callable(value) else value
            (d / "tkcc.json").write_text(json.dumps(m))
        return fn

    model = build_model("llama-tiny")
    with pytest.raises(ArtifactError, match=r"torch 9\.9"):
        tkcc.load(edited("v", meta_edit("versions", lambda v: {**v, "torch": "9.9"})), model)
    with pytest.raises(ArtifactError, match="compiled for cpu \\(NVIDIA H200\\)"):
        tkcc.load(edited("d", meta_edit("device_name", "NVIDIA H200")), model)
    with pytest.raises(ArtifactError, match="SHA-256"):
        tkcc.load(edited("t", lambda d: (d / "artifact" / "forward_decode.py").write_text("# edited\n")), model)
    with pytest.raises(ArtifactError, match="missing"):
        tkcc.load(edited("m", lambda d: (d / "artifact" / "forward_prefill.py").unlink()), model)
    with pytest.raises(ArtifactError, match="not valid JSON"):
        tkcc.load(edited("j", lambda d: (d / "tkcc.json").write_text('{"format": 1, "ser')), model)
    with pytest.raises(ArtifactError, match="no tkcc.json"):
        tkcc.load(tmp_path, model)


@pytest.mark.parametrize("budget, words", [(-5, ">= 0"), ("soon", "not a duration"), ("-3m", ">= 0"),
                                           (float("nan"), "finite")])
def test_bad_budget_is_refused_before_any_work(budget, words):
    from tkcc.frontend.models import build_model

    with pytest.raises(TkccError, match=words):
        tkcc.compile(build_model("llama-tiny"), budget=budget)


def test_model_argument_local_hf_dir_and_factory(tmp_path, capsys):
    from tkcc.cli import main
    from tkcc.frontend.models import build_model
    from tkcc.frontend.user_models import build_user_model

    src = build_model("llama-tiny")
    src.save_pretrained(tmp_path / "hf")
    loaded = build_user_model(str(tmp_path / "hf"))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, src(ids).logits)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TkccError, match="no config.json"):
        build_user_model(str(tmp_path / "empty"))
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "empty")
    with pytest.raises(TkccError, match="no weights"):
        build_user_model(str(tmp_path / "empty"))
    (tmp_path / "mf.py").write_text("import torch\ndef ok():\n    return torch.nn.Linear(2, 2)\n"
                                    "def bad():\n    return 3\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert isinstance(build_user_model("mf:ok"), torch.nn.Linear)
        with pytest.raises(TkccError, match="returned a int, not a torch.nn.Module"):
            build_user_model("mf:bad")
        with pytest.raises(TkccError, match="does not import"):
            build_user_model("no_such_module_xyz:f")
    finally:
        sys.path.remove(str(tmp_path))
    out = tmp_path / "out"
    assert main(["compile", "--model", str(tmp_path / "hf"), "--no-measure", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["model"] == "hf" and (out / "model" / "tkcc.json").exists()


def test_export_writes_a_campaigns_shipped_candidate_for_tkcc_load(tmp_path, capsys):
    from tkcc.agents.store import ExperimentStore
    from tkcc.cli import main
    from tkcc.frontend import capture, greedy
    from tkcc.frontend.models import build_model
    from tkcc.passes.plan import PassPlan

    plan = PassPlan.from_json('[{"name": "cse"}, {"name": "dce"}]')
    db = tmp_path / "s.db"
    store = ExperimentStore(str(db))
    cid = store.open_campaign("c1", "llama-tiny", {"device": "cpu"}, resume=False)
    store.record_ship(cid, plan.hash(), plan.to_json(), 1.0, "ship", "gain past the noise")
    store.close()
    out = tmp_path / "exported"
    assert main(["export", "c1", "--store", str(db), "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["candidate"] == plan.hash() and "rebuilt" in data["source"]
    model = build_model("llama-tiny")
    loaded = tkcc.load(out, model)
    assert loaded.plan.hash() == plan.hash()
    ids = torch.tensor([[5, 6, 7]])
    ref = capture(build_model("llama-tiny"))
    assert torch.equal(loaded.generate(ids, 4), greedy(ref, ids, 4))
    assert main(["export", "nope", "--store", str(db), "--out", str(tmp_path / "x"), "--json"]) == 2
    assert "no campaign 'nope'" in capsys.readouterr().out


def test_settling_the_heap_frees_what_an_earlier_settle_froze():
    """Each compiled model freezes what is alive (no collector scans in decode loops); the next one unfreezes
    first, so a forward swapped out of a server, or a model the caller dropped, is freed then (a cycle holding
    a tensor stands in for it), not frozen for the process's life."""
    import gc
    import weakref

    from tkcc.compiled import _settle_heap

    class Held:
        pass

    held = Held()
    held.self, held.cache = held, torch.zeros(8)
    alive = weakref.ref(held)
    try:
        _settle_heap()
        del held
        gc.collect()
        assert alive() is not None  # frozen: out of the collector's sight
        _settle_heap()
        assert alive() is None
    finally:
        gc.unfreeze()


def test_not_below_eager_reads_the_objectives_and_the_interval():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from registry import not_below

    assert not_below(500.0, 400.0, None) is True
    assert not_below(390.0, 400.0, {"low": 0.95, "high": 1.02, "within_noise": True}) is True  # within noise
    assert not_below(300.0, 400.0, {"low": 0.70, "high": 0.80, "within_noise": False}) is False
    assert not_below(300.0, 400.0, None) is False
    assert not_below(None, 400.0, None) is None  # nothing measured: no verdict


def test_registry_benchmark_smoke_gives_each_model_the_same_run_s_eager_and_winner(tmp_path):
    """``benchmarks/registry.py --smoke``: one tiny model compiled in its own process; its row holds the compile's
    own side by side (eager, the captured graphs, the winner) and the verdict drawn from them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import registry

    rows = registry.main(["--smoke", "--out", str(tmp_path / "registry.json")])
    assert len(rows) == 1 and "error" not in rows[0], rows
    r = rows[0]
    assert r["model"] == "llama-tiny" and r["eager_objective"] > 0 and r["winner_objective"] > 0
    assert r["winner_objective"] == max(r["winner_objective"], r["captured_objective"], r["eager_objective"])
    assert r["ok"] is registry.not_below(r["winner_objective"], r["eager_objective"], r["interval"])
    assert r["frontdoor_ms"] > 0 and r["hf_eager_ms"] > 0
    assert json.loads((tmp_path / "registry.json").read_text())[0]["model"] == "llama-tiny"


def test_frontdoor_compares_p90s_over_the_contexts_both_measured():
    """A variant measured at fewer contexts (a row cut or refused) gets its P90 compared with the front door's over
    those contexts only; over all of them the comparison is the plain one."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import decode as lab
    from frontdoor import same_contexts

    def rows(variant, pts):
        return [dict(model="m", context=c, variant=variant, routing="router", ms_per_token=ms) for c, ms in pts]

    fd = [(128, 1.0), (2048, 1.1), (8192, 1.6)]
    curve = rows("frontdoor", fd) + rows("lab_best", [(128, 1.0), (2048, 1.1)]) + rows("torch_compile",
                                                                                      [(c, 2 * ms) for c, ms in fd])
    got = same_contexts(lab, curve, "m")
    assert got["lab_best"]["contexts"] == [128, 2048]
    assert got["lab_best"]["frontdoor"] == pytest.approx(got["lab_best"]["lab_best"])  # the same curve there
    full = {o["variant"]: o["p90_decode_tokens_per_s"] for o in lab.objective_rows(curve, ["m"])
            if o["trace"] == "azure-conv"}
    assert full["frontdoor"] != pytest.approx(full["lab_best"])  # over its own contexts the lab looks faster
    assert got["torch_compile"]["contexts"] == [128, 2048, 8192]
    assert got["torch_compile"]["frontdoor"] == pytest.approx(full["frontdoor"])
    assert got["torch_compile"]["frontdoor"] == pytest.approx(2 * got["torch_compile"]["torch_compile"], rel=0.02)
