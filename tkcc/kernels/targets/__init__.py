"""Kernel targets beyond the Triton kernels: CUDA C++ (NVRTC), HIP C++ (AOT), NKI (Trainium).

Part of the kernel library (each family beside its PyTorch reference, in
``families``), so the decode ops (``tkcc.kernels.ops``) and the passes that
insert them consult it without importing codegen; codegen imports it from here.

``kernel(family, target, dtype, shape, variant)`` returns a callable with the
family reference's signature, so a pass or the search can choose the target
and the variant per shape; ``check_target`` turns a target the device cannot
run into a clear error.
"""
from __future__ import annotations

from typing import Callable

import torch

from tkcc.errors import PlanError, TkccError

# target -> (device types it runs on here, what is only compiled)
TARGETS: dict[str, dict] = {
    "torch": {"runs_on": ("cpu", "cuda"), "note": "the plain PyTorch reference"},
    "triton": {"runs_on": ("cuda", "cpu-interpreter"), "note": "Triton; AMD gfx942/gfx950 compiled ahead of time"},
    "cuda": {"runs_on": ("cuda",), "note": "CUDA C++ through NVRTC, launched through the driver API"},
    "hip": {"runs_on": (), "note": "HIP C++ compiled ahead of time for gfx942/gfx950; no AMD GPU to run it here"},
    "nki": {"runs_on": ("nki-sim",), "note": "NKI source; executed by tkcc's NumPy model of nki.language"},
}


def check_target(target: str, device: str | torch.device) -> None:
    if target not in TARGETS:
        raise TkccError(f"unknown codegen target {target!r}; targets: {sorted(TARGETS)}")
    dev = torch.device(device).type if not isinstance(device, str) or device not in ("nki-sim", "cpu-interpreter") \
        else device
    if dev not in TARGETS[target]["runs_on"]:
        raise TkccError(f"target {target!r} cannot run on device {dev!r} ({TARGETS[target]['note']}); "
                        f"it runs on: {', '.join(TARGETS[target]['runs_on']) or 'nothing here (compile only)'}")


# targets a decode op can be asked for (``tkcc.kernels.ops``): Triton runs everywhere (its kernel on CUDA or
# under the interpreter, the eager reference elsewhere); CUDA runs only on an NVIDIA GPU
OP_TARGETS = ("triton", "cuda")


def variant_params(family: str, prefix: str = "cuda_", rename: dict[str, str] | None = None) -> dict[str, list]:
    """The CUDA variant space of ``family`` as pass parameters (``{prefix + name: values}``, default first)."""
    from tkcc.kernels.targets.cuda import VARIANTS

    rename = rename or {}
    return {prefix + rename.get(k, k): list(v) for k, v in VARIANTS[family].items()}


def program_device(program) -> str:
    """The device type a Program runs on (its capture meta, else its model's first parameter)."""
    dev = (getattr(program, "meta", None) or {}).get("device")
    if dev is None:
        model = getattr(program, "model", None)
        p = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
        dev = p.device if p is not None else "cpu"
    return torch.device(dev).type


def check_pass_target(pass_name: str, target: str, program) -> None:
    """PlanError when pass ``pass_name`` is asked for a kernel target the Program's device cannot run."""
    if target not in OP_TARGETS:
        raise PlanError(f"pass {pass_name!r}: unknown kernel target {target!r}; decode ops run {list(OP_TARGETS)}")
    if target == "triton":
        return  # the ops take the eager reference wherever Triton cannot run
    try:
        check_target(target, program_device(program))
    except TkccError as e:
        raise PlanError(f"pass {pass_name!r}: {e}") from None


def kernel(family: str, target: str, dtype: torch.dtype, shape: dict, variant: dict | None = None,
           device: str | torch.device = "cuda") -> Callable:
    from tkcc.kernels.targets.families import FAMILIES

    if family not in FAMILIES:
        raise TkccError(f"unknown kernel family {family!r}; families: {sorted(FAMILIES)}")
    if target == "torch":
        return FAMILIES[family].reference
    if target == "nki":
        from tkcc.kernels.targets.nki import build_simulated

        return build_simulated(family, shape)
    check_target(target, device)
    if target == "cuda":
        from tkcc.kernels.targets import cuda

        return cuda.build(family, dtype, shape, variant)
    if target == "triton":
        from tkcc.kernels.targets.triton_families import build

        return build(family, dtype, shape, variant)
    raise TkccError(f"target {target!r} has no runnable kernels")
