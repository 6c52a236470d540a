"""Run under TRITON_INTERPRET=1 (by test_decode_kernels.py): every ``tkcc.kernels.checks`` family against its
reference in one process, so that its imports are paid once. Arguments: ``DTYPE:FAMILY,FAMILY[:N]`` groups (N: each
family's first N CPU shapes only). One JSON line per group: {"dtype", "n", "failed"} (fresh random inputs)."""
import json
import sys

import torch

from tkcc.kernels.checks import run_checks

for group in sys.argv[1:]:
    dtype, families, *first = group.split(":")
    rows = run_checks("cpu", getattr(torch, dtype), families.split(","), cpu_shapes=int(first[0]) if first else None)
    print(json.dumps({"dtype": dtype, "n": len(rows), "failed": [r for r in rows if not r["ok"]]}), flush=True)
