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
    g = res["greedy"]["llama-tiny"][0]["tkcc_vs_hf"]
    assert g["identical"] and g["logits_rel_err"] < 1e-4
    assert res["meta"]["torch"] and res["meta"]["command"]
