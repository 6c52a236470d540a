"""Run under TRITON_INTERPRET=1 (by interp_lowered.py and interp_variants_check.py): greedy tokens of the captured
graphs and of the ``lowered_decode`` artifact's forwards (every kernel live, fp32, CPU) over 8 steps, and the logits
that chose them. One JSON line per model.

8 steps, not more: at a 48-position cache every position is the same path through the kernels (one split, one
64-position attention tile), so a longer run repeats it at about half a second per step of the interpreter."""
import json
import sys
import tempfile

import torch

from tkcc import pipeline
from tkcc.frontend.capture import capture_model
from tkcc.frontend.generate import greedy
from tkcc.kernels.common import fallbacks

STEPS = 8


def run(names):
    for name in names:
        prog = capture_model(name, "float32", "cpu", max_cache_len=48, seed=11)
        with tempfile.TemporaryDirectory() as d:
            build = pipeline.build(prog, [{"name": "lowered_decode", "params": {"attn_chunk": 64}}], f"{d}/art",
                                   mode="tolerance", check_numerics=False, log_code=False)
            src = build.artifact.source("decode").splitlines()
            ops = sorted({line.split("torch.ops.tkcc.")[1].split(".")[0] for line in src if "torch.ops.tkcc." in line})
            aten = sorted({line.split("torch.ops.aten.")[1].split(".")[0] for line in src if "torch.ops.aten." in line})
            prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
            ref, ref_logits = greedy(prog, prompt, STEPS, return_logits=True)
            got, got_logits = greedy(prog, prompt, STEPS, forwards=build.forwards, return_logits=True)
        err = float((got_logits - ref_logits).norm() / ref_logits.norm())
        print(json.dumps(dict(model=name, ref=ref[0].tolist(), got=got[0].tolist(), logits_rel_err=err, ops=ops, aten=aten,
                              fallbacks=fallbacks(), notes=[n for n in build.logs[0].notes if "left in aten" in n])),
              flush=True)


if __name__ == "__main__":
    run(sys.argv[1:])
