"""pattern_ops: a rewrite whose pattern's ops are not all in the graph is skipped without tracing its pattern,
from op sets kept on disk; the skip never changes what is lowered, and a store that is unreadable or written
for other code is not trusted."""
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from lowered_families import capture  # noqa: E402

from tkcc.passes.lower import pattern_ops  # noqa: E402


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty store of its own, not yet read by this process."""
    monkeypatch.setenv("TKCC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(pattern_ops, "_MEMO", {})
    monkeypatch.setattr(pattern_ops, "_LOADED", set())
    monkeypatch.setattr(pattern_ops, "_PENDING", {})
    monkeypatch.setattr(pattern_ops, "_USED", set())
    return Path(tmp_path) / pattern_ops.FILE


def _lowered(prog):
    from tkcc.passes.manager import apply_plan

    new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
    return new.graphs["decode"].code, [re.sub(r" \([0-9.]+s\)$", "", n) for n in logs[0].notes]  # no timings


def test_skipping_rewrites_by_their_ops_lowers_the_same_graph_and_traces_fewer_patterns(store, monkeypatch):
    from tkcc.passes.lower.decode import stages

    rewrites = [rw for _stage, rws in stages() for rw in rws]
    prog = capture("gpt-oss")
    real_ops = pattern_ops.ops
    monkeypatch.setattr(pattern_ops, "ops", lambda rw, dt: set())  # every rewrite looks: nothing skipped
    code_all, notes_all = _lowered(prog)
    monkeypatch.setattr(pattern_ops, "ops", real_ops)
    writes = []
    real_merge = pattern_ops.disk_cache.merge
    monkeypatch.setattr(pattern_ops.disk_cache, "merge", lambda *a, **k: (writes.append(a[1]), real_merge(*a, **k)))
    code, notes = _lowered(prog)  # fills the store
    assert code == code_all and notes == notes_all
    assert len(json.loads(store.read_text())) == len(rewrites)
    assert len(writes) == 1, f"{len(writes)} writes of the store in one lowering"  # each rewrites the whole file

    # a fresh process: nothing traced in memory, the op sets read from the store
    for rw in rewrites:
        monkeypatch.setattr(rw, "_traced", {})
    monkeypatch.setattr(pattern_ops, "_MEMO", {})
    monkeypatch.setattr(pattern_ops, "_LOADED", set())
    code_again, _ = _lowered(prog)
    assert code_again == code_all
    traced = [rw for rw in rewrites if rw._traced]
    assert 0 < len(traced) < len(rewrites) // 2, f"{len(traced)} of {len(rewrites)} patterns traced"
    lowered = {n.split(": ")[2] for n in notes if "region(s) lowered" in n}
    assert lowered <= {rw.name for rw in traced}


def test_an_unreadable_store_is_ignored_and_rewritten(store):
    from tkcc.passes.lower.norms import REWRITES

    rw = REWRITES[0]
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text("{not json")
    ops = pattern_ops.ops(rw, torch.float32)
    assert ops == pattern_ops.graph_ops(rw.pattern_graph(torch.float32)[0].graph) and "aten.rsqrt.default" in ops
    assert store.read_text() == "{not json"  # written once the lowering ends
    pattern_ops.flush()
    assert json.loads(store.read_text()) == {pattern_ops.key(rw, torch.float32): sorted(ops)}


def test_a_store_past_its_size_keeps_only_what_this_process_used(store, monkeypatch):
    """Every edit of the rewrites' code changes every key, so old op sets pile up; past ``MAX_ENTRIES`` a write
    keeps the keys this process looked up or traced and drops the rest."""
    from tkcc.passes.lower.norms import REWRITES

    monkeypatch.setattr(pattern_ops, "MAX_ENTRIES", 8)
    stale = {f"stale{i}": ["aten.mm.default"] for i in range(6)}
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(stale))
    looked = pattern_ops.ops(REWRITES[0], torch.float32)  # traced: pending
    pattern_ops.flush()
    assert set(json.loads(store.read_text())) == set(stale) | {pattern_ops.key(REWRITES[0], torch.float32)}
    for rw in REWRITES[1:4]:
        pattern_ops.ops(rw, torch.float32)
    pattern_ops.flush()  # 10 entries, past 8: only this process's 4 stay
    kept = json.loads(store.read_text())
    assert set(kept) == {pattern_ops.key(rw, torch.float32) for rw in REWRITES[:4]}
    assert kept[pattern_ops.key(REWRITES[0], torch.float32)] == sorted(looked)


def test_a_stored_op_set_is_read_back_by_its_key_only(store):
    from tkcc.passes.lower.norms import REWRITES

    rw = REWRITES[0]
    k = pattern_ops.key(rw, torch.float32)
    assert k != pattern_ops.key(rw, torch.float16) and k != pattern_ops.key(REWRITES[1], torch.float32)
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps({k: ["aten.mm.default", "not.an.op"]}))
    assert pattern_ops.ops(rw, torch.float32) == {"aten.mm.default", "not.an.op"}  # what the store says


def test_the_key_follows_the_source_of_the_pattern(tmp_path, monkeypatch):
    from tkcc.passes.lower.pattern import Rewrite

    src = tmp_path / "my_rewrite.py"
    body = """
        import torch
        def pattern(x):
            return torch.relu(x) {op} 1.5
        def example(dt):
            return (torch.empty(4, 8, dtype=dt),), {{}}
    """
    src.write_text(textwrap.dedent(body.format(op="*")))
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_rewrite

    rw = Rewrite("relu_scale", my_rewrite.pattern, my_rewrite.pattern, my_rewrite.example, region="norm")
    before = pattern_ops._key(rw, torch.float32)
    src.write_text(textwrap.dedent(body.format(op="+")))
    monkeypatch.setattr(pattern_ops, "_DIGESTS", {})
    assert before is not None and pattern_ops._key(rw, torch.float32) != before

    ns: dict = {}
    exec("def pattern(x):\n    return x * 2\n", ns)  # no source file: never looked up, always traced
    assert pattern_ops._key(Rewrite("nofile", ns["pattern"], ns["pattern"], my_rewrite.example,
                                    region="norm"), torch.float32) is None
