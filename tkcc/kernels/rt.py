"""Runtime support that generated code imports: kernel launch with a reference fallback, attribute lookup.

Why a separate, tiny module: every artifact carries a verbatim copy of this
file (as ``_rt.py``), so generated code runs with torch and triton only; it
imports nothing else from tkcc. Inside the compiler process the same file is
imported as ``tkcc.kernels.rt``: it sits in the kernel library because the
fused kernels a pass builds (``tkcc.kernels.rowwise``) launch through it in
process, before any artifact exists.

A fused kernel never gives a wrong answer to keep its speed: whenever it cannot
run correctly here (CPU without the Triton interpreter, bfloat16 under the
interpreter, a shape the kernel was not generated for, a row too long to keep
in registers, ...) the launcher runs the kernel's reference (the original aten
ops) and logs why, once per kernel and reason.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("tkcc.codegen")
_WARNED: set = set()

# Longest row a reduction kernel keeps in registers (elements, rounded up to a power of two).
MAX_REDUCE_COLS = 32768
# Column tile of kernels without a reduction (they tile rows and columns).
MAX_POINTWISE_COLS = 1024
_INT32_LIMIT = 2**31 - 1
_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8}


def note_fallback(name: str, reason: str) -> None:
    """Log that the reference ran instead of the kernel: a warning once per reason, then debug once per kernel."""
    if (name, reason) in _WARNED:
        return
    _WARNED.add((name, reason))
    if reason not in _WARNED:
        _WARNED.add(reason)
        # CPU without the interpreter is the expected case in a compiler process: INFO, not a warning
        expected = reason.startswith(("CPU tensors and the Triton interpreter is off", "TKCC_KERNELS"))
        log.log(logging.INFO if expected else logging.WARNING,
                "%s: ran the reference ops instead of the Triton kernel: %s (other kernels falling back for this "
                "reason are logged at DEBUG)", name, reason)
    else:
        log.debug("%s: ran the reference ops instead of the Triton kernel: %s", name, reason)


def is_interpreted(kernel) -> bool:
    """Was this kernel defined under TRITON_INTERPRET=1 (so it runs on CPU tensors)?"""
    return type(kernel).__name__ == "InterpretedFunction"


def resolve(root, qualname: str):
    """``root.a.b.0.c`` for ``qualname == "a.b.0.c"`` (ModuleList children are named by digits)."""
    obj = root
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class RowwiseLauncher:
    """Launch one generated row-wise kernel, or run its reference when the kernel cannot run here.

    The kernel iterates over the broadcast shape S of its inputs as rows
    (all dims but the last) by columns (the last dim). ``spec`` comes from the
    code generator:

    ndim:          rank of S the kernel was generated for.
    outputs:       per output: {"dtype": "torch.bfloat16", "dims": [k or None, ...]}, where
                   k is the index of the S dim the output spans and None a size-1 dim.
    reduction:     whether a row reduction (mean/sum/amax/softmax) is fused (rows are then
                   never split across programs).
    exact:         compile without FMA contraction (rounding-faithful variant).
    block_elems:   target elements per program; num_warps: warps per program.
    """

    def __init__(self, name: str, kernel, reference, spec: dict):
        self.name, self.kernel, self.reference, self.spec = name, kernel, reference, spec
        self.out_dtypes = [getattr(torch, o["dtype"].split(".")[-1]) for o in spec["outputs"]]
        self.interpreted = is_interpreted(kernel)
        self.stats = {"kernel": 0, "reference": 0}
        self._decisions: dict = {}  # (shape, stride, dtype, device) per arg -> fallback reason or launch plan

    def __call__(self, *args):
        try:
            key = tuple((a.shape, a.stride(), a.dtype, a.device) for a in args)
        except AttributeError:
            key = None
        mode = os.environ.get("TKCC_KERNELS", "auto")
        plan = self._decisions.get(key) if key is not None and mode == "auto" else None
        if plan is None:
            reason = self.why_not(args)
            plan = reason if reason is not None else self._plan(args)
            if key is not None and mode == "auto":
                self._decisions[key] = plan
        if isinstance(plan, str):
            note_fallback(self.name, plan)
            self.stats["reference"] += 1
            return tuple(self.reference(*args))
        self.stats["kernel"] += 1
        return self._launch(args, plan)

    # ---- when the kernel cannot run: say why --------------------------------------------
    def why_not(self, args) -> str | None:
        mode = os.environ.get("TKCC_KERNELS", "auto")
        if mode == "reference":
            return "TKCC_KERNELS=reference"
        if not all(isinstance(a, torch.Tensor) for a in args):
            return "a non-tensor input"
        devices = {a.device for a in args}
        if len(devices) != 1:
            return f"inputs on several devices {sorted(map(str, devices))}"
        dev = devices.pop()
        dtypes = {a.dtype for a in args} | set(self.out_dtypes)
        if not dtypes <= _DTYPES:
            return f"dtype {sorted(map(str, dtypes - _DTYPES))} not supported by the kernel"
        if dev.type == "cpu":
            if not self.interpreted:
                return "CPU tensors and the Triton interpreter is off (set TRITON_INTERPRET=1 before importing triton)"
            if torch.bfloat16 in dtypes:
                return "bfloat16 arithmetic is wrong under the Triton interpreter"
        elif dev.type == "cuda":
            if self.interpreted:
                return "kernel was imported under TRITON_INTERPRET=1; CUDA tensors need a compiled kernel"
        else:
            return f"no Triton backend for device {dev.type!r}"
        try:
            shape = torch.broadcast_shapes(*(a.shape for a in args))
        except RuntimeError as exc:
            return f"inputs do not broadcast: {exc}"
        if len(shape) != self.spec["ndim"] or self.spec["ndim"] == 0:
            return f"broadcast rank {len(shape)} differs from the rank {self.spec['ndim']} the kernel was generated for"
        numel = 1
        for s in shape:
            numel *= s
        if numel == 0:
            return "empty tensors"
        if numel > _INT32_LIMIT or any(a.numel() > _INT32_LIMIT for a in args):
            return "more than 2**31 elements"
        if self.spec["reduction"] and _next_pow2(shape[-1]) > MAX_REDUCE_COLS:
            return f"row of {shape[-1]} elements is longer than a fused reduction keeps ({MAX_REDUCE_COLS})"
        return None

    # ---- the fast path ------------------------------------------------------------------
    def _plan(self, args) -> tuple:
        """Everything about a launch that depends only on shapes, strides, dtypes and device (cached)."""
        shape = torch.broadcast_shapes(*(a.shape for a in args))
        n_cols = shape[-1]
        n_rows = 1
        for s in shape[:-1]:
            n_rows *= s
        out_shapes = [tuple(1 if k is None else shape[k] for k in o["dims"]) for o in self.spec["outputs"]]
        strides = [s for a in args for s in a.expand(shape).stride()]
        for osh in out_shapes:
            strides += list(torch.empty(osh, device="meta").expand(shape).stride())
        cap = MAX_REDUCE_COLS if self.spec["reduction"] else MAX_POINTWISE_COLS
        block_c = min(_next_pow2(n_cols), cap)
        block_r = max(1, min(_next_pow2(n_rows), self.spec["block_elems"] // block_c))
        grid = ((n_rows + block_r - 1) // block_r, (n_cols + block_c - 1) // block_c)
        opts = {"num_warps": self.spec["num_warps"], "BLOCK_R": block_r, "BLOCK_C": block_c}
        if self.spec["exact"] and not self.interpreted:
            opts["enable_fp_fusion"] = False
        ints = [n_rows, n_cols, *shape[:-1], *strides]
        return out_shapes, grid, ints, opts

    def _launch(self, args, plan):
        out_shapes, grid, ints, opts = plan
        dev = args[0].device
        outs = [torch.empty(osh, dtype=dt, device=dev) for osh, dt in zip(out_shapes, self.out_dtypes)]
        if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev.index):
                self.kernel[grid](*args, *outs, *ints, **opts)
        else:
            self.kernel[grid](*args, *outs, *ints, **opts)
        return tuple(outs)

    def launch(self, args):
        """Launch the kernel on ``args`` (no fallback checks: see ``__call__``)."""
        return self._launch(args, self._plan(args))

    def launch_config(self, shapes, dtypes) -> dict:
        """Signature and constants of one launch, for ahead-of-time compilation (no tensors needed)."""
        shape = torch.broadcast_shapes(*shapes)
        n_cols = shape[-1]
        n_rows = 1
        for s in shape[:-1]:
            n_rows *= s
        cap = MAX_REDUCE_COLS if self.spec["reduction"] else MAX_POINTWISE_COLS
        block_c = min(_next_pow2(n_cols), cap)
        block_r = max(1, min(_next_pow2(n_rows), self.spec["block_elems"] // block_c))
        names = self.spec["arg_names"]
        sig = {}
        ptr_dtypes = list(dtypes) + [str(d) for d in self.out_dtypes]
        n_ptr = len(ptr_dtypes)
        for i, n in enumerate(names):
            sig[n] = "*" + _TRITON_TYPE[ptr_dtypes[i].split(".")[-1]] if i < n_ptr else "i32"
        sig["BLOCK_R"], sig["BLOCK_C"] = block_r, block_c
        return {"signature": sig, "num_warps": self.spec["num_warps"], "exact": self.spec["exact"]}


_TRITON_TYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "bool": "i1", "int8": "i8",
                "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8"}
