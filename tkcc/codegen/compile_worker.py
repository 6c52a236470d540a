"""One compile-pool worker process: reads kernel jobs (JSON lines) on stdin, compiles each, answers on stdout.

Started by ``tkcc.codegen.compile_pool`` as ``python -m tkcc.codegen.compile_worker CACHE_DIR``, a plain
subprocess rather than a ``multiprocessing`` child: a spawned child would import the caller's ``__main__``
(a user's script calling ``tkcc.compile`` without a ``__main__`` guard would run again in every worker). It
exits when its stdin closes, so it never outlives the pool that started it.
"""
from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    from tkcc.codegen import kernel_cache

    kernel_cache.use(argv[0])
    from tkcc.kernels.compile_job import KernelCompileError, KernelJob, compile_job

    out = sys.stdout
    sys.stdout = sys.stderr  # what the compiler prints must not reach the answers
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            res = {"ok": True, "result": compile_job(KernelJob.from_json(json.loads(line)))}
        except KernelCompileError as e:
            res = {"ok": False, "error": str(e), "compile": True}
        except Exception as e:  # noqa: BLE001 - this job's failure, named; the worker goes on
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "compile": False}
        out.write(json.dumps(res) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
