"""The compile pool and the shared kernel cache, with real Triton compiles for sm_90 on this CPU machine.

The jobs come from real launches (``tkcc.kernels.discovery`` with a stand-in driver for ``cuda:90:32``), so
the keys are the ones the engine's JIT computes; the JIT's own compile then finds the pool's result in the
cache (``cache_hit``), which is what the engine relies on.
"""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

pytest.importorskip("triton")

from tkcc.codegen import kernel_cache  # noqa: E402
from tkcc.codegen.compile_pool import CompilePool  # noqa: E402
from tkcc.codegen.kernel_cache import KernelCache, KernelCacheError  # noqa: E402
from tkcc.kernels import compile_job as cj  # noqa: E402
from tkcc.kernels.discovery import deferring  # noqa: E402
from tkcc.kernels.render import import_source  # noqa: E402

TARGET = "cuda:90:32"

GOOD = '''
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * SCALE, mask=m)
'''



def good(tag: str) -> str:
    """GOOD as a module of its own: a kernel compiled by an earlier test's JIT is in that module's memory."""
    return GOOD + f"# {tag}\n"


# a name the compiler cannot resolve: it refuses the kernel with its own message
BAD = GOOD.replace("scale_kernel", "broken_kernel").replace("tl.arange(0, BLOCK)", "tl.arange(0, BLOCK) + nope")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TKCC_KERNEL_CACHE", str(tmp_path / "render"))
    for k in ("TRITON_CACHE_DIR", "TRITON_CACHE_MANAGER"):
        monkeypatch.delenv(k, raising=False)
    folder = kernel_cache.use(tmp_path / "kernels")
    kernel_cache.REBUILT.clear()
    yield folder


def _jobs(src: str, name: str, scales=(2.0,), block=256, dtype=torch.float32) -> list:
    """Real launches of the kernel in ``src`` under discovery: the JIT's own specialisations, as jobs."""
    mod = import_source("tkcc_test_pool", src)
    fn = getattr(mod, name)
    x = torch.empty(1000, dtype=dtype, device="meta")
    jobs = []
    with deferring(jobs.append, target=TARGET):
        for s in scales:
            fn[(4,)](x, x, 1000, SCALE=s, BLOCK=block)
    return jobs


def _jit_hits(src: str, name: str, scale: float) -> list[bool]:
    """Triton's own JIT compile of one specialisation (warm-up: no launch): was it a cache hit?"""
    from triton import knobs
    from triton.runtime.driver import driver

    from tkcc.kernels.discovery import CompileOnlyDriver

    mod = import_source("tkcc_test_pool", src)
    hits = []
    saved = driver._active
    knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    driver.set_active(CompileOnlyDriver(TARGET))
    try:
        getattr(mod, name).warmup(torch.empty(1000, device="meta"), torch.empty(1000, device="meta"), 1000,
                                  SCALE=scale, BLOCK=256, grid=(4,))
    finally:
        knobs.compilation.listener = None
        driver._active = saved
    return hits


def test_discovery_lists_the_jits_compiles_without_compiling_or_launching(cache_dir):
    SRC = good("test_discovery_lists_the_jits_compiles_without_compiling_or_launching")
    jobs = _jobs(SRC, "scale_kernel", scales=(2.0, 3.0))
    assert len(jobs) == 2 and len({j.id for j in jobs}) == 2  # one job per specialisation
    spec = json.loads(jobs[0].spec)
    assert spec["signature"]["x_ptr"] == "*fp32" and spec["options"]["arch"] == "sm90"
    assert jobs[0].target == TARGET and "scale_kernel" in jobs[0].describe()
    assert KernelCache(cache_dir).entries() == []  # nothing compiled
    again = cj.KernelJob.from_json(json.loads(json.dumps(jobs[0].to_json())))
    assert again == jobs[0] and again.id == jobs[0].id


def test_pool_compiles_into_the_cache_the_jit_reads(cache_dir):
    SRC = good("test_pool_compiles_into_the_cache_the_jit_reads")
    jobs = _jobs(SRC, "scale_kernel", scales=(2.0, 3.0))
    pool = CompilePool(cache_dir, workers=2)
    try:
        assert pool.submit("cand-a/fast", jobs) == 2
        assert pool.submit("cand-b/fast", jobs[:1]) == 0  # the same compile, asked for twice: once
        out = pool.wait("cand-a/fast", timeout=300)
        assert out.ok and out.jobs == 2 and out.compiled + out.cached == 2, out
        assert out.compile_s > 0 and pool.wait("cand-b/fast", timeout=60).ok
    finally:
        pool.close()
    cache = KernelCache(cache_dir)
    assert len(cache.entries()) == 2 and all(cache.has(e) for e in cache.entries())
    assert _jit_hits(SRC, "scale_kernel", 2.0) == [True]   # the JIT found the pool's compile
    assert _jit_hits(SRC, "scale_kernel", 5.0) == [False]  # a specialisation nobody compiled


