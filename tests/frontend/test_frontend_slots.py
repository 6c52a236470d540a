"""Slots Programs (tkcc.frontend.slots): the decode_slots step against the batch-1 step, row by row."""
from __future__ import annotations

import pytest
import torch

from tkcc.errors import CaptureError, TkccError

S = 48  # KV cache positions


@pytest.fixture(scope="module", params=[("llama-tiny", 3), ("olmoe-tiny", 2)], ids=lambda p: f"{p[0]}-b{p[1]}")
def program(request):
    from tkcc.frontend.models import build_model
    from tkcc.frontend.slots import capture_slots

    name, slots = request.param
    return capture_slots(build_model(name), slots, max_cache_len=S)


def _fill(program, gen):
    """Random keys/values in every cache row (staging and slots): stale contents the masks must hide."""
    with torch.no_grad():
        for b in program.state.buffers():
            b.copy_(torch.randn(b.shape, generator=gen))


def test_the_slot_step_is_the_batch1_step_of_each_row(program):
    """Row b of decode_slots computes what the batch-1 decode graph computes for that row alone: the same logits
    (up to the summation order of a [B, n] matrix product) and the same key/value written at its position."""
    from tkcc.frontend.slots import PHASE

    n = program.meta["slots"]
    gen = torch.Generator().manual_seed(7)
    cache = program.state
    for trial in range(3):  # fresh random inputs and positions, first and last positions included
        _fill(program, gen)
        ids, pos = program.inputs(PHASE, None, gen)
        if trial == 1:
            pos = torch.tensor([0] + [S - 1] * (n - 1))
        before = [t.clone() for t in cache.slots.buffers()]
        with torch.no_grad():
            got = program.graphs[PHASE](ids, pos)
        written = [t.clone() for t in cache.slots.buffers()]
        for b in range(n):
            with torch.no_grad():  # the batch-1 graph on row b's cache, copied into the staging row
                for full, stage in zip(before, cache.buffers(recurse=False)):
                    stage.copy_(full[b:b + 1])
                ref = program.graphs["decode"](ids[b:b + 1], pos[b:b + 1])
            torch.testing.assert_close(got[b:b + 1], ref, rtol=1e-5, atol=1e-5)
            for new, old, stage in zip(written, before, cache.buffers(recurse=False)):
                p = int(pos[b])
                torch.testing.assert_close(new[b, :, p], stage[0, :, p], rtol=1e-5, atol=1e-5)
                keep = torch.ones(S, dtype=torch.bool)
                keep[p] = False
                assert torch.equal(new[b, :, keep], old[b, :, keep])  # nothing else of the row was written


def test_the_slot_step_graph_equals_its_eager_module(program):
    from tkcc.frontend.slots import PHASE

    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        _fill(program, gen)
        snap = [t.clone() for t in program.state.buffers()]
        ids, pos = program.inputs(PHASE, None, gen)
        with torch.no_grad():
            a = program.graphs[PHASE](ids, pos)
            for t, s in zip(program.state.buffers(), snap):
                t.copy_(s)
            b = program.eager(ids, pos)
        assert torch.equal(a, b)


def test_a_rows_logits_do_not_depend_on_the_other_rows_or_its_slot(program):
    """The invariant continuous batching rests on, bit for bit: one row's token, position and cache row give the
    same logits whatever the other rows hold (free slots' junk included) and whichever slot it sits in.
    On one CPU thread: with several, the CPU's matmul splits its rows between threads by the batch, and a row
    can come out a last bit apart by its slot (the token tests below run multi-threaded)."""
    from tkcc.frontend.slots import PHASE

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _rows_independent(program, PHASE)
    finally:
        torch.set_num_threads(threads)


def _rows_independent(program, PHASE):

    n = program.meta["slots"]
    gen = torch.Generator().manual_seed(11)
    _fill(program, gen)
    rows = program.state.slots
    mine = [t[0].clone() for t in rows.buffers()]
    ids, pos = program.inputs(PHASE, None, gen)
    with torch.no_grad():
        want = program.graphs[PHASE](ids, pos)[0].clone()
    for slot in range(n):
        _fill(program, gen)
        for t, m in zip(rows.buffers(), mine):
            t[slot].copy_(m)
        other_ids, other_pos = program.inputs(PHASE, None, gen)
        other_ids[slot], other_pos[slot] = ids[0], pos[0]
        with torch.no_grad():
            got = program.graphs[PHASE](other_ids, other_pos)[slot]
        assert torch.equal(got, want), f"slot {slot}"


