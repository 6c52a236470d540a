"""The engine's side of compiling ahead: its kernel cache, and ``discover``, which lists a candidate's compiles.

``discover`` builds a plan candidate for a tier the way ``load`` does (the one
pipeline, ``tkcc.pipeline.build``), inside ``tkcc.kernels.discovery.deferring``:
no kernel launches and none compiles, and what the build would have compiled
comes back as ``KernelJob`` records: the compiles its passes ask for while
they run (a kernel tuner's configs) and those of its generated kernels at the
shapes codegen saw. The supervisor hands them to its compile pool, which
compiles them into the shared kernel cache while the engine works on other
candidates; the candidate's ``load`` then finds them there.

A build that launched no kernel is a real build: it is kept, and ``load``
costs nothing. One that launched kernels did so with launches turned off (a
tuner timed nothing), so it is dropped and ``load`` builds again, this time
with the kernels compiled.

What is not found ahead: kernels that only the forward's first call compiles
(library ops at their default configs, which one candidate compiles for all
later ones and campaigns through the shared cache), and kernels of source
candidates (their code is not run before they are loaded). On a CPU engine no
Triton kernel compiles at all, unless ``compile_target`` names a GPU to list
and compile kernels for (``tkcc serve --compile-target cuda:90:32``).
"""
from __future__ import annotations

import os
import shutil
import time

from tkcc.errors import EngineError


def setup(cfg: dict):
    """This process's kernel cache (``cfg["kernel_cache"]``, checksummed) and JIT compile accounting; the
    ``KernelCache`` or None when the engine keeps Triton's own default cache. A CPU engine compiles no Triton
    kernel (unless ``compile_target`` names a GPU): nothing to set up, and Triton is not even imported."""
    if not (str(cfg.get("device", "cpu")).startswith("cuda") or cfg.get("compile_target")):
        return None
    try:
        from tkcc.kernels import jit_stats

        jit_stats.install()
    except ImportError:  # no Triton here: nothing compiles
        return None
    folder = cfg.get("kernel_cache")
    if not folder:
        return None
    from tkcc.codegen import kernel_cache

    kernel_cache.use(folder)
    return kernel_cache.KernelCache(folder)


def jit_now() -> dict:
    import sys

    mod = sys.modules.get("tkcc.kernels.jit_stats")  # counting only where setup installed it
    return mod.snapshot() if mod is not None and mod._INSTALLED else {}


def jit_since(before: dict) -> dict:
    if not before:
        return {}
    from tkcc.kernels import jit_stats

    return jit_stats.since(before)


def jit_counted(op):
    """An engine operation whose result says what the JIT compiled during it (``jit``: compiled, compile_s,
    loaded, load_s): the compile time on the engine's critical path, which compiling ahead is meant to empty."""
    import functools

    @functools.wraps(op)
    def run(*args, **kwargs):
        before = jit_now()
        out = op(*args, **kwargs)
        if isinstance(out, dict) and before:
            out["jit"] = jit_since(before)
        return out

    return run


def why_not(core, spec: dict) -> str:
    """'' when ``discover`` can list this candidate's compiles on this engine; else why not."""
    from tkcc.runtime import candidates as cands

    if cands.spec_kind(spec) != "plan":
        return "only plan candidates are built ahead (other kinds run code of their own when loaded)"
    if core.isolation != "inprocess":
        return "with process isolation candidates build in their own processes (a CPU: no Triton compiles)"
    if core.device.type != "cuda" and not core.cfg.get("compile_target"):
        return f"a {core.device.type} engine compiles no Triton kernels (--compile-target names a GPU to list them for)"
    if core.tp > 1:
        return "tensor-parallel ranks build together"
    return ""


def discover(core, spec: dict, tier: str) -> dict:
    """The compiles ``spec``'s build on ``tier`` needs (see the module docstring), as JSON job records."""
    from tkcc.kernels import compile_job as cj
    from tkcc.kernels.discovery import deferring
    from tkcc.runtime import candidates as cands

    cid = cands.candidate_id(spec, core.max_bytes)
    out = {"candidate": cid, "tier": tier, "jobs": [], "kept": False}
    have = core.candidates.get(cid)
    if have is not None and tier in have.forwards:
        return {**out, "loaded": True}
    why = why_not(core, spec)
    if why:
        return {**out, "note": why}
    target = None if core.device.type == "cuda" else core.cfg["compile_target"]
    cache = getattr(core, "kernel_cache", None)

    def cached(job, fn) -> bool:
        return cache is not None and cache.has(cj.cache_key(job, fn))

    jobs: dict[str, object] = {}
    cand = cands.Candidate(cid, "plan", dict(spec))
    work = os.path.join(core.work_dir, "discover")
    t0 = time.perf_counter()
    try:
        with deferring(lambda j: jobs.setdefault(j.id, j), target=target, skip=cached) as found:
            cands.build_for_tier(cand, tier, core.programs, work, core.max_bytes, list_kernels=True)
    except EngineError:
        raise
    except Exception as e:  # noqa: BLE001 - the build itself fails: load will say so, with the same error
        shutil.rmtree(os.path.join(work, f"{cid}-{tier}"), ignore_errors=True)
        return {**out, "note": f"the build failed while listing its kernels ({type(e).__name__}: {e})",
                "render_s": time.perf_counter() - t0}
    render_s = time.perf_counter() - t0
    out.update(jobs=[j.to_json() for j in jobs.values()], render_s=render_s, launches=found.launches,
               compiles=found.compiles, cached=found.skipped,
               phases_s=(cand.info.get(tier) or {}).get("phases_s"))
    built = cand.info.get(tier) or {}
    ran = found.launches - int(built.get("meta_launches") or 0)  # launches the passes made while they ran
    out["build_launches"] = ran
    if ran == 0 and have is None:
        cand.compile_s[tier] = render_s
        core.candidates[cid] = cand  # a real build: load finds it
        out["kept"] = True
    else:
        shutil.rmtree(os.path.join(work, f"{cid}-{tier}"), ignore_errors=True)
    return out
