"""PassManager, pass logs, general passes, a user's hand-written pass, bad plans and broken passes."""
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.fx

from tkcc.errors import PassError, PlanError
from tkcc.frontend.program import Program
from tkcc.passes import Pass, PassPlan, register
from tkcc.passes.general import DEFAULT_EXACT_PLAN
from tkcc.passes.graph_pass import GraphPass
from tkcc.passes.lint import compare, run_graph
from tkcc.passes.log import read_logs, write_logs
from tkcc.passes.manager import PassManager, load_pass_module

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]


def _program(gm, *inputs, phase="forward"):
    return Program(graphs={phase: gm}, example_inputs={phase: tuple(inputs)}, layer_map={phase: {}}, num_blocks=0,
                   model=gm, fingerprint="test")


def _with_vals(gm, *inputs):
    """Record real values as node.meta['val'] (what capture records as fake tensors)."""

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):
            if n.target is aten._assert_tensor_metadata.default:
                return None  # one of the test's asserts is false on purpose
            r = super().run_node(n)
            n.meta["val"] = r
            return r

    Rec(gm).run(*[x.clone() for x in inputs])
    return gm


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_plan_roundtrip_logs_and_fresh_inputs(small_program, tmp_path):
    plan = PassPlan.of(*DEFAULT_EXACT_PLAN)
    again = PassPlan.from_json(plan.dumps())
    assert again == plan and again.hash() == plan.hash()
    before = small_program.graphs["forward"].code
    out, logs = PassManager().run(small_program, plan)
    assert small_program.graphs["forward"].code == before  # input program untouched
    assert [lg.name for lg in logs] == [s.name for s in plan.steps]
    assert out.meta["plan_hash"] == plan.hash()
    cse = next(lg for lg in logs if lg.name == "cse")
    assert cse.matched >= 2 and cse.removed == cse.matched  # relu and mul computed twice
    assert all(p.check in ("exact", "unchanged") for lg in logs for p in lg.phases.values())
    assert all(lg.time_s > 0 for lg in logs)
    assert "relu_1" in cse.phases["forward"].code_before and "relu_1" not in cse.phases["forward"].code_after
    # the rewritten graph equals the model on fresh random inputs, bit for bit
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        x = torch.randn(4, 16, generator=gen) * 3
        assert torch.equal(out.graphs["forward"](x), small_program.eager(x))
    # logs round-trip through a directory
    d = write_logs(logs, tmp_path / "logs")
    assert (d / f"{cse.stem}.json").exists() and (d / f"{cse.stem}.forward.after.py").exists()
    back = read_logs(d)
    assert [b.summary() for b in back] == [lg.summary() for lg in logs]
    assert back[0].phases["forward"].code_after == logs[0].phases["forward"].code_after


def test_parameters_are_shared_not_copied(small_program):
    out, _ = PassManager().run(small_program, PassPlan.of(*DEFAULT_EXACT_PLAN))
    gm = out.graphs["forward"]
    params = {id(p) for p in small_program.model.parameters()}
    attrs = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            attrs.append(obj)
    assert attrs and all(id(a) in params for a in attrs)


def test_cse_respects_mutation_randomness_and_merges_pure():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    buf = g.call_function(aten.clone.default, (x,))
    s1 = g.call_function(aten.sum.default, (buf,))
    g.call_function(aten.add_.Tensor, (buf, 1.0))  # in-place write between two identical reads
    s2 = g.call_function(aten.sum.default, (buf,))
    z1 = g.call_function(aten.zeros.default, ([3],), {"dtype": torch.float32})
    z2 = g.call_function(aten.zeros.default, ([3],), {"dtype": torch.float32})
    g.call_function(aten.fill_.Scalar, (z1, 2.0))  # z1 is written: z1 and z2 must stay two buffers
    r1 = g.call_function(aten.rand_like.default, (x,))
    r2 = g.call_function(aten.rand_like.default, (x,))
    p1 = g.call_function(aten.mul.Tensor, (x, 2.0))
    p2 = g.call_function(aten.mul.Tensor, (x, 2.0))  # pure duplicate: merged
    p3 = g.call_function(aten.mul.Tensor, (x, 2))  # int 2 is not float 2.0 (dtype promotion differs)
    g.output((s1, s2, z1, z2, r1, r2, p1, p2, p3))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    x0 = torch.randn(5)
    out, logs = PassManager(check_numerics=False).run(_program(gm, x0), PassPlan.of("cse"))
    new = out.graphs["forward"]
    assert logs[0].phases["forward"].removed == [p2.name]
    assert _targets(new).count(aten.sum.default) == 2
    assert _targets(new).count(aten.zeros.default) == 2
    assert _targets(new).count(aten.rand_like.default) == 2
    torch.manual_seed(0)
    a = gm(x0.clone())
    torch.manual_seed(0)
    b = new(x0.clone())
    assert compare(a, b, exact=True).ok


