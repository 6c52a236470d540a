"""tkcc.compile: same call as the model, report, user passes, HF call/generate, bad input."""
import json
import shutil
from pathlib import Path

import pytest
import torch

import tkcc
from tkcc.errors import ArtifactError, CaptureError, PlanError

ROOT = Path(__file__).resolve().parents[2]


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        y = self.lin(x)
        return self.norm((torch.relu(y) * 2.0 + torch.relu(y) * 2.0).pow(2)) + 1.0


def test_compile_plain_module_with_a_user_pass(tmp_path):
    torch.manual_seed(0)
    model = Small().eval()
    x = torch.randn(4, 16)
    compiled = tkcc.compile(model, example_inputs=(x,), plan=[{"name": "pow2-to-mul"}, {"name": "cse"},
                                                              {"name": "dce"}],
                            pass_modules=[str(ROOT / "examples" / "my_pass.py")], out_dir=tmp_path)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        xi = torch.randn(4, 16, generator=gen)
        with torch.no_grad():
            assert torch.equal(compiled(xi), model(xi))
    rep = compiled.report(print_report=False)
    data = json.loads(json.dumps(rep.to_json(), default=str))
    assert [p["name"] for p in data["passes"]] == ["pow2-to-mul", "cse", "dce"]
    assert data["passes"][0]["matched"] == 1 and data["passes"][1]["matched"] >= 2
    assert data["golden"]["ok"] and data["golden"]["exact"]
    assert data["speed"]["measured_on"]["device"] == "cpu" and data["speed"]["buckets"][0]["speedup"] > 0
    assert (tmp_path / "logs" / "01-pow2-to-mul.json").exists()
    assert "pow2-to-mul" in rep.text() and "measured on" in rep.text()
    # the compiled forward is the generated source of the artifact
    assert compiled.artifact is not None and "def " in compiled.artifact.source("forward")


WRONG_PASS = """
import operator
from tkcc.passes.base import register
from tkcc.passes.graph_pass import GraphPass

@register
class DoubleToTriple(GraphPass):
    \"\"\"Wrong on purpose: ``relu(y) * 2.0`` becomes ``* 3.0``.\"\"\"
    name = "test-compile-double-to-triple"
    exact = True
    params = {}

    def rewrite(self, gm, info, phase):
        for n in gm.graph.nodes:
            if n.op == "call_function" and len(n.args) == 2 and n.args[1] == 2.0:
                n.args = (n.args[0], 3.0)
                info.matched += 1
"""


def test_check_false_leaves_a_built_plan_to_the_callers_judgement(tmp_path):
    """A plan built with ``measure=False``: checked pass by pass by default (a wrong pass is named), and with
    ``check=False`` built unchecked, for a caller that judges it itself (benchmarks/decode.py, against fp32)."""
    from tkcc.errors import PassError

    path = tmp_path / "wrong_pass.py"
    path.write_text(WRONG_PASS)
    torch.manual_seed(0)
    model = Small().eval()
    x = torch.randn(4, 16)
    plan = [{"name": "test-compile-double-to-triple"}]
    with pytest.raises(PassError, match="test-compile-double-to-triple.*changed the outputs"):
        tkcc.compile(model, example_inputs=(x,), plan=plan, pass_modules=[str(path)], measure=False,
                     out_dir=tmp_path / "checked")
    compiled = tkcc.compile(model, example_inputs=(x,), plan=plan, pass_modules=[str(path)], measure=False,
                            check=False, out_dir=tmp_path / "unchecked")
    with torch.no_grad():
        assert not torch.allclose(compiled(x), model(x))  # built as asked: the judgement is the caller's
    assert compiled.report(print_report=False).to_json()["passes"][0]["matched"] >= 1


def test_compile_hf_model_call_and_generate(llama_program, tmp_path):
    compiled = tkcc.compile(llama_program.model, program=llama_program, measure=False, check=False, out_dir=tmp_path)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    logits = compiled(ids).logits  # what the model returns: an HF CausalLMOutput
    llama_program.reset_state()
    with torch.no_grad():
        ref = llama_program.graphs["prefill"](ids, torch.arange(5))
    llama_program.reset_state()
    assert logits.shape == (1, 5, 256) and torch.equal(logits, ref)
    from tkcc.frontend import greedy

    assert torch.equal(compiled.generate(ids, 4), greedy(llama_program, ids, 4))
    assert compiled.plan.to_json() == compiled.report(print_report=False).plan
    # an artifact that no longer matches its manifest is refused
    art = Path(compiled.artifact.path)
    bad = tmp_path / "tampered"
    shutil.copytree(art, bad)
    f = bad / "forward_decode.py"
    f.write_text(f.read_text() + "\n# edited\n")
    with pytest.raises(ArtifactError, match="forward_decode.py.*SHA-256"):
        type(compiled.artifact).open(bad)


def test_compile_bad_input():
    with pytest.raises(CaptureError, match="must be a torch.nn.Module, got builtins.function"):
        tkcc.compile(lambda x: x)
    with pytest.raises(PlanError, match=r"plan step 1 \('fuse-everything'\)"):
        tkcc.compile(Small(), example_inputs=(torch.randn(2, 16),), plan='[{"name": "fuse-everything"}]')
    with pytest.raises(PlanError, match="not bit-exact"):
        tkcc.compile(Small(), example_inputs=(torch.randn(2, 16),), plan='[{"name": "fuse_elementwise"}]')
