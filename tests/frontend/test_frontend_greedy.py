"""The one greedy loop: teacher forcing, prompt chunks, any pair of forwards, and its bad input."""
from __future__ import annotations

import pytest
import torch

from tkcc.errors import TkccError
from tkcc.frontend import capture, greedy, greedy_steps
from tkcc.frontend.generate import greedy_loop
from tkcc.frontend.models import build_model

pytest.importorskip("transformers")

MAX_LEN = 24


@pytest.fixture(scope="module")
def prog():
    return capture(build_model("llama-tiny", initializer_range=0.3), max_cache_len=MAX_LEN, batch=1)


def _ids(shape, seed, vocab):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _hf_logits(prog, ids):
    """The model's own forward over a whole sequence: the logits at every position."""
    with torch.no_grad():
        return prog.model(ids).logits


@pytest.mark.parametrize("plen,new", [(5, 6), (2, 3), (9, 1)])
def test_teacher_forced_steps_are_the_models_own_choices(prog, plen, new):
    """Fed the forced tokens, each yielded token is the argmax of the model's logits at that position, and
    the yielded logits are those logits; a free run forced with its own tokens is the free run."""
    vocab = prog.meta["vocab_size"]
    prompt = _ids((1, plen), plen, vocab)
    force = _ids((1, new), 100 + plen, vocab)
    steps = list(greedy_steps(prog, prompt, new, force=force))
    want = _hf_logits(prog, torch.cat([prompt, force[:, :new - 1]], 1))[:, plen - 1:]
    got = torch.stack([last for _, last in steps], 1)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    assert [int(t) for t, _ in steps] == want[0].argmax(-1).tolist()
    free = greedy(prog, prompt, new)
    again = torch.stack([t for t, _ in greedy_steps(prog, prompt, new, force=free)], 1)
    assert torch.equal(again, free)


def test_prompt_logits_in_chunks_and_a_pair_of_forwards_without_a_program(prog):
    """``on_prompt`` sees every prompt position's logits, in chunks of ``prefill_chunk``; ``greedy_loop`` runs
    the same loop on bare forwards (here one that returns a tuple, as a traced HF forward may)."""
    vocab = prog.meta["vocab_size"]
    prompt = _ids((1, 7), 3, vocab)
    want = _hf_logits(prog, prompt)
    for chunk, sizes in ((None, [7]), (3, [3, 3, 1]), (1, [1] * 7)):
        seen = []
        fwd = {p: (lambda g: lambda *a: (g(*a),))(prog.graphs[p]) for p in ("prefill", "decode")}
        toks = [t for t, _ in greedy_loop(fwd, prompt, 4, reset=prog.reset_state, max_cache_len=MAX_LEN,
                                          prefill_chunk=chunk, on_prompt=lambda lg: seen.append(lg.clone()))]
        assert [s.shape[1] for s in seen] == sizes
        torch.testing.assert_close(torch.cat(seen, 1), want, atol=5e-5, rtol=1e-4)
        assert torch.equal(torch.stack(toks, 1), greedy(prog, prompt, 4)), chunk


def test_bad_input_names_the_cause(prog):
    prompt = torch.zeros(1, 4, dtype=torch.long)
    fwd = dict(prog.graphs)
    with pytest.raises(TkccError, match=r"force must be \[batch=1, >= 3\]"):
        greedy_steps(prog, prompt, 4, force=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(TkccError, match="missing \\['prefill'\\]"):
        greedy_loop({"decode": fwd["decode"]}, prompt, 2)
    with pytest.raises(TkccError, match="prefill_chunk=-1"):
        greedy_loop(fwd, prompt, 2, prefill_chunk=-1)
    with pytest.raises(TkccError, match="needs 25 cache positions; max_cache_len is 24"):
        greedy_loop(fwd, prompt, 22, max_cache_len=MAX_LEN)
    with pytest.raises(TkccError, match=r"prompt_ids must be \[batch, length>=1\]"):
        greedy_loop(fwd, torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(TkccError, match="no tensor in it"):
        list(greedy_loop({"prefill": lambda *a: None, "decode": fwd["decode"]}, prompt, 2))
