"""Artifacts: built atomically, verified by hash, loaded in a fresh process without the compiler."""
from __future__ import annotations

import json

import pytest
import torch

from codegen_helpers import Block, Pointwise, capture, run_python
from tkcc.codegen import Artifact, build_artifact
from tkcc.errors import ArtifactError
from tkcc.passes.manager import apply_plan
from tkcc.passes.plan import PassPlan

PLAN = PassPlan.of(("fuse_elementwise", {"num_warps": 2}))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("art")
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(2, 5, 32)
    prog = capture(m, (x,))
    fused, _ = apply_plan(prog, PLAN)
    art = build_artifact(fused, PLAN, d / "block", tier=2)
    torch.save(m.state_dict(), d / "weights.pt")
    return {"dir": d, "path": d / "block", "art": art, "model": m, "program": fused, "x": x}


def test_manifest_layout_and_hashes(built):
    art, path = built["art"], built["path"]
    man = json.loads((path / "manifest.json").read_text())
    assert man["plan"] == PLAN.to_json() and man["plan_hash"] == PLAN.hash()
    assert man["fingerprint"] == built["program"].fingerprint and man["tier"] == 2 and man["target"] == "triton"
    assert set(man["versions"]) == {"tkcc", "torch", "triton"}
    files = set(man["files"])
    assert {"_rt.py", "forward_forward.py", "kernels/__init__.py"} <= files
    assert len([f for f in files if f.startswith("kernels/fused_")]) == 3
    assert art.hash == man["artifact_hash"]
    # readable forward: parameters by qualified name, no weights embedded
    src = art.source("forward")
    assert "_rt.resolve(model, 'norm.weight')" in src and "constants.pt" not in files
    assert sum(p.stat().st_size for p in path.rglob("*")) < 200_000
    # nothing half-written left next to it
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".block")] == []


def test_loads_in_process_and_matches_program(built):
    fns = built["art"].load(built["program"])
    x = torch.randn(3, 4, 32)
    for a, b in zip(built["program"].graphs["forward"](x), fns["forward"](x)):
        assert torch.equal(a, b)


def test_loads_in_a_fresh_process_without_the_compiler(built):
    x = torch.randn(4, 6, 32)
    torch.save({"x": x, "want": built["program"].graphs["forward"](x)}, built["dir"] / "io.pt")
    code = f"""
import sys, torch
from codegen_helpers import Block
from tkcc.codegen.artifact import Artifact
m = Block().eval()
m.load_state_dict(torch.load({str(built['dir'] / 'weights.pt')!r}))
io = torch.load({str(built['dir'] / 'io.pt')!r})
fns = Artifact.open({str(built['path'])!r}).load(m)
got = fns["forward"](io["x"])
assert all(torch.equal(a, b) for a, b in zip(got, io["want"])), "outputs differ"
bad = [k for k in sys.modules if k.startswith(("tkcc.passes", "tkcc.frontend"))]
assert not bad, bad
print("OK", len(got))
"""
    assert "OK 2" in run_python(code).stdout


def test_exact_artifact_runs_its_kernels_under_the_interpreter_bitwise(tmp_path):
    torch.manual_seed(1)
    m = Pointwise().eval()
    x, y = torch.randn(2, 5, 32), torch.randn(5, 32)
    prog = capture(m, (x, y))
    plan = PassPlan.of("fuse_elementwise_exact")
    fused, _ = apply_plan(prog, plan)
    build_artifact(fused, plan, tmp_path / "pw")
    torch.save(m.state_dict(), tmp_path / "w.pt")
    x2, y2 = torch.randn(3, 7, 32), torch.randn(7, 32)
    torch.save({"x": x2, "y": y2, "want": m(x2, y2)}, tmp_path / "io.pt")
    code = f"""
import torch
from codegen_helpers import Pointwise
from tkcc.codegen.artifact import Artifact
m = Pointwise().eval()
m.load_state_dict(torch.load({str(tmp_path / 'w.pt')!r}))
io = torch.load({str(tmp_path / 'io.pt')!r})
art = Artifact.open({str(tmp_path / 'pw')!r})
got = art.load(m)["forward"](io["x"], io["y"])
for a, b in zip(got, io["want"]):
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0)), (a - b).abs().max()
runs = {{k: v.stats["kernel"] for k, v in art.launchers().items()}}
assert runs and all(v == 1 for v in runs.values()), runs
print("OK")
"""
    assert "OK" in run_python(code, env_extra={"TRITON_INTERPRET": "1"}).stdout