def test_a_kernel_that_fails_costs_its_owner_only_with_the_compilers_message(cache_dir):
    SRC = good("test_a_kernel_that_fails_costs_its_owner_only_with_the_compilers_message")
    ok_jobs, bad_jobs = _jobs(SRC, "scale_kernel"), _jobs(BAD, "broken_kernel")
    pool = CompilePool(cache_dir, workers=2)
    try:
        pool.submit("bad", bad_jobs)
        pool.submit("good", ok_jobs)
        b, g = pool.wait("bad", timeout=300), pool.wait("good", timeout=300)
    finally:
        pool.close()
    assert not b.ok and len(b.failed) == 1
    assert "broken_kernel" in b.failed[0] and "nope" in b.failed[0], b.failed[0]  # the compiler's own words
    assert b.reason().startswith("a kernel failed to compile: ")
    assert g.ok and g.compiled + g.cached == 1
    assert pool.status()["failed"] == 1


def test_cancel_drops_jobs_not_started_and_spares_other_owners(cache_dir):
    SRC = good("test_cancel_drops_jobs_not_started_and_spares_other_owners")
    jobs = _jobs(SRC, "scale_kernel", scales=tuple(float(s) for s in range(2, 10)))
    pool = CompilePool(cache_dir, workers=1)
    try:
        pool.submit("keep", jobs[:1])
        pool.submit("drop", jobs)          # shares its first job with "keep"
        n = pool.cancel("drop")
        assert n >= 1  # with one worker most of the eight have not started
        assert pool.wait("drop").cancelled and not pool.wait("drop").ok
        assert "cancelled" in pool.wait("drop").reason()
        kept = pool.wait("keep", timeout=300)
        assert kept.ok and kept.compiled + kept.cached == 1
        again = pool.submit("drop", jobs[-1:])  # asked again after a cancel: compiled this time
        assert again == 1 and pool.wait("drop", timeout=300).ok
    finally:
        pool.close()


def test_a_corrupt_entry_is_detected_by_its_checksum_and_rebuilt(cache_dir):
    SRC = good("test_a_corrupt_entry_is_detected_by_its_checksum_and_rebuilt")
    jobs = _jobs(SRC, "scale_kernel")
    assert not cj.compile_job(jobs[0])["cached"]
    cache = KernelCache(cache_dir)
    (entry,) = cache.entries()
    cubin = os.path.join(cache_dir, entry, "scale_kernel.cubin")
    with open(cubin, "r+b") as f:  # what a copy cut short by a full disk leaves
        f.truncate(os.path.getsize(cubin) // 2)
    assert not cache.has(entry)
    res = cj.compile_job(jobs[0])
    assert not res["cached"] and res["entry"] == entry  # compiled again, not loaded
    assert "scale_kernel.cubin does not match its checksum" in kernel_cache.REBUILT[entry]
    assert cache.has(entry) and _jit_hits(SRC, "scale_kernel", 2.0) == [True]
    group = next(p for p in os.listdir(os.path.join(cache_dir, entry)) if p.startswith("__grp__"))
    with open(os.path.join(cache_dir, entry, group), "w") as f:
        f.write('{"child_paths": {')  # a group file cut short
    assert not cache.has(entry)
    assert not cj.compile_job(jobs[0])["cached"] and "unreadable" in kernel_cache.REBUILT[entry]


def test_a_full_disk_leaves_no_half_entry(cache_dir, tmp_path, monkeypatch):
    SRC = good("test_a_full_disk_leaves_no_half_entry")
    jobs = _jobs(SRC, "scale_kernel")
    remote = kernel_cache.use(tmp_path / "remote")  # an entry compiled elsewhere (a Ray worker's node)
    res = cj.compile_job(jobs[0], return_files=True)
    kernel_cache.use(cache_dir)
    cache = KernelCache(cache_dir)
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(KernelCacheError, match="the disk is full"):
        cache.install(res["entry"], res["files"])
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert not cache.has(res["entry"])  # the group is written last: no entry to find
    assert not any(".tmp." in n for n in os.listdir(os.path.join(cache_dir, res["entry"])))
    cache.install(res["entry"], res["files"])
    assert cache.has(res["entry"]) and _jit_hits(SRC, "scale_kernel", 2.0) == [True]
    assert remote != cache_dir


def test_pool_wait_is_timed_with_the_given_clock(cache_dir):
    ticks = iter([100.0, 107.5])
    pool = CompilePool(cache_dir, workers=1, clock=lambda: next(ticks))
    try:
        out = pool.wait("nobody")  # no jobs: nothing to wait for, and the clock says how long that took
    finally:
        pool.close()
    assert out.ok and out.jobs == 0 and out.wait_s == 7.5
    t0 = time.monotonic()
    assert CompilePool(cache_dir, workers=1).wait("x", timeout=0.1).ok and time.monotonic() - t0 < 1


def test_a_compile_that_kills_its_worker_fails_its_owner_and_the_pool_goes_on(cache_dir):
    import dataclasses

    SRC = good("test_a_compile_that_kills_its_worker")
    ok_jobs = _jobs(SRC, "scale_kernel")
    crash = dataclasses.replace(ok_jobs[0], source=SRC + "import os\nos._exit(3)\n")  # dies as it loads
    pool = CompilePool(cache_dir, workers=1)
    try:
        pool.submit("crash", [crash])
        pool.submit("fine", ok_jobs)
        bad, fine = pool.wait("crash", timeout=300), pool.wait("fine", timeout=300)
    finally:
        pool.close()
    assert not bad.ok and "died twice" in bad.failed[0], bad.failed
    assert fine.ok and fine.compiled + fine.cached == 1
    assert pool.status()["restarts"] == 1
