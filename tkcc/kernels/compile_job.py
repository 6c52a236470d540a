"""One Triton compile as data (``KernelJob``), and the compile itself, runnable in any process.

Why data: the engine finds out which kernel specialisations a candidate will
launch (``tkcc.kernels.discovery``) without compiling them; the compiles then
run in a pool of worker processes, or as Ray tasks on CPU machines, and land
in the kernel cache under exactly the key the engine's own JIT looks up later.

A job holds what Triton's JIT would hand its compiler: the kernel module's
source text (Triton reads a kernel's source from its file, and the line it
starts on is part of its hash, so the whole file travels), the kernel's name,
Triton's own *specialization data* (signature, constexprs, attributes such as
pointer alignment, and every compile option, as ``JITFunction`` serialises it
for ``preload``) and the target (``cuda:90:32``). The compile rebuilds the
``ASTSource`` from it and calls ``triton.compile``, which is the JIT's compile:
same source, same specialisation, same target and options give the same cache
key (``triton_key()``, the compiler's version, is part of it), so the engine's
JIT finds the result in the cache and only loads it.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

from tkcc.errors import TkccError


class KernelCompileError(TkccError):
    """A kernel did not compile; the message is the compiler's, with the kernel named."""


@dataclass(frozen=True)
class KernelJob:
    source: str   # the kernel module's whole source text
    kernel: str   # the @triton.jit function's name in it
    spec: str     # Triton's specialization data (JSON), as JITFunction serialises it
    target: str   # "cuda:90:32", "hip:gfx942:64": backend, architecture, warp size
    name: str = ""  # module.qualname where the engine saw it, for messages

    @property
    def id(self) -> str:
        """What determines the compile: jobs with the same id are one compile."""
        h = hashlib.sha256()
        for part in (self.source, self.kernel, self.spec, self.target):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "KernelJob":
        try:
            return cls(**{k: d[k] for k in ("source", "kernel", "spec", "target")}, name=str(d.get("name", "")))
        except (KeyError, TypeError) as e:
            raise TkccError(f"kernel job: malformed record ({e}); expected source, kernel, spec, target") from None

    def describe(self) -> str:
        sig = json.loads(self.spec).get("signature", {})
        return f"{self.name or self.kernel} for {self.target} ({', '.join(f'{k}: {v}' for k, v in sig.items())})"


def target_name(target) -> str:
    """A GPUTarget as the string a job carries."""
    return f"{target.backend}:{target.arch}:{target.warp_size}"


def parse_target(name: str):
    from triton.backends.compiler import GPUTarget

    try:
        backend, arch, warp = name.split(":")
        return GPUTarget(backend, int(arch) if arch.isdigit() else arch, int(warp))
    except ValueError:
        raise TkccError(f"kernel target {name!r}: expected BACKEND:ARCH:WARP, e.g. cuda:90:32") from None


def rebuild(job: KernelJob, fn):
    """(ASTSource, GPUTarget, options dict) of ``job`` for the @triton.jit function ``fn``: what the JIT passes
    to ``triton.compile`` (the deserialisation is JITFunction.preload's)."""
    import triton.language as tl
    from triton.compiler import ASTSource, make_backend

    d = json.loads(job.spec)
    constexprs = {}
    for key, value in zip(map(tuple, d["constant_keys"]), d["constant_vals"]):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            value = tl.dtype(value)
        elif isinstance(value, dict) and "constexpr" in value:
            value = tl.constexpr(value["constexpr"])
        constexprs[key] = value
    attrs = dict(zip(map(tuple, d["attrs_keys"]), d["attrs_vals"]))
    signature = {k: _tuples(v) for k, v in d["signature"].items()}
    options = {k: tuple(_tuples(x) for x in v) if isinstance(v, list) else v for k, v in d["options"].items()}
    target = parse_target(job.target)
    options = make_backend(target).parse_options(options).__dict__
    return ASTSource(fn, signature, constexprs, attrs), target, options


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def cache_key(job: KernelJob, fn) -> str:
    """The name of the folder Triton's cache keeps this compile in (base32 of the hash of its key)."""
    from triton.compiler import make_backend
    from triton.runtime.cache import _base32, get_cache_key
    from triton.runtime.jit import get_cache_invalidating_env_vars

    src, target, options = rebuild(job, fn)
    backend = make_backend(target)
    key = get_cache_key(src, backend, backend.parse_options(options), get_cache_invalidating_env_vars())
    return _base32(hashlib.sha256(key.encode()).hexdigest())


def load_kernel(job: KernelJob):
    """The job's @triton.jit function, from its source (written once to a file named by its hash)."""
    from tkcc.kernels.render import import_source

    mod = import_source("tkcc_job", job.source)
    fn = getattr(mod, job.kernel, None)
    if fn is None or not hasattr(fn, "arg_names"):
        raise KernelCompileError(f"{job.name or job.kernel}: its source defines no @triton.jit {job.kernel!r}")
    return fn


def compile_job(job: KernelJob, return_files: bool = False) -> dict:
    """Compile ``job`` into this process's Triton cache (``TRITON_CACHE_DIR``); KernelCompileError on failure.

    Returns {"entry": cache folder name, "seconds", "cached": found there already, "files": {name: bytes}
    (with ``return_files``: the entry's files, for a cache on another machine)}."""
    import triton
    from triton.runtime.cache import get_cache_manager

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise KernelCompileError("compile_job needs TRITON_INTERPRET unset (an interpreted kernel cannot compile)")
    t0 = time.perf_counter()
    fn = load_kernel(job)
    src, target, options = rebuild(job, fn)
    hit = []
    from triton import knobs

    listener, knobs.compilation.listener = knobs.compilation.listener, (lambda **kw: hit.append(kw["cache_hit"]))
    try:
        compiled = triton.compile(src, target=target, options=options)
    except Exception as e:  # the compiler's own message, named
        raise KernelCompileError(f"{job.describe()}: {type(e).__name__}: {_first_lines(e)}") from None
    finally:
        knobs.compilation.listener = listener
    entry = get_cache_manager(compiled.hash)
    out = {"entry": os.path.basename(entry.cache_dir), "seconds": time.perf_counter() - t0,
           "cached": bool(hit and hit[0])}
    if return_files:
        out["files"] = entry_files(entry.cache_dir)
    return out


def entry_files(folder: str) -> dict[str, bytes]:
    """The files of one cache entry (no locks, no temporary folders)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and name != "lock":
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def _first_lines(e: Exception, n: int = 40) -> str:
    lines = str(e).strip().splitlines()
    return "\n".join(lines[:n]) + (f"\n... ({len(lines) - n} more lines)" if len(lines) > n else "")
