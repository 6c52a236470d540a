"""Find out which Triton kernels a piece of code would compile, without compiling or launching any of them.

``deferring(on_job)`` is a block in which every Triton launch becomes what
``JITFunction.warmup`` does (specialise the arguments, look the kernel up, do
not launch), and every compile the JIT would run is handed to ``on_job`` as a
``KernelJob`` instead (Triton's ``jit_cache_hook``). Running a build in such a
block (a pass's kernel tuner times every config it knows) lists the compiles
the real build will need; they then run elsewhere, in parallel, ahead of it
(``tkcc.codegen.compile_pool``).

Nothing launches inside the block, not even a kernel compiled before, so no
kernel reads what a skipped kernel did not write (indices it should have
written, say); torch ops still run, on whatever the buffers hold, and the
block's results are only good for the list of jobs.

On a machine without the target GPU (a CPU, listing kernels for ``cuda:90:32``)
``target=`` installs a stand-in Triton driver for the block that names that
target; a launch with CPU or meta tensors then specialises as the JIT would
for device tensors of the same dtypes (pointers taken as 16-byte aligned).
"""
from __future__ import annotations

import linecache
import sys
import threading
from contextlib import contextmanager

from tkcc.kernels.compile_job import KernelJob, parse_target, target_name

_LOCK = threading.Lock()


class CompileOnlyDriver:
    """A Triton driver that can name a target and nothing more: enough for the JIT to specialise and ask to
    compile, never to launch (``deferring`` turns launches off)."""

    tkcc_compile_only = True

    def __init__(self, target):
        self.target = parse_target(target) if isinstance(target, str) else target

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


_DEFERRING = threading.Event()  # set while a ``deferring`` block runs (one per process)


def discovering() -> bool:
    """Is a ``deferring`` block running (Triton launches are off: any timing taken now is of nothing)? True on
    a GPU too, not only where a compile-only driver stands in for one: a tuner that recorded its picks from a
    GPU engine's discovery run (every config timed at ~0) shipped olmoe-16l's fused step 35% slow."""
    return _DEFERRING.is_set()


def _source_of(jit_fn) -> str:
    fn = jit_fn.fn
    mod = sys.modules.get(fn.__module__)
    src = getattr(mod, "TKCC_SOURCE", None)  # tkcc.kernels.render: the rendered text it imported
    if src is None:
        lines = linecache.getlines(fn.__code__.co_filename)  # Triton read it through inspect: it is cached
        src = "".join(lines)
    return src


class Found:
    """What a ``deferring`` block saw: launches turned off, and compiles listed (passed on or skipped)."""

    def __init__(self):
        self.launches = 0
        self.compiles = 0
        self.skipped = 0


@contextmanager
def deferring(on_job, target=None, skip=None):
    """Inside: launches do not run and compiles become ``on_job(KernelJob)`` calls (see the module doc); yields
    a ``Found``.

    ``target``: a target name (``cuda:90:32``) or GPUTarget to list kernels for with a stand-in driver (a
    machine without that GPU). ``skip(job, fn) -> bool`` (``fn`` the @triton.jit function): jobs already done
    (in the kernel cache), counted but not passed on. Not reentrant; one block at a time per process."""
    found = Found()
    from triton import knobs
    from triton.runtime import jit
    from triton.runtime.driver import driver

    def hook(*, fn, compile, **_kw):
        jit_fn = fn.jit_function
        device = compile["device"]
        tgt = jit_fn.device_caches[device][2]
        job = KernelJob(_source_of(jit_fn), jit_fn.fn.__name__, compile["specialization_data"], target_name(tgt),
                        f"{jit_fn.fn.__module__}.{jit_fn.fn.__qualname__}")
        found.compiles += 1
        if skip is not None and skip(job, jit_fn):
            found.skipped += 1
        else:
            on_job(job)
        return True  # do not compile here

    original_run = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        found.launches += 0 if warmup else 1
        return original_run(self, *args, grid=grid, warmup=True, **kwargs)

    if not _LOCK.acquire(blocking=False):
        raise RuntimeError("tkcc.kernels.discovery.deferring is not reentrant")
    saved_hook, saved_driver = knobs.runtime.jit_cache_hook, getattr(driver, "_active", None)
    try:
        knobs.runtime.jit_cache_hook = hook
        jit.JITFunction.run = run
        if target is not None:
            driver.set_active(CompileOnlyDriver(target))
        _DEFERRING.set()
        yield found
    finally:
        _DEFERRING.clear()
        jit.JITFunction.run = original_run
        knobs.runtime.jit_cache_hook = saved_hook
        if target is not None:
            driver._active = saved_driver
        _LOCK.release()
