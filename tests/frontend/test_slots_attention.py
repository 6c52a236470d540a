"""The slot step's split-KV attention (tkcc.kernels.slot_attention) against its plain reference, and in the step.

CPU: the Triton interpreter must be on before triton is imported (other tests import it normally), so the
kernel runs in subprocesses with TRITON_INTERPRET=1, in fp32 and fp16. GPU: bf16 in this process.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "decode"))
from interp_proc import module_run  # noqa: E402

S = 40  # KV cache positions of the step tests
MODELS = ["llama-tiny", "olmoe-tiny"]
INTERP_TESTS = ("test_the_kernel_matches_the_reference_in_the_interpreter",
                "test_the_slot_step_runs_the_kernel_in_the_interpreter")


@pytest.fixture(scope="module", autouse=True)
def interpreter_run(request):
    """Every interpreter case of this module (the kernel checks in fp32 and fp16, the slot step of each model), in
    one subprocess started with the module (tests/decode/interp_proc.py): its imports are paid once, and it runs
    beside the in-process tests; the tests that read it come last."""
    yield from module_run(request, INTERP_TESTS, [str(HERE / "interp_slots.py"),
                                                  str(int(torch.randint(1, 2**31, (1,)))), str(S), *MODELS])


@pytest.fixture(scope="module", params=["llama-tiny", "olmoe-tiny"])
def program(request):
    from tkcc.frontend.models import build_model
    from tkcc.frontend.slots import capture_slots

    return capture_slots(build_model(request.param), 2, max_cache_len=S)


def test_every_layers_attention_is_rewritten(program):
    from tkcc.frontend.slots import PHASE
    from tkcc.kernels.slot_attention import slot_attention

    gm = program.graphs[PHASE]
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(slot_attention) == program.model.config.num_hidden_layers
    assert torch.ops.aten.scaled_dot_product_attention.default not in targets
    writes = [n for n in gm.graph.nodes if n.target == torch.ops.aten.scatter_.src]
    assert len(writes) == 2 * program.model.config.num_hidden_layers
    for w in writes:  # the cache rows are read by the op alone: repeat_kv's copies of them are gone
        assert {u.target for u in w.users} == {slot_attention}, w.name
    # the batch-1 graphs keep their own attention (the one-position split-KV passes key on cache_position)
    assert any(n.target == torch.ops.aten.scaled_dot_product_attention.default
               for n in program.graphs["decode"].graph.nodes)


def test_off_the_kernel_path_the_op_is_the_plain_step_bit_for_bit():
    """Without CUDA or the interpreter the op runs the step's own repeat_kv + sdpa under its mask."""
    from tkcc.kernels.slot_attention import plain, slot_attention, slot_attention_ref

    g = torch.Generator().manual_seed(4)
    for B, hq, hkv, D in ((3, 4, 2, 16), (2, 4, 4, 32), (4, 8, 1, 16)):
        q = torch.randn(B, hq, 1, D, generator=g)
        k, v = torch.randn(2, B, hkv, S, D, generator=g)
        pos = torch.randint(0, S, (B,), generator=g)
        mask = torch.arange(S)[None, None, None, :] <= pos[:, None, None, None]
        got = slot_attention(q, k, v, pos, mask, D ** -0.5, 16)
        assert torch.equal(got, plain(q, k, v, mask, D ** -0.5))
        torch.testing.assert_close(got, slot_attention_ref(q, k, v, pos), rtol=1e-5, atol=1e-5)
        pos2 = pos.clone()
        pos2[0] = (pos[0] + 7) % S  # the reference does attend where the positions say
        assert not torch.allclose(slot_attention_ref(q, k, v, pos2)[0], got[0])


def test_the_artifact_calls_the_op(tmp_path):
    import tkcc
    from tkcc.frontend.models import build_model

    compiled = tkcc.compile(build_model("llama-tiny"), measure=False, batch=2, max_cache_len=S, out_dir=tmp_path / "a")
    src = "\n".join(p.read_text() for p in (tmp_path / "a").rglob("*.py"))
    assert "tkcc.kernels.slot_attention.slot_attention(" in src
    ids = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(2))
    assert compiled.generate(ids, 4).shape == (2, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_and_the_step_on_the_gpu_bf16():
    from tkcc.frontend.models import build_model
    from tkcc.frontend.slots import PHASE, capture_slots
    from tkcc.kernels.common import fallbacks
    from tkcc.kernels.slot_attention import SHAPES, check

    rows = check("cuda", torch.bfloat16, torch.Generator().manual_seed(0), SHAPES)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, json.dumps(bad, indent=1)
    prog = capture_slots(build_model("llama-tiny", dtype=torch.bfloat16, device="cuda"), 4, max_cache_len=512)
    gen = torch.Generator().manual_seed(3)
    ids, pos = prog.inputs(PHASE, None, gen)
    snap = [t.clone() for t in prog.state.buffers()]
    with torch.no_grad():
        got = prog.graphs[PHASE](ids, pos).float()
        for t, s in zip(prog.state.buffers(), snap):
            t.copy_(s)
        want = prog.eager(ids, pos).float()
    assert float((got - want).norm() / want.norm()) < 3e-2
    assert not [k for k in fallbacks() if k.startswith("slot_attention")]


# ---- under the interpreter (one subprocess, started with the module: these read it, last) ----------------------

@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_kernel_matches_the_reference_in_the_interpreter(interpreter_run, dtype):
    """Several B, positions (0 and S - 1 always among them; NaN past each row's own) and head layouts (GQA, MHA,
    MQA; one split and several); the op's dispatch; and a row's bits beside other rows."""
    (res,) = [r for r in interpreter_run.lines() if r.get("dtype") == dtype]
    assert res["n"] > 0
    kinds = {r["kernel"] for r in res["rows"]}
    assert kinds == {"slot_attention", "slot_attention:op", "slot_attention:rows"}
    assert {eval(r["shape"])[5] for r in res["rows"]} >= {"splits=1", "splits=3"}
    assert not res["failed"], json.dumps(res["failed"], indent=1)


@pytest.mark.parametrize("name", MODELS)
def test_the_slot_step_runs_the_kernel_in_the_interpreter(interpreter_run, name):
    """The rewritten decode_slots graph on the kernel path: the plain step's logits within fp32 rounding, and
    each prompt's greedy tokens decoded beside others equal those it gets alone."""
    (res,) = [r for r in interpreter_run.lines() if r.get("model") == name]
    assert res["fell_back"] == []
    assert max(res["errs"]) < 1e-5, res
    assert res["same"]
