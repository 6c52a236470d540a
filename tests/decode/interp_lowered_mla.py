"""Run under TRITON_INTERPRET=1 (by test_lowered_mla.py): every interpreter case of MLA in one process (imports
paid once): the MLA rewrite against its pattern in fp32 and fp16 (one JSON line of check rows), then
interp_lowered_greedy.py on deepseekv3-tiny (greedy tokens of the captured graphs and of the lowered_decode
artifact, every kernel live, over 32 steps: one JSON line)."""
import json
import runpy
import sys
import time
from pathlib import Path

import torch

from tkcc.kernels.common import fallbacks
from tkcc.passes.lower.checks import run_checks

t0 = time.time()
rows = run_checks("cpu", torch.float32, ["mla"]) + run_checks("cpu", torch.float16, ["mla"])
print(json.dumps({"checks": rows, "fallbacks": fallbacks(), "seconds": round(time.time() - t0, 1)}), flush=True)
greedy = Path(__file__).with_name("interp_lowered_greedy.py")
sys.argv = [str(greedy), "deepseekv3-tiny"]
runpy.run_path(str(greedy), run_name="__main__")
