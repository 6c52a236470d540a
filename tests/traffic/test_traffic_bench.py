"""A million Azure-format rows, and the largest shipped traces, loaded correctly. pytest-benchmark reports
how long they take; no test holds them to a time (that would depend on the machine's load)."""
import numpy as np
import pytest

from tkcc.traffic import bundled_trace, load_trace

N = 1_000_000


@pytest.fixture(scope="module")
def million_rows(tmp_path_factory):
    rng = np.random.default_rng(0)
    base = np.datetime64("2023-11-16T18:00:00", "ns")
    ts = base + np.cumsum(rng.exponential(0.01, N) * 1e9).astype("timedelta64[ns]")
    s = np.char.replace(np.datetime_as_string(ts, unit="us"), "T", " ")
    L, O = rng.integers(1, 8000, N), rng.integers(1, 1000, N)
    p = tmp_path_factory.mktemp("big") / "azure_1m.csv"
    with open(p, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        f.write("\n".join(f"{a}0,{b},{c}" for a, b, c in zip(s.tolist(), L.tolist(), O.tolist())))
        f.write("\n")
    return p, L, O, (ts - ts[0]).astype(np.int64) / 1e9


def test_load_million_rows(benchmark, million_rows):
    p, L, O, t = million_rows
    tr = benchmark.pedantic(load_trace, args=(p,), rounds=1, iterations=1)
    assert len(tr) == N and np.array_equal(tr.input_tokens, L) and np.array_equal(tr.output_tokens, O)
    assert np.abs(tr.arrival_s - t).max() < 1e-5


def test_load_largest_shipped_traces(benchmark):
    def load_all():
        return [load_trace(bundled_trace(n)) for n in ("sharegpt", "azure-conv", "servegen-m-small-14")]

    out = benchmark.pedantic(load_all, rounds=1, iterations=1)
    assert len(out[0]) == 30731 and len(out[1]) == 19366 and len(out[2]) > 900_000
