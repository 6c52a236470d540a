"""Ahead-of-time compilation of Triton kernels for GPUs this machine does not have.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(...))``
runs Triton's whole pipeline (TTIR -> TTGIR -> LLVM -> PTX/AMDGCN ->
cubin/hsaco) with the toolchain bundled in the triton wheel (ptxas, ld.lld):
no GPU and no driver needed. It cannot run in a process where the Triton
interpreter is on (there ``@triton.jit`` gives an interpreter object, not a
compilable function), so such a process compiles in a child process
(``python -m tkcc.codegen.aot``) with the interpreter off.
"""
from __future__ import annotations

import base64
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tkcc.errors import ArtifactError

# name -> (backend, arch, warp size, binary kind)
AOT_TARGETS = {
    "sm_90": ("cuda", 90, 32, "cubin"),
    "sm_80": ("cuda", 80, 32, "cubin"),
    "gfx942": ("hip", "gfx942", 64, "hsaco"),
    "gfx90a": ("hip", "gfx90a", 64, "hsaco"),
}


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def _gpu_target(target):
    from triton.backends.compiler import GPUTarget

    if isinstance(target, GPUTarget):
        return target, ("cubin" if target.backend == "cuda" else "hsaco")
    if target not in AOT_TARGETS:
        raise ArtifactError(f"unknown AOT target {target!r}; known: {', '.join(sorted(AOT_TARGETS))}")
    backend, arch, warp, kind = AOT_TARGETS[target]
    return GPUTarget(backend, arch, warp), kind


def _kernel_from_source(source: str, kernel_name: str | None):
    from tkcc.kernels.rowwise import load_source

    mod = load_source("aot", source)
    if kernel_name is None:
        from triton.runtime.jit import JITFunction

        found = [v for v in vars(mod).values() if isinstance(v, JITFunction) and not v.__name__.startswith("_")]
        if len(found) != 1:
            raise ArtifactError(f"source defines {len(found)} public @triton.jit kernels; pass kernel_name")
        return found[0]
    fn = getattr(mod, kernel_name, None)
    if fn is None:
        raise ArtifactError(f"source has no kernel {kernel_name!r}")
    return fn


def _compile_here(source: str, kernel_name: str | None, signature: dict, target, num_warps: int = 4,
                  exact: bool = False) -> bytes:
    import triton
    from triton.compiler import ASTSource

    fn = _kernel_from_source(source, kernel_name)
    gpu, kind = _gpu_target(target)
    sig, consts = {}, {}
    for name in fn.arg_names:
        if name not in signature:
            raise ArtifactError(f"signature has no entry for kernel argument {name!r} of {fn.__name__}")
        v = signature[name]
        if isinstance(v, str) and v != "constexpr":
            sig[name] = v
        else:
            sig[name] = "constexpr"
            consts[name] = v
    opts = {"num_warps": num_warps}
    if exact:
        opts["enable_fp_fusion"] = False
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=gpu, options=opts)
    except Exception as exc:
        raise ArtifactError(f"AOT compile of {fn.__name__} for {target} failed: {type(exc).__name__}: {exc}") from exc
    blob = compiled.asm.get(kind)
    if not blob:
        raise ArtifactError(f"AOT compile of {fn.__name__} for {target} produced no {kind}")
    return bytes(blob)


def compile_many(requests: list[dict]) -> list[bytes]:
    """Compile each request ({source, kernel_name, signature, target, num_warps, exact}); a child process
    does it when the interpreter is on here."""
    if not requests:
        return []
    if not interpreter_on():
        return [_compile_here(**r) for r in requests]
    with tempfile.TemporaryDirectory(prefix="tkcc-aot-") as d:
        req = Path(d) / "requests.json"
        req.write_text(json.dumps(requests))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run([sys.executable, "-m", "tkcc.codegen.aot", str(req)], env=env, capture_output=True,
                              text=True, timeout=600)
        if proc.returncode != 0:
            raise ArtifactError(f"AOT compile in a child process failed:\n{proc.stderr[-4000:]}")
        out = json.loads((Path(d) / "binaries.json").read_text())
    return [base64.b64decode(b) for b in out]


def compile_kernel(src_or_fn, signature: dict, target, *, kernel_name: str | None = None, num_warps: int = 4,
                   exact: bool = False) -> bytes:
    """Compile one Triton kernel for ``target`` ("sm_90" -> cubin, "gfx942" -> hsaco, or a GPUTarget).

    ``src_or_fn``: module source text defining the kernel, or the ``@triton.jit`` function itself.
    ``signature``: argument name -> Triton type ("*fp32", "i32", ...) or, for a constexpr, its value.
    """
    if isinstance(src_or_fn, str):
        source = src_or_fn
    else:
        fn = getattr(src_or_fn, "fn", src_or_fn)
        source = Path(inspect.getsourcefile(fn)).read_text()
        kernel_name = kernel_name or fn.__name__
    if not isinstance(target, str):
        if interpreter_on():
            raise ArtifactError("a GPUTarget object cannot cross to the child process; pass 'sm_90' or 'gfx942'")
        return _compile_here(source, kernel_name, signature, target, num_warps, exact)
    return compile_many([{"source": source, "kernel_name": kernel_name, "signature": signature, "target": target,
                          "num_warps": num_warps, "exact": exact}])[0]


def _main(argv: list[str]) -> int:
    req = Path(argv[0])
    requests = json.loads(req.read_text())
    blobs = [base64.b64encode(_compile_here(**r)).decode() for r in requests]
    (req.parent / "binaries.json").write_text(json.dumps(blobs))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
