"""The supervisor's compile pool: candidates' kernels compiled ahead, while the engine works on others.

``prepare(candidate, tiers)`` asks the worker which compiles the candidate's
build needs (``discover``: nothing compiles, nothing launches) and queues them
in the compile pool (``tkcc.codegen.compile_pool``: worker processes, or Ray
tasks on CPU nodes). It returns at once. When the candidate is later loaded
(``load``, or the ``experiment`` that loads it), the supervisor first waits for
*that* candidate's compiles only, outside the worker, and then the worker's
JIT finds every kernel in the shared cache. A kernel that failed to compile
fails that candidate on that tier with the compiler's message, before any
engine time is spent on it; ``cancel`` drops a prepared candidate's compiles.

The pool is the supervisor's, not the worker's: the worker forks candidate
processes (process isolation) and must not hold a pool's threads, and a
worker that is replaced keeps the compiles already under way.
"""
from __future__ import annotations

import os
import threading

from tkcc.errors import EngineError

EXECUTORS = ("local", "ray")


def configure(cfg: dict) -> dict:
    """Fill the compile settings of an engine's ``cfg`` with their defaults; refuse bad ones by name.

    ``kernel_cache``: the shared cache folder (default ``tkcc.codegen.kernel_cache.default_dir()``);
    ``compile_workers``: pool size (default: the machine's cores on a GPU engine or one with a
    ``compile_target``; 0, no pool, on a CPU engine, which compiles no Triton kernel); ``compile_executor``:
    local | ray (``ray_address``: a running cluster, default a local one)."""
    from tkcc.codegen.kernel_cache import default_dir

    cfg.setdefault("kernel_cache", default_dir())
    compiles = str(cfg.get("device", "cpu")).startswith("cuda") or bool(cfg.get("compile_target"))
    workers = cfg.get("compile_workers")
    if workers is None:
        workers = (os.cpu_count() or 1) if compiles else 0
    try:
        workers = int(workers)
    except (TypeError, ValueError):
        raise EngineError(f"--compile-workers {workers!r}: expected a number of processes") from None
    if workers < 0:
        raise EngineError(f"--compile-workers {workers}: must be 0 (no pool) or more")
    cfg["compile_workers"] = workers
    ex = cfg.get("compile_executor") or "local"
    if ex not in EXECUTORS:
        raise EngineError(f"--compile-executor {ex!r}: must be one of {list(EXECUTORS)}")
    cfg["compile_executor"] = ex
    target = cfg.get("compile_target")
    if target:
        from tkcc.kernels.compile_job import parse_target

        try:
            parse_target(str(target))
        except Exception as e:  # noqa: BLE001 - named
            raise EngineError(f"--compile-target {target!r}: {e}") from None
    return cfg


class Ahead:
    """Mixed into the Supervisor: ``prepare``, ``cancel`` and the wait before a load (see the module doc)."""

    def _ahead_setup(self) -> None:
        self._pool = None
        self._pool_lock = threading.Lock()

    def compile_pool(self):
        """The pool, started on first use (None: this engine has none)."""
        if not self.cfg.get("compile_workers"):
            return None
        with self._pool_lock:
            if self._pool is None:
                from tkcc.codegen.compile_pool import CompilePool

                self._pool = CompilePool(self.cfg["kernel_cache"], self.cfg["compile_workers"],
                                         self.cfg.get("compile_executor") or "local", self.cfg.get("ray_address"))
            return self._pool

    def prepare(self, candidate: dict, tiers="both", timeout_s: float | None = None) -> dict:
        """List and queue the candidate's compiles on each tier; returns what was found, at once."""
        from tkcc.kernels.compile_job import KernelJob
        from tkcc.runtime.supervisor import _tiers

        out = {}
        for tier in _tiers(tiers):
            found = self.call("discover", timeout_s, spec=candidate, tier=tier)
            jobs = [KernelJob.from_json(j) for j in found.pop("jobs", [])]
            self.specs[found["candidate"]] = candidate
            pool = self.compile_pool() if jobs else None
            if jobs and pool is None:
                found["note"] = (f"{len(jobs)} kernel compile(s) found, but this engine has no compile pool "
                                 "(--compile-workers 0): they compile when the candidate loads")
            found["jobs"] = len(jobs)
            found["queued"] = pool.submit(f"{found['candidate']}/{tier}", jobs) if pool is not None else 0
            out[tier] = found
        return out

    def cancel(self, candidate: dict) -> dict:
        """Drop a prepared candidate's compiles that have not started (both tiers)."""
        from tkcc.runtime import candidates as cands
        from tkcc.runtime.programs import TIERS

        cid = cands.candidate_id(candidate, int(self.cfg.get("max_artifact_bytes", 256 << 20)))
        pool = self._pool
        n = sum(pool.cancel(f"{cid}/{t}") for t in TIERS) if pool is not None else 0
        return {"candidate": cid, "cancelled": n}

    def kernels_for(self, candidate: dict, tier: str, timeout_s: float | None = None) -> dict | None:
        """Wait for the candidate's queued compiles on ``tier`` (its own only); their outcome, or None when
        none were queued. Never holds the worker."""
        pool = self._pool
        if pool is None:
            return None
        from tkcc.runtime import candidates as cands

        try:
            cid = cands.candidate_id(candidate, int(self.cfg.get("max_artifact_bytes", 256 << 20)))
        except EngineError:
            return None  # a bad spec: the load says why
        owner = f"{cid}/{tier}"
        if owner not in pool.owned and owner not in pool.cancelled:
            return None
        out = pool.wait(owner, timeout=timeout_s or self.default_timeout)
        pool.forget(owner)
        return out.to_json() | {"ok": out.ok, "reason": out.reason()}

    def ahead_status(self) -> dict:
        out = {"workers": self.cfg.get("compile_workers", 0), "executor": self.cfg.get("compile_executor"),
               "kernel_cache": self.cfg.get("kernel_cache"), "target": self.cfg.get("compile_target")}
        if self._pool is not None:
            out["pool"] = self._pool.status()
        return out

    def close_pool(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
