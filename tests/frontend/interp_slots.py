"""Run under TRITON_INTERPRET=1 (by test_slots_attention.py): the module's interpreter cases in one process, so that
its imports (torch, triton, transformers) are paid once. Arguments: the seed, the KV cache positions S of the step
cases, then the models. One JSON line per kernel check dtype (fp32, fp16), {"dtype", "n", "failed", "rows"} as
``python -m tkcc.kernels.slot_attention`` prints; then one per model: the rewritten decode_slots graph on the kernel
path against the plain step (two random states), and each prompt's greedy tokens decoded beside others against
those it gets alone, {"model", "errs", "same", "fell_back"}."""
import json
import sys

import torch

from tkcc.frontend.models import build_model
from tkcc.frontend.slot_batch import generate_slots
from tkcc.frontend.slots import PHASE, capture_slots
from tkcc.kernels.common import fallbacks
from tkcc.kernels.slot_attention import CPU_SHAPES, check


def step(name: str, S: int) -> dict:
    before = fallbacks()
    torch.manual_seed(0)
    prog = capture_slots(build_model(name), 3, max_cache_len=S)
    gen = torch.Generator().manual_seed(1)
    errs = []
    for _ in range(2):
        for b in prog.state.buffers():
            b.copy_(torch.randn(b.shape, generator=gen))
        snap = [t.clone() for t in prog.state.buffers()]
        ids, pos = prog.inputs(PHASE, None, gen)
        pos[0], pos[-1] = 0, S - 1
        with torch.no_grad():
            got = prog.graphs[PHASE](ids, pos)
            for t, s in zip(prog.state.buffers(), snap):
                t.copy_(s)
            want = prog.eager(ids, pos)  # the plain step: repeat_kv + sdpa under the mask
        errs.append(float((got - want).norm() / want.norm()))
    prompts = torch.randint(0, 256, (3, 5), generator=gen)
    graphs = dict(prog.graphs)
    together = torch.stack(list(generate_slots(prog, graphs, prompts, 5)), 1)
    alone = torch.cat([torch.stack(list(generate_slots(prog, graphs, prompts[i:i + 1], 5)), 1) for i in range(3)])
    return {"model": name, "errs": errs, "same": bool(torch.equal(together, alone)),
            "fell_back": [k for k, n in fallbacks().items() if k.startswith("slot_attention") and n > before.get(k, 0)]}


if __name__ == "__main__":
    seed, S, models = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    g = torch.Generator().manual_seed(seed)
    for dt in (torch.float32, torch.float16):
        rows = check("cpu", dt, g, CPU_SHAPES)
        print(json.dumps({"dtype": str(dt).replace("torch.", ""), "n": len(rows),
                          "failed": [r for r in rows if not r["ok"]], "rows": rows}), flush=True)
    for name in models:
        print(json.dumps(step(name, S)), flush=True)
