"""benchmarks/decode.py --smoke: the benchmark's whole CPU path (tiny model, interpreter) writes sane rows."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_decode_benchmark_smoke(tmp_path):
    out = tmp_path / "decode.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--smoke", "--contexts", "4",
                        "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = [r for r in res["rows"] if r["variant"] == "tkcc"]
    assert rows and all(r["ms_per_token"] > 0 and r["context"] == 4 for r in rows)
    for key in ("model", "context", "routing", "variant", "ms_per_token", "floor_ms_per_token", "peak_mem_bytes"):
        assert all(key in r for r in res["rows"])
    low = [r for r in res["rows"] if r["variant"] == "lowered"]  # the graph-lowered step, through tkcc.compile
    assert low and all(r["ms_per_token"] > 0 and r["family"] == "llama" for r in low)
    assert all(r.get("family") for r in res["rows"])
    errs = res["notes"]["llama-tiny"]["front_door"]["first_step_logits_rel_err_vs_captured_graph"]
    assert errs and all(v < 1e-4 for v in errs.values())
    g = res["greedy"]["llama-tiny"][0]["tkcc_vs_hf"]
    assert g["identical"] and g["logits_rel_err"] < 1e-4
    assert res["meta"]["torch"] and res["meta"]["command"]


def test_objective_merges_runs_later_rows_win(tmp_path):
    """--objective-from with several runs: a later run's row replaces an earlier one's (same model, variant,
    routing, context), compile rows come from the fresh-process files, nothing replaced is dropped, and
    the ratio is the best tkcc variant's P90 over compile's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode as bench

    def row(variant, ctx, ms, routing="router"):
        return dict(model="m", variant=variant, routing=routing, context=ctx, ms_per_token=ms, peak_mem_bytes=0)

    files = {
        "a.json": [row("tkcc", 128, 2.0), row("tkcc", 8192, 3.0), row("hf_compile[x]", 128, 9.0),
                   row("hf_compile[x]", 8192, 9.0)],
        "b.json": [row("tkcc", 128, 1.0), row("tkcc", 8192, 1.5), row("tkcc_v4", 128, 1.2), row("tkcc_v4", 8192, 1.2)],
        "c.json": [row("hf_compile[x]", 128, 4.0), row("hf_compile[x]", 8192, 4.0)],
    }
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps(dict(rows=rows)))
    res = bench.merged_objective([str(tmp_path / "a.json"), str(tmp_path / "b.json")], [str(tmp_path / "c.json")])
    assert len(res["replaced_rows"]) == 4  # a's two tkcc rows and its two compile rows
    assert {r["source"] for r in res["replaced_rows"]} == {"a.json"}
    p90 = {(o["trace"], o["variant"]): o["p90_decode_tokens_per_s"] for o in res["objective"]}
    assert p90 and all(v is not None for v in p90.values())
    for r in res["ratios"]:
        assert r["compile_p90"] == pytest.approx(p90[(r["trace"], "hf_compile[x]")])
        assert r["tkcc_p90"] == max(p90[(r["trace"], "tkcc")], p90[(r["trace"], "tkcc_v4")])
        assert r["ratio"] == pytest.approx(r["tkcc_p90"] / r["compile_p90"])
    # at every context tkcc (b) is faster than compile (c) by 2.7-4x: so is its P90
    assert all(2.5 < r["ratio"] < 4.1 for r in res["ratios"]) and res["ratios"]


PROBE = """
import gc, sys, weakref, torch
sys.path.insert(0, "benchmarks")
import decode as bench
from tkcc.frontend.models import build_model
caches = []
init = bench.FusedDecoder.__init__
def tracked(self, *a, **k):
    init(self, *a, **k)
    caches.append(weakref.ref(self.k_cache))
bench.FusedDecoder.__init__ = tracked
def reset():
    gc.collect()
    print("alive", sum(r() is not None for r in caches), flush=True)
    return 0
bench.peak_reset = reset
bench.tkcc_rows(build_model("llama-tiny", torch.float32, "cpu"), "llama-tiny", [4, 12], 1, 1, False, tune=False,
                profile=False, variants=["tkcc"])
"""


def test_no_row_keeps_an_earlier_rows_cache_alive():
    """Each row's peak memory is its own: when the counter is reset for a row, no earlier row's decoder
    cache is still allocated (a leftover view of one once charged a 32k cache to the next row)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    alive = [int(ln.split()[1]) for ln in p.stdout.splitlines() if ln.startswith("alive")]
    assert alive == [0, 0]
