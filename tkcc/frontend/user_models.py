"""``--model`` as a user gives it: a built-in name, a local Hugging Face directory, or ``module:factory``.

- a built-in name (``tkcc.frontend.models``): seeded random weights;
- a directory with a ``config.json`` and weights (``*.safetensors`` or
  ``pytorch_model*.bin``), as ``save_pretrained`` writes it: loaded with
  ``AutoModelForCausalLM.from_pretrained(..., local_files_only=True)``, so
  nothing is downloaded;
- ``package.module:factory`` or ``path/to/file.py:factory``: a function that
  returns the ``nn.Module`` (called with ``dtype=`` and ``device=`` when it
  takes them).

Each failure names the model argument and the cause, before anything is captured.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from pathlib import Path

import torch

from tkcc.errors import TkccError

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


def kind_of(spec: str) -> str:
    """'builtin', 'hf_dir' or 'factory' (a clear error for anything else)."""
    from tkcc.frontend.models import REGISTRY

    if spec in REGISTRY:
        return "builtin"
    if os.path.isdir(spec):
        return "hf_dir"
    if ":" in spec and not os.path.exists(spec):
        return "factory"
    raise TkccError(f"unknown model {spec!r}: not a built-in model ({', '.join(sorted(REGISTRY))}), not a directory, "
                    "and not module:factory")


def build_user_model(spec: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """The nn.Module ``spec`` names, on ``device`` in ``dtype``, in eval mode."""
    kind = kind_of(spec)
    if kind == "builtin":
        from tkcc.frontend.models import build_model

        return build_model(spec, dtype=dtype, device=device)
    model = _from_dir(spec, dtype) if kind == "hf_dir" else _from_factory(spec, dtype, device)
    model = model.to(device=device).eval()
    model.requires_grad_(False)
    return model


def check_hf_dir(path: str) -> None:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise TkccError(f"--model {path}: the directory has no config.json (save the model with save_pretrained)")
    if not any(any(p.glob(g)) for g in WEIGHT_GLOBS):
        raise TkccError(f"--model {path}: the directory has no weights ({' or '.join(WEIGHT_GLOBS)})")


def _from_dir(path: str, dtype) -> torch.nn.Module:
    check_hf_dir(path)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - the loader's own message, with the path
        raise TkccError(f"--model {path}: transformers could not load it: {type(e).__name__}: {e}") from None
    model.tkcc_name = Path(path).resolve().name
    return model


def _from_factory(spec: str, dtype, device) -> torch.nn.Module:
    where, _, func = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise TkccError(f"--model {spec}: no file {where}")
            ms = importlib.util.spec_from_file_location(f"tkcc_user_model_{abs(hash(where))}", where)
            mod = importlib.util.module_from_spec(ms)
            ms.loader.exec_module(mod)
        else:
            mod = importlib.import_module(where)
    except TkccError:
        raise
    except Exception as e:  # noqa: BLE001 - an import that fails is bad input
        raise TkccError(f"--model {spec}: {where} does not import: {type(e).__name__}: {e}") from None
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise TkccError(f"--model {spec}: {where} has no function {func!r}")
    params = inspect.signature(fn).parameters
    kw = {k: v for k, v in (("dtype", dtype), ("device", device)) if k in params}
    try:
        model = fn(**kw)
    except Exception as e:  # noqa: BLE001
        raise TkccError(f"--model {spec}: {func}() raised {type(e).__name__}: {e}") from None
    if not isinstance(model, torch.nn.Module):
        raise TkccError(f"--model {spec}: {func}() returned a {type(model).__name__}, not a torch.nn.Module")
    if not hasattr(model, "tkcc_name"):
        model.tkcc_name = spec
    return model.to(dtype=dtype) if any(p.is_floating_point() for p in model.parameters()) else model