def test_generate_slots_together_equals_each_prompt_alone(program):
    from tkcc.frontend.slot_batch import generate_slots

    n = program.meta["slots"]
    gen = torch.Generator().manual_seed(5)
    graphs = dict(program.graphs)
    for plen in (1, 6):
        prompts = torch.randint(0, 256, (n, plen), generator=gen)
        together = torch.stack(list(generate_slots(program, graphs, prompts, 6)), 1)
        alone = torch.cat([torch.stack(list(generate_slots(program, graphs, prompts[i:i + 1], 6)), 1)
                           for i in range(n)])
        assert torch.equal(together, alone)
        eager = torch.stack(list(generate_slots(program, {p: program.eager for p in program.phases}, prompts, 6)), 1)
        assert torch.equal(together, eager)


def test_slot_batch_admits_into_freed_slots_and_refuses_what_does_not_fit(program):
    from tkcc.frontend.slot_batch import SlotBatch

    n = program.meta["slots"]
    sb = SlotBatch(program, dict(program.graphs))
    slots = [sb.admit([1, 2, 3])[0] for _ in range(n)]
    assert slots == list(range(n)) and not sb.free
    with pytest.raises(TkccError, match="all .* slots are live"):
        sb.admit([1])
    sb.release(1)
    assert sb.admit([4, 5])[0] == 1 and int(sb.positions[1]) == 2
    with pytest.raises(TkccError, match="not live"):
        sb.release(n + 5)
    with pytest.raises(TkccError, match="live"):
        sb.rebind(dict(program.graphs))
    for s in range(n):
        sb.release(s)
    with pytest.raises(TkccError, match="does not fit"):
        sb.admit(list(range(S + 1)))
    sb.admit([1])
    for _ in range(S + 3):  # a slot that ran out of positions stays at the last one
        sb.step()
    assert int(sb.positions.max()) == S - 1


def test_truncated_slots_programs_keep_their_slots(program):
    from tkcc.frontend.slot_batch import generate_slots
    from tkcc.frontend.slots import PHASE

    small = program.truncate(1)
    assert small.meta["slots"] == program.meta["slots"] and PHASE in small.graphs
    assert small.state.key_0.data_ptr() == program.state.key_0.data_ptr()  # the same first-layer memory
    prompts = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(0))
    out = torch.stack(list(generate_slots(small, dict(small.graphs), prompts, 3)), 1)
    assert out.shape == (2, 3)


def test_bad_slot_captures_are_refused_by_name():
    from tkcc.frontend.models import build_model
    from tkcc.frontend.slots import capture_slots

    with pytest.raises(CaptureError, match="slots=1"):
        capture_slots(build_model("llama-tiny"), 1)
    with pytest.raises(CaptureError, match="not a Hugging Face causal LM"):
        capture_slots(torch.nn.Linear(2, 2), 2)
    import tkcc

    with pytest.raises(CaptureError, match="batch=0"):
        tkcc.compile(build_model("llama-tiny"), batch=0, measure=False)
    with pytest.raises(CaptureError, match="causal LMs"):
        tkcc.compile(torch.nn.Linear(2, 2), example_inputs=(torch.zeros(1, 2),), batch=2, measure=False)


def test_compiled_for_a_batch_generates_saves_and_loads(tmp_path):
    """tkcc.compile(model, batch=B): an artifact with decode_slots; generate decodes the prompts together, and
    tkcc.load rebuilds it (no capture) with the same tokens."""
    import tkcc
    from tkcc.frontend.models import build_model

    compiled = tkcc.compile(build_model("llama-tiny"), measure=False, check=True, batch=3, max_cache_len=S,
                            progress=False)
    assert compiled.serves == "artifact" and "decode_slots" in compiled.artifact.phases
    assert compiled.settings["slots"] == 3 and compiled.report(print_report=False).golden.ok
    prompts = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(2))
    together = compiled.generate(prompts, 6)
    assert torch.equal(together, torch.cat([compiled.generate(prompts[i:i + 1], 6) for i in range(3)]))
    with pytest.raises(TkccError, match="n in 1..3"):
        compiled.generate(torch.zeros((4, 2), dtype=torch.long), 2)
    out = compiled(prompts[:2])  # a call the batch-1 prefill does not take runs the model's own forward
    assert out.logits.shape == (2, 5, 256)
    compiled.save(tmp_path / "saved")
    loaded = tkcc.load(tmp_path / "saved", build_model("llama-tiny"))
    assert loaded.program.meta["slots"] == 3
    assert torch.equal(loaded.generate(prompts, 6), together)
