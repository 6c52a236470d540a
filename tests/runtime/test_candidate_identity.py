"""A source candidate is named by every file it can import, and which of them is the candidate."""
from __future__ import annotations

import pytest

from tkcc.errors import EngineError
from tkcc.runtime.candidates import candidate_id, source_tree


def _cid(path, **kw):
    return candidate_id({"source": str(path), **kw})


def test_identity_covers_every_importable_file_and_the_entry(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, k in ((a, 1), (b, 2)):
        (d / "pkg").mkdir(parents=True)
        (d / "candidate.py").write_text("import helper\n")
        (d / "helper.py").write_text(f"K = {k}\n")
        (d / "pkg" / "__init__.py").write_text("")
    assert _cid(a / "candidate.py") != _cid(b / "candidate.py")  # same candidate.py, other helper
    (b / "helper.py").write_text("K = 1\n")
    assert _cid(a / "candidate.py") == _cid(b / "candidate.py")
    (a / "other.py").write_text("")
    assert _cid(a / "other.py") != _cid(a / "candidate.py")  # another entry in the same folder
    before = _cid(a / "candidate.py")
    (a / "notes.txt").write_text("not importable")
    (a / "run.log").write_text("x")
    assert _cid(a / "candidate.py") == before  # a log beside it is nothing it can import
    (a / "more.py").write_text("")
    assert _cid(a / "candidate.py") != before  # a module beside it is
    before = _cid(a / "candidate.py")
    (a / "pkg" / "data.json").write_text("{}")  # a package's files are all its own
    assert _cid(a / "candidate.py") != before
    assert _cid(a / "candidate.py", exact=False) != _cid(a / "candidate.py")
    digest, files = source_tree(str(a / "candidate.py"), 1 << 20)
    assert {r for r, _ in files} == {"candidate.py", "helper.py", "more.py", "other.py", "pkg/__init__.py",
                                     "pkg/data.json"}


def test_a_folder_too_big_to_be_a_candidate_is_refused(tmp_path):
    (tmp_path / "candidate.py").write_text("x = 1\n")
    (tmp_path / "big.py").write_bytes(b"#" * 5000)
    with pytest.raises(EngineError, match="over the engine's limit of 4096 bytes"):
        source_tree(str(tmp_path / "candidate.py"), 4096)
    with pytest.raises(EngineError, match="does not exist"):
        source_tree(str(tmp_path / "missing.py"), 4096)
