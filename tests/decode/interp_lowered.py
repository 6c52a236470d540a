"""Run under TRITON_INTERPRET=1 (by test_lowered.py and test_lowered_mla.py): a module's interpreter cases in one
process, so that its imports and the rewrites' pattern traces are paid once. Arguments: ``DTYPE:FAMILY,FAMILY[:N]``
groups of ``tkcc.passes.lower.checks`` families (the rewrites against their patterns, kernels live; N: each
family's first N shapes only), then ``--`` and the models of interp_lowered_greedy.py. One JSON line per group,
{"dtype", "rows", "fallbacks"}, then one per model."""
import json
import sys

import torch

from interp_lowered_greedy import run as greedy_run
from tkcc.kernels.common import fallbacks
from tkcc.passes.lower.checks import run_checks

args = sys.argv[1:]
groups, models = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
for group in groups:  # DTYPE:FAMILY,FAMILY[:N], N: only each family's first N shapes
    dtype, families, *first = group.split(":")
    rows = run_checks("cpu", getattr(torch, dtype), families.split(","), first_shapes=int(first[0]) if first else None)
    print(json.dumps({"dtype": dtype, "rows": rows, "fallbacks": fallbacks()}), flush=True)
greedy_run(models)
