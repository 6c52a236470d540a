"""Run under TRITON_INTERPRET=1 (by test_decode_passes.py): the decode passes with their kernel paths live
(fp32, CPU) against the captured decode graph, on fresh cache contents. One JSON line per (model, plan)."""
import json
import sys

import torch

from tkcc.frontend.capture import capture_model
from tkcc.kernels.common import fallbacks
from tkcc.passes.manager import apply_plan
from tkcc.passes.plan import PassPlan

PLANS = {"lowered": [("lowered_decode", {"attn_chunk": 64, "attn_tile": "16x4"})],
         "graph_passes": [("decode_fusion", {}), ("kv_split_attention", {"chunk": 64}), ("moe_regroup", {})]}


def first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


for name in sys.argv[1:]:
    prog = capture_model(name, "float32", "cpu", max_cache_len=32, phases=["decode"])
    for plan_name, steps in PLANS.items():
        new, _logs = apply_plan(prog, PassPlan.of(*steps), mode="tolerance", check_numerics=False)
        g = torch.Generator().manual_seed(len(plan_name))
        errs = []
        for i in range(2):
            for _n, b in prog.state.named_buffers():
                b.copy_(torch.randn(b.shape, generator=g))
            saved = [b.clone() for _n, b in prog.state.named_buffers()]
            ids = torch.randint(0, 256, (1, 1), generator=g)
            pos = torch.tensor([int(torch.randint(0, 30, (1,), generator=g))])
            ref = first(prog.graphs["decode"](ids, pos))
            after = [b.clone() for _n, b in prog.state.named_buffers()]
            for (_n, b), s in zip(prog.state.named_buffers(), saved):
                b.copy_(s)
            got = first(new.graphs["decode"](ids, pos))
            cache = max(float((b - a).abs().max()) for (_n, b), a in zip(prog.state.named_buffers(), after))
            errs.append((float((got - ref).norm() / ref.norm()), cache))
        print(json.dumps(dict(model=name, plan=plan_name, errs=errs, fallbacks=fallbacks())), flush=True)
