"""The compile pool: Triton compiles in worker processes (or Ray tasks), ahead of the engine, into the cache.

The engine lists the compiles a candidate needs (``tkcc.kernels.discovery``)
and submits them here under an *owner* (the candidate on one tier); they run
in parallel while the engine validates and measures other candidates, and
land in the shared kernel cache (``tkcc.codegen.kernel_cache``), where the
engine's JIT finds them. When the engine turns to a candidate it waits for
that owner's jobs only (``wait``); everything else keeps compiling.

* A job that fails to compile fails its owner, with the compiler's message
  (``Outcome.failed``); no other owner, and not the pool, is affected. The
  same job submitted by two owners is compiled once.
* ``cancel(owner)`` drops the owner's jobs that have not started (and that no
  other owner waits for); its ``wait`` then says it was cancelled. A compile
  already running finishes into the cache.
* A worker process that dies (a compiler crash) is replaced and the job it
  took down is retried once; a job that kills a worker twice fails its owner.

Two executors, one mechanism: ``local`` (worker processes on this machine,
``tkcc.codegen.compile_worker``, ``os.cpu_count()`` of them by default,
writing into the cache folder directly) and ``ray`` (each job a Ray task with ``num_cpus=1``, placed on any
node of the cluster; its entry's files come back and are installed here).
``clock`` times the waits (tests pass a fake one).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from dataclasses import dataclass, field

from tkcc.codegen.kernel_cache import KernelCache, KernelCacheError
from tkcc.errors import TkccError
from tkcc.kernels.compile_job import KernelCompileError, KernelJob, compile_job

EXECUTORS = ("local", "ray")


def default_workers() -> int:
    return max(1, os.cpu_count() or 1)


@dataclass
class Outcome:
    """What ``wait`` found for one owner: every job compiled (or found cached), or why not."""

    owner: str
    jobs: int = 0
    compiled: int = 0     # compiled by the pool
    cached: int = 0       # found in the cache by a worker (another owner or campaign compiled it)
    failed: list[str] = field(default_factory=list)  # the compilers' messages
    cancelled: bool = False
    wait_s: float = 0.0     # how long ``wait`` blocked: the only compile time on the caller's critical path
    compile_s: float = 0.0  # worker seconds spent on these jobs (in parallel, off the critical path)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.cancelled

    def reason(self) -> str:
        if self.cancelled:
            return "its kernel compiles were cancelled"
        if self.failed:
            more = f" (and {len(self.failed) - 1} more)" if len(self.failed) > 1 else ""
            return f"a kernel failed to compile: {self.failed[0]}{more}"
        return ""

    def to_json(self) -> dict:
        return {"jobs": self.jobs, "compiled": self.compiled, "cached": self.cached, "failed": list(self.failed),
                "cancelled": self.cancelled, "wait_s": round(self.wait_s, 4), "compile_s": round(self.compile_s, 4)}


class _Task:
    """One job's compile, shared by every owner that submitted it."""

    def __init__(self, job: KernelJob):
        self.job = job
        self.future: cf.Future | None = None
        self.executor = None
        self.owners: set[str] = set()
        self.retried = False
        self.result: dict | None = None
        self.error: str | None = None
        self.done = threading.Event()


class WorkerDied(Exception):
    """A compile worker process exited while compiling a job (a compiler crash)."""


