"""A user pass that tunes a Triton kernel while it runs, as ``lowered_decode`` does on a GPU.

``apply`` launches ``scale_kernel`` once per candidate block size (on a GPU, or wherever
``tkcc.kernels.discovery`` lists compiles for a GPU target) and leaves the graph alone. ``broken=True``
launches a kernel the compiler refuses (a name it cannot resolve): a candidate whose kernel does not compile.
"""
import torch
import triton
import triton.language as tl

from tkcc.kernels.discovery import discovering
from tkcc.passes import RewriteInfo, register
from tkcc.passes.base import Pass


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2.0, mask=m)


@triton.jit
def broken_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) * not_defined_anywhere)


@register
class TunedTestPass(Pass):
    name = "test-tuned"
    version = "1"
    exact = True
    description = "times a Triton kernel over block sizes at build time; the graph is unchanged"
    params = {"blocks": [2, 3, 4, 1], "broken": [False, True]}

    def apply(self, program, blocks=2, broken=False):
        info = RewriteInfo()
        dev = "cuda" if torch.cuda.is_available() else "meta"
        if torch.cuda.is_available() or discovering():
            x = torch.empty(4096, device=dev)
            kernel = broken_kernel if broken else scale_kernel
            for b in (128, 256, 512, 1024)[:blocks]:
                kernel[(4096 // b,)](x, x, 4096, BLOCK=b)
            info.notes.append(f"tuned {blocks} block sizes")
        return program, info
