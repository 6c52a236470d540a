"""The greedy loop's self-feeding step over any decode forward (``GraphCache.tkcc_greedy``, ``GreedyStep``): the
tokens of ``generate`` through it are the plain loop's, on several prompts and lengths, on CPU (where it runs the
same body through the cache's eager fallback) and on the GPU (one CUDA graph per step, feeding itself)."""
from __future__ import annotations

import pytest
import torch

from tkcc.frontend.capture import capture_model
from tkcc.frontend.generate import greedy
from tkcc.kernels.graph_replay import GraphCache, GreedyStep, greedy_body


def _tokens(prog, decode, prompt, n):
    return greedy(prog, prompt, n, forwards={"decode": decode})


def _check(device, dtype):
    prog = capture_model("llama-tiny", dtype, device, max_cache_len=48)
    cache = GraphCache(prog.graphs["decode"], name="decode")
    step = cache.tkcc_greedy
    assert isinstance(step, GreedyStep)
    g = torch.Generator().manual_seed(7)
    for plen, n in ((1, 5), (6, 12), (17, 3)):  # a one-token prompt goes through decode; n=1 takes no step
        prompt = torch.randint(0, prog.model.config.vocab_size, (1, plen), generator=g).to(device)
        want = _tokens(prog, prog.graphs["decode"], prompt, n)
        got = _tokens(prog, cache, prompt, n)
        assert torch.equal(got, want), (plen, n, got, want)
    return step, prog, cache


def test_the_greedy_step_gives_the_plain_loops_tokens_cpu():
    step, _, _ = _check("cpu", torch.float32)
    assert step.graph is None and step.refused  # no CUDA tensor: the cache's eager call, same body
    assert cache_report(step)["greedy_step"] == {"captured": False, "refused": step.refused}


def cache_report(step):
    return step.cache.report()


def test_greedy_body_feeds_itself():
    ids, pos = torch.tensor([[3]]), torch.tensor([5])
    logits = torch.zeros(1, 1, 10)
    logits[0, 0, 8] = 1.0
    tok, last = greedy_body(lambda i, p: (logits, "other"), ids, pos)
    assert tok.tolist() == [8] and ids.tolist() == [[8]] and pos.tolist() == [6] and last.shape == (1, 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_the_greedy_step_gives_the_plain_loops_tokens_gpu():
    step, prog, cache = _check("cuda", torch.float32)
    assert step.graph is not None and step.refused is None
    before = cache.stats.replays + cache.stats.eager_calls
    prompt = torch.randint(0, prog.model.config.vocab_size, (1, 4), device="cuda")
    _tokens(prog, cache, prompt, 9)
    assert cache.stats.replays + cache.stats.eager_calls == before  # each step replayed the greedy graph alone
