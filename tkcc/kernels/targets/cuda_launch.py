"""Load a cubin and launch its kernels through the CUDA driver API, on PyTorch's current stream.

Launching on the current stream is what makes these kernels capturable in a
CUDA graph like any PyTorch op. Every driver call's result is checked.
"""
from __future__ import annotations

import ctypes

import torch

from tkcc.errors import TkccError


def _ok(res, what: str):
    from cuda.bindings import driver

    err = res[0] if isinstance(res, tuple) else res
    if err != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(err)[1]
        raise TkccError(f"CUDA driver call {what} failed: {name.decode() if name else err}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


class CudaModule:
    """A loaded cubin. Kept alive as long as any of its functions may be launched."""

    def __init__(self, cubin: bytes, device: torch.device | int | None = None):
        from cuda.bindings import driver

        if not torch.cuda.is_available():
            raise TkccError("the CUDA target runs only on an NVIDIA GPU; none is available here")
        torch.cuda.init()
        dev = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index or 0)
        with torch.cuda.device(dev):
            torch.empty(1, device=dev)  # make the primary context current on this thread
            self._cubin = cubin  # the driver may read it lazily
            self.module = _ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.device = dev
        self._funcs: dict[str, object] = {}

    def function(self, name: str) -> "CudaFunction":
        from cuda.bindings import driver

        if name not in self._funcs:
            self._funcs[name] = _ok(driver.cuModuleGetFunction(self.module, name.encode()), f"get {name}")
        return CudaFunction(self, name, self._funcs[name])


class CudaFunction:
    def __init__(self, module: CudaModule, name: str, handle):
        self.module, self.name, self.handle = module, name, handle

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], *args, shared: int = 0) -> None:
        from cuda.bindings import driver

        vals, types = [], []
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.device.type != "cuda":
                    raise TkccError(f"{self.name}: argument on {a.device}, expected a CUDA tensor")
                vals.append(a.data_ptr())
                types.append(ctypes.c_void_p)
            elif isinstance(a, float):
                vals.append(a)
                types.append(ctypes.c_float)
            elif isinstance(a, int):
                vals.append(a)
                types.append(ctypes.c_int)
            else:
                raise TkccError(f"{self.name}: cannot pass {type(a).__name__} to a kernel")
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        stream = torch.cuda.current_stream(self.module.device).cuda_stream
        _ok(driver.cuLaunchKernel(self.handle, *g, *b, shared, stream, (tuple(vals), tuple(types)), 0),
            f"launch {self.name}")