def test_tampered_file_names_the_file(built, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(built["path"], copy)
    Artifact.open(copy)  # a faithful copy opens
    kfile = next((copy / "kernels").glob("fused_norm_*.py"))
    kfile.write_text(kfile.read_text().replace("tl.rsqrt(", "tl.sqrt("))
    with pytest.raises(ArtifactError, match=kfile.name):
        Artifact.open(copy)


def test_edited_manifest_missing_and_extra_files_rejected(built, tmp_path):
    import shutil

    a = tmp_path / "a"
    shutil.copytree(built["path"], a)
    man = json.loads((a / "manifest.json").read_text())
    man["tier"] = 99
    (a / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match="artifact_hash"):
        Artifact.open(a)
    b = tmp_path / "b"
    shutil.copytree(built["path"], b)
    (b / "_rt.py").unlink()
    with pytest.raises(ArtifactError, match="_rt.py"):
        Artifact.open(b)
    c = tmp_path / "c"
    shutil.copytree(built["path"], c)
    (c / "kernels" / "evil.py").write_text("print('hi')\n")
    with pytest.raises(ArtifactError, match="evil.py"):
        Artifact.open(c)
    with pytest.raises(ArtifactError, match="no manifest.json"):
        Artifact.open(tmp_path)


def test_artifact_for_another_model_is_refused(built):
    art = built["art"]
    with pytest.raises(ArtifactError, match="norm.weight"):
        art.load(Block(d=16).eval())
    other = capture(Block().eval(), (built["x"],))
    other.fingerprint = "another-model"
    with pytest.raises(ArtifactError, match="fingerprint"):
        art.load(other)
    with pytest.raises(ArtifactError, match="Program or an nn.Module"):
        art.load("model")


def test_bad_target_and_rebuild_replaces(built, tmp_path):
    with pytest.raises(ArtifactError, match="target"):
        build_artifact(built["program"], PLAN, tmp_path / "x", target="nki")
    assert not (tmp_path / "x").exists()
    first = build_artifact(built["program"], PLAN, tmp_path / "y")
    again = build_artifact(built["program"], PLAN, tmp_path / "y")
    assert first.hash == again.hash  # deterministic: same program and plan, same artifact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["y"]


def test_aot_binaries_in_the_artifact(built, tmp_path):
    art = build_artifact(built["program"], PLAN, tmp_path / "aot", aot_targets=("sm_90", "gfx942"))
    entries = art.manifest["aot"]
    assert {e["target"] for e in entries} == {"sm_90", "gfx942"}
    assert {e["kernel"] for e in entries} == set(art.manifest["kernels"])
    for e in entries:
        blob = (tmp_path / "aot" / e["file"]).read_bytes()
        assert blob[:4] == b"\x7fELF" and len(blob) > 1000
        assert e["file"].endswith(".cubin" if e["target"] == "sm_90" else ".hsaco")


def _my_helper(x):
    return x * 2


def test_unimportable_call_is_refused_naming_the_node(built, tmp_path):
    prog = built["program"]
    gm = prog.graphs["forward"]
    from tkcc.passes.graph_pass import clone_graph_module

    g2 = clone_graph_module(gm)
    out = g2.graph.find_nodes(op="output")[0]
    first = out.args[0][0]
    with g2.graph.inserting_before(out):
        bad = g2.graph.call_function(_my_helper, (first,))
    out.args = ((bad,) + tuple(out.args[0][1:]),)
    g2.recompile()
    with pytest.raises(ArtifactError, match=rf"node '{bad.name}'.*_my_helper"):
        build_artifact(prog.with_graphs({"forward": g2}), PLAN, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and list(tmp_path.iterdir()) == []
