"""A prompt longer than a Program's prefill chunk is measured and validated as the chunk's step serving runs
(``tkcc.runtime.workloads.chunked_prefill``): OLMoE's whole 4k-token prefill asked for 256 GiB on an H200."""
from types import SimpleNamespace

import pytest

from tkcc.runtime.workloads import check_buckets, chunked_prefill, for_program
from tkcc.traffic.workload import Bucket, Workload


def _program(chunk, cap=1024):
    return SimpleNamespace(meta={"prefill_chunk": chunk, "max_cache_len": cap, "batch": 1},
                           graphs={"prefill": None, "decode": None}, phases=["prefill", "decode"])


def _workload():
    return Workload(buckets=[Bucket("prefill", 1, 100, 30, 0.2), Bucket("prefill", 1, 300, 20, 0.5),
                             Bucket("prefill", 1, 900, 10, 0.3), Bucket("decode", 1, 900, 10, 1.0)],
                    mix=[(100, 30, 0.2), (300, 20, 0.5), (900, 10, 0.3)])


def test_prompts_past_the_chunk_become_the_chunks_step_with_their_share():
    w = for_program(_program(256), _workload())
    pre = {b.context: b for b in w.buckets if b.phase == "prefill"}
    assert sorted(pre) == [100, 256]
    assert pre[256].weight == pytest.approx(0.8) and pre[256].new_tokens == 20  # the larger share's tokens
    assert sum(b.weight for b in w.buckets if b.phase == "prefill") == pytest.approx(1.0)
    assert [b.context for b in w.buckets if b.phase == "decode"] == [900]  # decode steps are not chunked
    assert w.mix == _workload().mix and w.meta["prefill_chunk"] == 256
    check_buckets(_program(256, cap=1024), w)


@pytest.mark.parametrize("chunk", [None, 0, 2048])
def test_without_a_chunk_or_a_longer_one_the_workload_is_as_given(chunk):
    w = _workload()
    assert chunked_prefill(_program(chunk), w) is w


def test_a_builtin_moe_program_chunks_its_prefill():
    """What sets the chunk: the captured Program of a built-in MoE model (batched_mm experts), not a stand-in."""
    from tkcc.frontend.hf import _prefill_chunk, capture_hf
    from tkcc.frontend.models import build_model

    program = capture_hf(build_model("olmoe-tiny"), max_cache_len=512)
    chunk = program.meta["prefill_chunk"]
    assert chunk == 256
    w = for_program(program, Workload(buckets=[Bucket("prefill", 1, 400, 8, 1.0), Bucket("decode", 1, 400, 8, 1.0)]))
    assert [b.key() for b in w.buckets] == ["prefill/b1/c256/n8", "decode/b1/c400/n8"]
    check_buckets(program, w)
    assert _prefill_chunk(build_model("llama-tiny")) is None  # a dense model's prompt goes in one step