class _Workers:
    """``n`` persistent compile-worker processes (``tkcc.codegen.compile_worker``), one per thread of a thread
    pool: a thread hands its worker one job at a time. A worker that dies is started again for the next job."""

    def __init__(self, n: int, folder: str):
        self.folder = folder
        self.local = threading.local()
        self.procs: list = []
        self.lock = threading.Lock()
        self.pool = cf.ThreadPoolExecutor(n, thread_name_prefix="tkcc-compile")

    def _proc(self):
        import subprocess
        import sys

        p = getattr(self.local, "proc", None)
        if p is None or p.poll() is not None:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            p = subprocess.Popen([sys.executable, "-m", "tkcc.codegen.compile_worker", self.folder],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
            self.local.proc = p
            with self.lock:
                self.procs.append(p)
        return p

    def _run(self, job: dict) -> dict:
        import json

        p = self._proc()
        try:
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()
            line = p.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            p.wait(10)
            self.local.proc = None
            raise WorkerDied(f"exit code {p.returncode}")
        res = json.loads(line)
        if res["ok"]:
            return res["result"]
        if res.get("compile"):
            raise KernelCompileError(res["error"])
        raise TkccError(res["error"])

    def submit(self, job: dict) -> cf.Future:
        return self.pool.submit(self._run, job)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            procs, self.procs = self.procs, []
        for p in procs:
            try:
                p.stdin.close()  # the worker exits at the end of its input
            except OSError:
                pass
            try:
                p.wait(5)
            except Exception:  # noqa: BLE001 - a worker mid-compile: stopped
                p.kill()


def _run_remote(job: dict) -> dict:
    """A Ray task: compile into this node's own cache folder and send the entry back."""
    import tempfile

    from tkcc.codegen import kernel_cache

    os.environ.pop("TRITON_INTERPRET", None)
    kernel_cache.use(os.environ.get("TKCC_RAY_COMPILE_CACHE") or os.path.join(tempfile.gettempdir(),
                                                                              f"tkcc-ray-kernels-{os.getuid()}"))
    return compile_job(KernelJob.from_json(job), return_files=True)


class CompilePool:
    def __init__(self, cache: KernelCache | str | None = None, workers: int | None = None, executor: str = "local",
                 ray_address: str | None = None, clock=time.monotonic):
        if executor not in EXECUTORS:
            raise TkccError(f"compile pool: executor {executor!r} is not one of {list(EXECUTORS)}")
        self.cache = cache if isinstance(cache, KernelCache) else KernelCache(cache)
        self.workers = int(workers or default_workers())
        if self.workers < 1:
            raise TkccError(f"compile pool: workers must be at least 1, got {self.workers}")
        self.executor_kind, self.ray_address, self.clock = executor, ray_address, clock
        self.lock = threading.RLock()
        self.tasks: dict[str, _Task] = {}           # job id -> task
        self.owned: dict[str, list[str]] = {}       # owner -> job ids
        self.cancelled: set[str] = set()
        self.totals = {"jobs": 0, "compiled": 0, "cached": 0, "failed": 0, "compile_s": 0.0, "restarts": 0}
        self._executor = None
        self._remote = None

    # ---- the executor -----------------------------------------------------------------------------
    def _start(self):
        if self._executor is not None:
            return self._executor
        if self.executor_kind == "local":
            self._executor = _Workers(self.workers, self.cache.folder)
        else:
            import ray

            if not ray.is_initialized():
                ray.init(address=self.ray_address, ignore_reinit_error=True, log_to_driver=False)
            self._remote = ray.remote(num_cpus=1, max_retries=0)(_run_remote)
            self._executor = "ray"
        return self._executor

    def _launch(self, task: _Task) -> None:
        with self.lock:
            ex = self._start()
            if ex == "ray":
                fut = self._remote.remote(task.job.to_json()).future()
            else:
                fut = ex.submit(task.job.to_json())
            task.future, task.executor = fut, ex
        fut.add_done_callback(lambda f, t=task: self._finished(t, f))


    def _finished(self, task: _Task, fut: cf.Future) -> None:
        if fut.cancelled():
            task.error = "cancelled"
            task.done.set()
            return
        try:
            res = fut.result()
            if "files" in res:  # a remote compile: its entry comes here
                self.cache.install(res["entry"], res.pop("files"))
            task.result = res
        except KernelCompileError as e:
            task.error = str(e)
        except KernelCacheError as e:
            task.error = str(e)
        except WorkerDied as e:
            if not task.retried:  # a compiler crash took its worker down: once more, in a fresh worker
                task.retried = True
                with self.lock:
                    self.totals["restarts"] += 1
                try:
                    self._launch(task)
                    return
                except Exception as e2:  # noqa: BLE001 - reported as this job's failure
                    task.error = f"{task.job.describe()}: the compile pool could not take it again ({e2})"
            else:
                task.error = f"{task.job.describe()}: the compiler's process died twice compiling it ({e})"
        except Exception as e:  # noqa: BLE001 - a Ray task's failure, an unpicklable error: this job's
            task.error = f"{task.job.describe()}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        with self.lock:
            if task.error is not None:
                self.totals["failed"] += 1
            else:
                self.totals["cached" if task.result.get("cached") else "compiled"] += 1
                self.totals["compile_s"] += float(task.result.get("seconds") or 0.0)
        task.done.set()

    # ---- owners ----------------------------------------------------------------------------------
    def submit(self, owner: str, jobs: list[KernelJob]) -> int:
        """Queue ``owner``'s jobs (each distinct compile once, whoever asks); returns how many are new."""
        new = 0
        with self.lock:
            self.cancelled.discard(owner)
            ids = self.owned.setdefault(owner, [])
            for job in jobs:
                task = self.tasks.get(job.id)
                if task is None or (task.error == "cancelled"):
                    task = self.tasks[job.id] = _Task(job)
                    self.totals["jobs"] += 1
                    new += 1
                    self._launch(task)
                task.owners.add(owner)
                if job.id not in ids:
                    ids.append(job.id)
        return new

    def pending(self, owner: str | None = None) -> int:
        """Jobs not finished (of ``owner``, or all)."""
        with self.lock:
            ids = self.owned.get(owner, []) if owner is not None else list(self.tasks)
            return sum(1 for i in ids if not self.tasks[i].done.is_set())

    def wait(self, owner: str, timeout: float | None = None) -> Outcome:
        """Block until ``owner``'s jobs are done (or ``timeout`` s); what became of them. Unknown owner: nothing."""
        t0 = self.clock()
        with self.lock:
            ids = list(self.owned.get(owner, []))
            cancelled = owner in self.cancelled
        out = Outcome(owner, jobs=len(ids), cancelled=cancelled)
        if cancelled:
            return out
        deadline = None if timeout is None else time.monotonic() + timeout
        for i in ids:
            task = self.tasks[i]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not task.done.wait(left):
                out.failed.append(f"{task.job.describe()}: not compiled within {timeout:g} s")
                continue
            if task.error == "cancelled":
                out.cancelled = True
            elif task.error is not None:
                out.failed.append(task.error)
            elif task.result.get("cached"):
                out.cached += 1
            else:
                out.compiled += 1
                out.compile_s += float(task.result.get("seconds") or 0.0)
        out.wait_s = self.clock() - t0
        return out

    def cancel(self, owner: str) -> int:
        """Drop ``owner``'s jobs that have not started and that no other owner needs; returns how many."""
        n = 0
        with self.lock:
            self.cancelled.add(owner)
            for i in self.owned.pop(owner, []):
                task = self.tasks[i]
                task.owners.discard(owner)
                if not task.owners and task.future is not None and not task.done.is_set() and task.future.cancel():
                    n += 1
        return n

    def forget(self, owner: str) -> None:
        """The owner was measured: its bookkeeping goes (the compiled kernels stay in the cache)."""
        with self.lock:
            for i in self.owned.pop(owner, []):
                task = self.tasks.get(i)
                if task is not None:
                    task.owners.discard(owner)
                    if not task.owners and task.done.is_set():
                        self.tasks.pop(i, None)
            self.cancelled.discard(owner)

    def status(self) -> dict:
        with self.lock:
            return {"executor": self.executor_kind, "workers": self.workers, "pending": self.pending(),
                    "owners": len(self.owned), **{k: (round(v, 3) if isinstance(v, float) else v)
                                                  for k, v in self.totals.items()}, "cache": self.cache.folder}

    def close(self) -> None:
        with self.lock:
            ex, self._executor = self._executor, None
        if ex not in (None, "ray"):
            ex.shutdown()
