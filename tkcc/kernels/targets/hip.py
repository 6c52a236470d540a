"""HIP C++ -> AMD GPU code object (gfx942 = MI300, gfx950 = MI355X), compiled ahead of time.

The toolchain is clang's HIP device compilation with no ROCm installed: the
kernels carry their own prelude (templates/cuda/prelude.cuh.jinja), so only
the compiler and an AMDGPU-capable lld are needed. Both come from the
``ziglang`` wheel on PyPI (clang/lld 22, which knows gfx950); a system
``clang++-19`` (Debian) is used when ziglang is absent, for gfx942 only.
Nothing here can run an AMD GPU: this produces and inspects code objects.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

from tkcc.errors import TkccError

ARCHS = ("gfx942", "gfx950")
_SYSTEM_CLANGS = ("clang++-22", "clang++-21", "clang++-20", "clang++-19", "clang++")


@lru_cache(maxsize=1)
def toolchain() -> tuple[list[str], dict, str]:
    """(clang command prefix, extra environment, description)."""
    try:
        import ziglang  # noqa: F401

        zig = Path(ziglang.__file__).parent / "zig"
        if zig.exists():
            bindir = Path(tempfile.mkdtemp(prefix="tkcc-lld-"))
            wrapper = bindir / "lld"
            # clang calls `lld -flavor gnu ...`; zig exposes lld as `zig ld.lld`
            wrapper.write_text(f'#!/bin/sh\nif [ "$1" = "-flavor" ]; then shift 2; fi\nexec "{zig}" ld.lld "$@"\n')
            wrapper.chmod(0o755)
            env = {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
            ver = subprocess.run([str(zig), "clang", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
            return [str(zig), "clang"], env, f"ziglang {ver}"
    except ImportError:
        pass
    for name in _SYSTEM_CLANGS:
        path = shutil.which(name)
        if path:
            ver = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
            return [path], {}, ver
    raise TkccError("HIP target needs a clang with the AMDGPU backend: pip install ziglang (clang 22) "
                    f"or a system clang ({', '.join(_SYSTEM_CLANGS)})")


def compile_hip(source: str, arch: str = "gfx942", opt: tuple[str, ...] = ("-O3",)) -> bytes:
    """Compile HIP C++ device code to an AMDGPU ELF code object (hsaco) for ``arch``."""
    if arch not in ARCHS:
        raise TkccError(f"unsupported AMD arch {arch!r}; tkcc compiles for {ARCHS}")
    cmd, env, desc = toolchain()
    with tempfile.TemporaryDirectory(prefix="tkcc-hip-") as d:
        src, out = Path(d) / "kernel.hip", Path(d) / f"kernel-{arch}.hsaco"
        src.write_text(source)
        args = [*cmd, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "--no-gpu-bundle-output",
                "-nogpulib", "-nogpuinc", "-std=c++17", *opt, "-o", str(out), str(src)]
        res = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **env})
        if res.returncode != 0 or not out.exists():
            raise TkccError(f"HIP compile for {arch} with {desc} failed:\n{res.stderr[-4000:]}")
        data = out.read_bytes()
    if data[:4] != b"\x7fELF":
        raise TkccError(f"HIP compile for {arch} produced no ELF code object")
    return data


# ELF e_flags machine field (EF_AMDGPU_MACH) -> processor, for checking what was built
_MACH = {0x4C: "gfx942", 0x4F: "gfx950"}


def code_object_arch(data: bytes) -> str:
    """The processor an AMDGPU code object was built for, read from its ELF header."""
    import struct

    if data[:4] != b"\x7fELF" or struct.unpack_from("<H", data, 18)[0] != 224:  # EM_AMDGPU
        raise TkccError("not an AMDGPU ELF code object")
    flags = struct.unpack_from("<I", data, 48)[0]
    return _MACH.get(flags & 0xFF, f"mach-0x{flags & 0xFF:x}")


def kernel_symbols(data: bytes) -> list[str]:
    """Names of the kernels (symbols ending in .kd are kernel descriptors) in a code object."""
    import re

    return sorted({m.decode() for m in re.findall(rb"([A-Za-z_][A-Za-z0-9_]*)\.kd\x00", data)})


if __name__ == "__main__":  # tiny manual check: python -m tkcc.kernels.targets.hip FILE ARCH
    print(code_object_arch(compile_hip(Path(sys.argv[1]).read_text(), sys.argv[2])))
