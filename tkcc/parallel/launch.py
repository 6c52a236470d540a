"""Run a function on N ranks of one process group, and fail cleanly when a rank fails.

``launch(fn, world_size, args)`` starts ``world_size`` processes, each of
which joins one ``torch.distributed`` group (NCCL when CUDA is present, gloo
otherwise; rendezvous through a FileStore in a fresh temp dir, so no port can
collide), calls ``fn(rank, world_size, *args)`` and sends back its result.
The parent watches every rank: the first one that raises, dies (signal, OOM
killer, ``os._exit``) or outlives ``timeout_s`` ends the whole group — the
other ranks are terminated, then killed, each by its own pid — and the parent
raises ``RankError`` naming the rank and the cause. Collectives get
``collective_timeout_s``, so a rank blocked on a dead peer errors out instead
of hanging. Every started process is reaped before ``launch`` returns.

Each rank's environment gets ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` (NVLink
multicast off, as the lent multi-GPU machines require).
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback

from tkcc.errors import TkccError

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class RankError(TkccError):
    """A rank of a process group raised, died or timed out; the whole group was torn down."""

    def __init__(self, message: str, rank: int | None = None, kind: str = "error", details: str = ""):
        super().__init__(message)
        self.rank, self.kind, self.details = rank, kind, details


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def check_world(world_size: int, backend: str) -> None:
    from tkcc.parallel.layout import LayoutError

    if world_size < 1:
        raise LayoutError(f"launch: world_size={world_size} must be at least 1")
    if backend == "nccl":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > n:
            raise LayoutError(f"launch: {world_size} ranks need {world_size} GPUs, only {n} present")


def init_rank(rank: int, world_size: int, store_path: str, backend: str, collective_timeout_s: float) -> None:
    """Join the group as ``rank`` (sets the CUDA device for NCCL)."""
    import torch
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST_ENV)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout_s), **kwargs)


def _rank_main(rank, world_size, fn, args, store_path, backend, collective_timeout_s, results, threads):
    os.environ.update(NO_MULTICAST_ENV)
    try:
        import torch
        import torch.distributed as dist

        if threads:
            torch.set_num_threads(threads)
        init_rank(rank, world_size, store_path, backend, collective_timeout_s)
        try:
            out = fn(rank, world_size, *args)
        finally:
            # no barrier: a failed peer must not make this rank wait on it
            dist.destroy_process_group()
        # plain pickle: torch's fd-sharing reducers would need this process alive after it exits
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - report, then exit non-zero
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-6000:]
        try:
            results.put(("error", rank, f"{type(e).__name__}: {e}\n{tb}"))
            results.close()
            results.join_thread()  # flush the report before the hard exit
        finally:
            os._exit(1)


def launch(fn, world_size: int, args: tuple = (), backend: str | None = None, timeout_s: float = 600.0,
           collective_timeout_s: float = 60.0, start_method: str | None = None, threads: int | None = 1) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank.

    ``fn`` and its results must be picklable with ``start_method`` "spawn"
    (the default with CUDA); with gloo the default is "fork" (fast start,
    CPU only). Raises RankError on the first failing rank, after tearing
    the group down.
    """
    backend = backend or default_backend()
    check_world(world_size, backend)
    if start_method is None:
        start_method = "spawn" if backend == "nccl" or "fork" not in mp.get_all_start_methods() else "fork"
    ctx = mp.get_context(start_method)
    tmp = tempfile.mkdtemp(prefix="tkcc-pg-")
    store_path = os.path.join(tmp, "store")
    results = ctx.Queue()
    procs = []
    old_env = {k: os.environ.get(k) for k in NO_MULTICAST_ENV}
    os.environ.update(NO_MULTICAST_ENV)  # spawned children inherit it from the start
    try:
        for r in range(world_size):
            p = ctx.Process(target=_rank_main, name=f"tkcc-rank{r}",
                            args=(r, world_size, fn, args, store_path, backend, collective_timeout_s, results,
                                  threads), daemon=True)
            p.start()
            procs.append(p)
        return _collect(procs, results, world_size, timeout_s)
    finally:
        teardown(procs)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs, results, world_size: int, timeout_s: float) -> list:
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < world_size:
        try:
            status, rank, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            status = None
        if status == "ok":
            out[rank] = pickle.loads(payload)
            continue
        if status == "error":
            raise RankError(f"rank {rank} of {world_size} failed: {payload.splitlines()[0]}", rank, "error", payload)
        for r, p in enumerate(procs):
            if r not in out and p.exitcode is not None and p.exitcode != 0:
                # it may have reported just before dying: drain once more
                try:
                    st, rk, pl = results.get(timeout=0.5)
                    if st == "error":
                        raise RankError(f"rank {rk} of {world_size} failed: {pl.splitlines()[0]}", rk, "error", pl)
                    out[rk] = pickle.loads(pl)
                except queue_mod.Empty:
                    pass
                if r not in out:
                    raise RankError(f"rank {r} of {world_size} died ({_exit_name(p.exitcode)}) without a result; "
                                    f"the group was torn down", r, "died")
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if r not in out]
            raise RankError(f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s; "
                            f"the group was torn down", missing[0], "timeout")
    return [out[r] for r in range(world_size)]


def _exit_name(code: int) -> str:
    import signal

    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def teardown(procs, grace_s: float = 3.0) -> None:
    """Terminate, then kill, every process of ``procs`` still alive (each by its own pid), and reap them."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
