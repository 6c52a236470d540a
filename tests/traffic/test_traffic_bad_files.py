"""Files that are not traces get a clear error naming the file, the line and the cause, cheaply.

Binary garbage, NUL bytes, another encoding, a line without end, a CSV missing a column, and token counts
that are not whole numbers (``1e3``, ``true``, ``0,0``): each is refused at the line where it is found,
after a bounded read (a 1 GB file of NUL bytes costs a megabyte of memory, not gigabytes).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tkcc.errors import TraceFormatError
from tkcc.traffic.loaders import load_trace

AZ = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:00:0{i}.0,{inp},{out}\n"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _az(tmp_path, name, *rows):
    p = tmp_path / name
    p.write_text(AZ + "".join(ROW.format(i=i, inp=a, out=b) for i, (a, b) in enumerate(rows)))
    return p


def _refused(path, *words, line=None, field=None, **kw):
    with pytest.raises(TraceFormatError) as e:
        load_trace(path, **kw)
    msg = str(e.value)
    assert str(path) in msg and all(w in msg for w in words), msg
    if line is not None:
        assert e.value.line == line, msg
    if field is not None:
        assert e.value.field == field, msg
    return e.value


def test_binary_garbage_names_the_file_line_and_cause(tmp_path):
    p = tmp_path / "garbage.csv"
    p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40)
    _refused(p, "not UTF-8 text", "0x89", line=1)
    zeros = tmp_path / "zeros.csv"
    zeros.write_bytes(AZ.encode() + b"2023-11-16 18:00:00.0,5,\x00\x001\n")
    _refused(zeros, "binary data", "NUL byte at column 25", line=2)
    latin = tmp_path / "latin1.csv"
    latin.write_bytes((AZ + ROW.format(i=0, inp=5, out=1) + "2023-11-16 18:00:01.0,5,1\xe9\n").encode("latin-1"))
    _refused(latin, "not UTF-8 text", "0xe9", line=3)
    u16 = tmp_path / "utf16.csv"
    u16.write_bytes((AZ + ROW.format(i=0, inp=5, out=1)).encode("utf-16"))
    _refused(u16, "UTF-16", line=1)
    jl = tmp_path / "bad.jsonl"
    jl.write_bytes(b'{"timestamp": 0, "input_length": 3, "output_length": 4}\n{"timestamp": 1, "inp\xff": 3}\n')
    _refused(jl, "not UTF-8 text", line=2)


@pytest.mark.parametrize("header", [False, True])
def test_a_gigabyte_of_nul_bytes_costs_a_bounded_read(tmp_path, header):
    """The file is sparse (no disk space); loading it in a fresh process must stay near the interpreter's size."""
    p = tmp_path / "nul.csv"
    with open(p, "wb") as f:
        if header:
            f.write(AZ.encode())
        f.truncate(1 << 30)
    # VmHWM: this process's own peak (ru_maxrss would include the forking parent's, pytest's)
    code = ("import sys\nfrom tkcc.traffic.loaders import load_trace\nfrom tkcc.errors import TraceFormatError\n"
            "try:\n    load_trace(sys.argv[1])\nexcept TraceFormatError as e:\n    print(e)\n"
            "print(next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM')) // 1024)\n")
    res = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    msg, peak_mib = res.stdout.strip().rsplit("\n", 1)
    assert str(p) in msg and ("NUL byte" in msg or "longer than" in msg), res.stdout + res.stderr
    assert f":{2 if header else 1}:" in msg, msg
    assert int(peak_mib) < 200, f"peak RSS {peak_mib} MiB reading a file of NUL bytes"


def test_a_line_without_end_is_refused(tmp_path):
    p = tmp_path / "oneline.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 3, "output_length": 4, "pad": "' + "x" * (2 << 20) + '"}\n')
    _refused(p, "longer than", line=1)


def test_a_csv_missing_a_column_is_named_by_detection(tmp_path):
    p = tmp_path / "cols.csv"
    p.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:00:00.0,12\n")
    _refused(p, "missing column 'GeneratedTokens'", "azure2023", line=1, field="GeneratedTokens")
    q = tmp_path / "burst.csv"
    q.write_text("Timestamp,Request tokens\n1.0,5\n")
    _refused(q, "missing column 'Response tokens'", "burstgpt", field="Response tokens")


@pytest.mark.parametrize("value,shown", [("1e3", "'1e3'"), ("true", "'true'"), ('"0,0"', "'0,0'"), ("12.5", "'12.5'"),
                                         ("0x10", "'0x10'")])
def test_csv_token_counts_that_are_not_whole_numbers_are_refused(tmp_path, value, shown):
    p = tmp_path / "counts.csv"
    p.write_text(AZ + f"2023-11-16 18:00:00.0,{value},12\n")
    _refused(p, "not a number of tokens", shown, line=2, field="ContextTokens")


def test_an_unquoted_decimal_comma_is_refused(tmp_path):
    p = tmp_path / "comma.csv"
    p.write_text(AZ + "2023-11-16 18:00:00.0,0,0,12\n")
    _refused(p, "row has 4 fields, the header has 3", line=2)


@pytest.mark.parametrize("value,shown", [("1e3", "1e3"), ("true", "true"), ('"0,0"', "'0,0'"), ("1.5", "1.5"),
                                         ("null", "null")])
def test_jsonl_token_counts_that_are_not_whole_numbers_are_refused(tmp_path, value, shown):
    p = tmp_path / "counts.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 3, "output_length": 4}\n'
                 f'{{"timestamp": 5, "input_length": {value}, "output_length": 4}}\n')
    _refused(p, shown, line=2, field="input_length")


def test_whole_numbers_still_load(tmp_path):
    p = _az(tmp_path, "ok.csv", (12, 3), ("12.0", " 4"), (0, 0))
    assert load_trace(p).input_tokens.tolist() == [12, 12, 0]
    j = tmp_path / "ok.jsonl"
    j.write_text('{"timestamp": 0, "input_length": 3, "output_length": 4.0}\n'
                 '{"timestamp": 1.5, "input_length": "7", "output_length": 2}\n')
    tr = load_trace(j)
    assert tr.input_tokens.tolist() == [3, 7] and tr.output_tokens.tolist() == [4, 2]
    assert tr.arrival_s.tolist() == [0.0, 0.0015]