def test_dce_keeps_side_effects_and_removes_dead_chains():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    buf = g.call_function(aten.clone.default, (x,))
    g.call_function(aten.add_.Tensor, (buf, 1.0))  # unused result, but a write: kept
    dead = g.call_function(aten.exp.default, (x,))
    dead2 = g.call_function(aten.mul.Tensor, (dead, 3.0))  # dead chain
    g.call_function(aten.rand_like.default, (x,))  # unused random op: kept (it advances the RNG)
    g.output(g.call_function(aten.mul.Tensor, (buf, 2.0)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    x0 = torch.randn(4)
    out, logs = PassManager().run(_program(gm, x0), PassPlan.of("dce"))
    assert sorted(logs[0].phases["forward"].removed) == sorted([dead.name, dead2.name])
    assert aten.add_.Tensor in _targets(out.graphs["forward"])
    assert aten.rand_like.default in _targets(out.graphs["forward"])
    assert torch.equal(out.graphs["forward"](x0.clone()), (x0 + 1) * 2)


def _sync_graph():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.mul.Tensor, (x, 2.0))
    g.call_function(aten._assert_tensor_metadata.default, (y,), {"dtype": torch.float32, "device": torch.device("cpu")})
    g.call_function(aten._assert_tensor_metadata.default, (y,), {"dtype": torch.float16})  # false: kept
    s = g.call_function(aten.sum.default, (y,))
    item = g.call_function(aten._local_scalar_dense.default, (s,))  # unused host read
    g.call_function(aten._assert_scalar.default, (True, "always true"))
    pos = g.call_function(aten.gt.Scalar, (s, -1e30))
    g.call_function(aten._assert_async.msg, (pos, "data-dependent check"))
    used = g.call_function(aten._local_scalar_dense.default, (g.call_function(aten.amax.default, (x,)),))
    out = g.call_function(aten.add.Tensor, (y, used))  # this host read feeds the output: kept
    g.output(out)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    gm.names = {"item": item.name, "assert_scalar": [n.name for n in g.nodes if n.target is aten._assert_scalar.default][0]}
    return gm


@pytest.mark.parametrize("asserts", ["proven", "all"])
def test_host_sync_removal(asserts):
    x0 = torch.randn(6)
    gm = _sync_graph()
    _with_vals(gm, x0)
    prog = _program(gm, x0)
    # the graph as built raises on the false metadata assert; the pass must keep it, so run without numerics
    out, logs = PassManager(check_numerics=False).run(prog, PassPlan.of(("host-sync-removal", {"asserts": asserts})))
    targets = _targets(out.graphs["forward"])
    assert targets.count(aten._assert_tensor_metadata.default) == 1  # only the provably false one stays
    assert aten._assert_scalar.default not in targets
    assert targets.count(aten._local_scalar_dense.default) == 1  # the one whose value is used
    assert aten.sum.default not in targets or asserts == "proven"
    assert (aten._assert_async.msg in targets) == (asserts == "proven")
    removed = logs[0].phases["forward"].removed
    assert gm.names["item"] in removed and gm.names["assert_scalar"] in removed


def test_general_passes_on_a_captured_hf_model_both_phases(llama_program):
    out, logs = PassManager().run(llama_program, PassPlan.of(*DEFAULT_EXACT_PLAN))
    assert set(out.graphs) == {"prefill", "decode"}
    assert sum(lg.removed for lg in logs) > 0
    for lg in logs:
        assert set(lg.phases) == {"prefill", "decode"}
        assert all(p.check in ("exact", "unchanged") for p in lg.phases.values())
    # fresh inputs of several shapes: rewritten graphs == captured graphs, bit for bit
    from tkcc.traffic.workload import Bucket

    gen = torch.Generator().manual_seed(3)
    for phase, ctx in [("prefill", 3), ("prefill", 17), ("decode", 5), ("decode", 40)]:
        inputs = llama_program.inputs(phase, Bucket(phase, 1, ctx), gen)
        ref = run_graph(llama_program.graphs[phase], inputs, llama_program)
        got = run_graph(out.graphs[phase], inputs, llama_program)
        assert compare(ref, got, exact=True).ok, (phase, ctx)
    llama_program.reset_state()


def test_pass_that_breaks_the_graph_is_named():
    @register
    class UseBeforeDef(GraphPass):
        name = "test-use-before-def"
        exact = True

        def rewrite(self, gm, info, phase):
            nodes = list(gm.graph.nodes)
            last = [n for n in nodes if n.op == "call_function"][-1]
            with gm.graph.inserting_after(nodes[0]):
                bad = gm.graph.call_function(aten.neg.default, (last,))
            out = [n for n in nodes if n.op == "output"][0]
            out.args = (bad,)

    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(aten.mul.Tensor, (x, 2.0)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(PassError, match="test-use-before-def.*phase 'forward'"):
        PassManager().run(_program(gm, torch.randn(3)), PassPlan.of("test-use-before-def"))


def test_pass_that_changes_numerics_or_raises_is_named(small_program):
    @register
    class Nudge(GraphPass):
        name = "test-nudge-claims-exact"
        exact = True

        def rewrite(self, gm, info, phase):
            for n in gm.graph.nodes:
                if n.op == "call_function" and n.target is aten.mul.Tensor:
                    n.args = (n.args[0], n.args[1] + 1e-3)
                    info.matched += 1
                    return

    @register
    class Boom(Pass):
        name = "test-boom"

        def apply(self, program, **params):
            raise RuntimeError("kaboom")

    with pytest.raises(PassError, match=r"test-nudge-claims-exact.*plan step 2.*phase 'forward'.*first difference"):
        PassManager().run(small_program, PassPlan.of("dce", "test-nudge-claims-exact"))
    with pytest.raises(PassError, match="test-boom.*kaboom"):
        PassManager().run(small_program, PassPlan.of("test-boom"))


def test_bad_plans_name_step_and_param(small_program):
    with pytest.raises(PlanError, match=r"plan step 2 \('no-such-pass'\).*unknown pass"):
        PassManager().run(small_program, PassPlan.of("dce", "no-such-pass"))
    with pytest.raises(PlanError, match=r"plan step 1 \('cse'\).*get_attr.*out of range"):
        PassManager().run(small_program, [{"name": "cse", "params": {"get_attr": "sometimes"}}])
    with pytest.raises(PlanError, match=r"no parameter 'colour'"):
        PassManager().run(small_program, [{"name": "dce", "params": {"colour": 1}}])
    with pytest.raises(PlanError, match="not valid JSON"):
        PassManager().run(small_program, "[{")
    with pytest.raises(PlanError, match="not bit-exact"):
        PassManager(mode="exact").run(small_program, PassPlan.of("fuse_elementwise"))


def test_hand_written_pass_from_a_users_file(small_program, tmp_path):
    names = load_pass_module(ROOT / "examples" / "my_pass.py")
    assert "pow2-to-mul" in names or "pow2-to-mul" in {p for p in __import__("tkcc").passes.all_passes()}
    out, logs = PassManager().run(small_program, [{"name": "pow2-to-mul"}, {"name": "dce"}])
    log = logs[0]
    assert log.matched == 1 and log.phases["forward"].check == "exact"
    ph = log.phases["forward"]
    assert ph.removed == ["pow_1"] and len(ph.added) == 1
    assert ph.provenance[ph.added[0]] == ["pow_1"]
    assert aten.pow.Tensor_Scalar not in _targets(out.graphs["forward"])
    x = torch.randn(4, 16)
    assert torch.equal(out.graphs["forward"](x), small_program.eager(x))
    with pytest.raises(PlanError, match="max_exponent"):
        PassManager().run(small_program, [{"name": "pow2-to-mul", "params": {"max_exponent": 9}}])
    bad = tmp_path / "broken_pass.py"
    bad.write_text("raise ValueError('oops')\n")
    with pytest.raises(PlanError, match="broken_pass.py.*oops"):
        load_pass_module(bad)
    with pytest.raises(PlanError, match="not found"):
        load_pass_module(tmp_path / "missing.py")


def test_dataclass_program_meta_not_shared(small_program):
    out, _ = PassManager().run(small_program, PassPlan.of("dce"))
    assert "plan" in out.meta and "plan" not in small_program.meta
    assert dataclasses.is_dataclass(out)
