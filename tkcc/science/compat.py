"""Import helpers for the scientific libraries, with one narrow fix for torchvision on CPU-only torch.

timm imports torchvision. PyPI's torchvision wheels are built against CUDA
torch; beside a CPU-only torch their C++ extension cannot load, and
torchvision 0.28 then fails at import because ``_meta_registrations`` registers
a fake kernel for ``torchvision::nms`` and ``torchvision::qnms`` without
checking that the extension defined them. When (and only when) that happens,
``import_timm`` declares those two operator schemas (no kernels: calling
them still raises) so the pure-Python part of torchvision imports. ConvNeXt
uses no torchvision operator. With a torchvision whose extension loads (the
GPU image) nothing is touched.

Do not install that torchvision into a CPU environment shared with
transformers: its failed import also breaks transformers' model imports
(``LlamaForCausalLM`` becomes unimportable). The CPU set-up therefore leaves
torchvision and timm out, and ConvNeXt is tested on the GPU only.
"""
from __future__ import annotations

import importlib

import torch

_TV_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_tv_lib = None


def _declare_torchvision_nms() -> None:
    global _tv_lib
    if _tv_lib is not None:
        return
    _tv_lib = torch.library.Library("torchvision", "FRAGMENT")  # noqa: TOR901 - kept alive on purpose
    for name, schema in _TV_SCHEMAS.items():
        if not hasattr(torch.ops.torchvision, name) or not _has_op(name):
            _tv_lib.define(schema)


def _has_op(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


def import_timm():
    """``import timm``, working around torchvision's unloadable extension on CPU-only torch."""
    try:
        return importlib.import_module("timm")
    except RuntimeError as e:
        if "torchvision::nms" not in str(e) and "torchvision::qnms" not in str(e):
            raise
    import sys

    for mod in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.") or m == "timm"
                or m.startswith("timm.")]:
        del sys.modules[mod]
    _declare_torchvision_nms()
    return importlib.import_module("timm")


def missing_library(name: str) -> str | None:
    """None if the library imports, else a message saying how to install it."""
    try:
        if name == "timm":
            import_timm()
        else:
            importlib.import_module(name)
        return None
    except Exception as e:  # noqa: BLE001 - any import failure is reported, not raised
        pip = {"torch_geometric": "torch-geometric"}.get(name, name)
        if name == "timm" and "torchvision" in str(e):
            return (f"timm is not importable ({type(e).__name__}: {e}): timm needs torchvision, and PyPI's "
                    "torchvision (built for CUDA torch) beside a CPU-only torch also breaks transformers' model "
                    "imports, so the CPU set-up leaves it out; ConvNeXt is tested on the GPU")
        return f"{name} is not importable ({type(e).__name__}: {e}); install it with `pip install {pip}` " \
               "(see scripts/setup.sh, extra 'science')"
