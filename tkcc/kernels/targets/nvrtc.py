"""CUDA C++ -> cubin through NVRTC (cuda-python), on a machine with or without a GPU."""
from __future__ import annotations

import hashlib
from functools import lru_cache

from tkcc.errors import TkccError


def _check(res, what: str, prog=None):
    from cuda.bindings import nvrtc

    err = res[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = ""
        if prog is not None:
            _, n = nvrtc.nvrtcGetProgramLogSize(prog)
            buf = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, buf)
            log = buf.decode(errors="replace")
        raise TkccError(f"NVRTC {what} failed: {nvrtc.nvrtcGetErrorString(err)[1].decode()}\n{log}")
    return res[1:] if len(res) > 2 else (res[1] if len(res) == 2 else None)


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    return tuple(_check(nvrtc.nvrtcVersion(), "version"))


@lru_cache(maxsize=256)
def compile_cuda(source: str, arch: str = "sm_90", name: str = "kernel.cu", opt: tuple[str, ...] = ()) -> bytes:
    """Compile to a cubin for ``arch`` (e.g. sm_90). Errors carry NVRTC's log."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise TkccError("CUDA target needs cuda-python (pip install 'tkcc[cuda]')") from e
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "create")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--use_fast_math", b"-default-device",
            *[o.encode() for o in opt]]
    try:
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _check(err, f"compile of {name} for {arch}", prog)
        n = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        buf = b" " * n
        _check(nvrtc.nvrtcGetCUBIN(prog, buf), "get cubin")
        return buf
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def source_key(source: str, arch: str) -> str:
    return hashlib.sha256(f"{arch}\0{source}".encode()).hexdigest()[:16]
