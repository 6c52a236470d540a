"""Compile facts (the shared memory a kernel needs) are computed once per machine: kept on disk by kernel
source, compiler version and key; missing ones computed in parallel processes; a bad file ignored."""
import json

import pytest

from tkcc.kernels import compile_facts as cf


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("TKCC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cf, "_MEMO", {})
    monkeypatch.setattr(cf, "_LOADED", set())
    return tmp_path / "compile_facts.json"


def _fresh_process(monkeypatch):
    monkeypatch.setattr(cf, "_MEMO", {})
    monkeypatch.setattr(cf, "_LOADED", set())


def _fake_smem(key):
    return 1000 + key[4]


def _refuse(key):
    raise AssertionError(f"computed again: {key}")


def test_facts_are_computed_in_parallel_then_kept_across_processes(store, monkeypatch):
    keys = [(1, 2), (3, 4, 5), (6,)]
    assert cf.facts("k", "src1", keys, len) == {(1, 2): 2, (3, 4, 5): 3, (6,): 1}  # len: picklable, spawned
    assert store.is_file()
    _fresh_process(monkeypatch)
    assert cf.facts("k", "src1", keys[:2], _refuse, parallel=False) == {(1, 2): 2, (3, 4, 5): 3}
    # another source (the kernel changed, or the compiler) or another kind: not the same fact
    assert cf.facts("k", "src2", [(1, 2)], sum, parallel=False) == {(1, 2): 3}
    assert cf.facts("other", "src1", [(1, 2)], sum, parallel=False) == {(1, 2): 3}


def test_a_file_that_cannot_be_read_is_recomputed_and_rewritten(store, monkeypatch):
    store.write_text("{not json")
    assert cf.facts("k", "s", [(7, 7)], sum, parallel=False) == {(7, 7): 14}
    assert any(v == 14 for v in json.loads(store.read_text()).values())


def test_attention_shared_memory_comes_from_the_kept_facts(store, monkeypatch):
    from tkcc.kernels import attention_rope as ar

    monkeypatch.setattr(ar, "_compiled_smem", _fake_smem)
    got = ar.shared_memory_many([(90, 1, 128, True, 64, 4, True), (90, 1, 128, True, 256, 8, True)])
    assert got == [1064, 1256]
    _fresh_process(monkeypatch)
    monkeypatch.setattr(ar, "_compiled_smem", _refuse)
    assert ar.shared_memory(90, 1, 128, True, 256, 8) == 1256
