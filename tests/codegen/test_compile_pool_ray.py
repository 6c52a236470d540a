"""The compile pool's Ray executor: each job a Ray task on a CPU worker; its cache entry comes back and is
installed here, checksummed; a kernel that does not compile fails its owner with the compiler's message."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("triton")

from test_compile_pool import BAD, _jit_hits, _jobs, cache_dir, good  # noqa: E402,F401

from tkcc.codegen.compile_pool import CompilePool  # noqa: E402
from tkcc.codegen.kernel_cache import KernelCache  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ours = not ray.is_initialized()
    if ours:
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 configure_logging=False)
    yield
    if ours:
        ray.shutdown()


def test_ray_tasks_compile_and_the_entries_are_installed_here(cache_dir, local_ray):
    src = good("ray")
    jobs = _jobs(src, "scale_kernel", scales=(2.0, 3.0))
    bad = _jobs(BAD, "broken_kernel")
    pool = CompilePool(cache_dir, executor="ray")
    try:
        pool.submit("a", jobs)
        pool.submit("bad", bad)
        out, failed = pool.wait("a", timeout=300), pool.wait("bad", timeout=300)
    finally:
        pool.close()
    assert out.ok and out.compiled + out.cached == 2, out
    assert not failed.ok and "nope" in failed.failed[0]
    cache = KernelCache(cache_dir)
    assert len(cache.entries()) == 2 and all(cache.has(e) for e in cache.entries())
    assert _jit_hits(src, "scale_kernel", 3.0) == [True]  # this process's JIT loads what the task compiled
