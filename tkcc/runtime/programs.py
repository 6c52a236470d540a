"""What the engine serves: the model's Program and its two tiers, and checks of the device it runs on.

A model is a built-in name (``tkcc.frontend.models``), a local Hugging Face
directory or ``module:factory`` returning the ``nn.Module``
(``tkcc.frontend.user_models``), each captured here; or
``path/to/file.py:factory``, a function
``factory(dtype=, device=, max_cache_len=, batch=) -> Program`` for any
model the frontend can capture (a scientific model, a plain module).

Tiers: ``fast`` is the first k repeated blocks (default a fifth, at least 1),
``slow`` the whole model; both share the resident weights.
"""
from __future__ import annotations

import importlib.util
import os

from tkcc.errors import EngineError, TkccError

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
TIERS = ("fast", "slow")


def parse_dtype(name: str):
    import torch

    key = DTYPES.get(str(name).replace("torch.", ""))
    if key is None:
        raise EngineError(f"unknown dtype {name!r}; use one of {sorted(set(DTYPES))}")
    return getattr(torch, key)


def check_device(device: str) -> str:
    """The canonical device string, or an EngineError saying why it is not usable here."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise EngineError(f"device {device!r} is not a valid torch device ({e})") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError(f"device {device!r} requested but this machine has no CUDA device")
        n = torch.cuda.device_count()
        idx = 0 if dev.index is None else dev.index
        if idx >= n:
            raise EngineError(f"device {device!r} is not there: this machine has {n} CUDA device(s) "
                              f"(cuda:0..cuda:{n - 1})")
        return f"cuda:{idx}"
    raise EngineError(f"device {device!r}: the engine runs on 'cpu' or 'cuda[:N]', not {dev.type!r}")


def check_model_name(model: str) -> None:
    """Fail fast (before a worker starts) on a model that cannot exist."""
    if _is_factory(model):
        path = model.rsplit(":", 1)[0]
        if not os.path.isfile(path):
            raise EngineError(f"model factory file {path!r} does not exist")
        return
    from tkcc.frontend.user_models import check_hf_dir, kind_of

    try:
        if kind_of(model) == "hf_dir":
            check_hf_dir(model)
    except TkccError as e:
        raise EngineError(str(e)) from None


def _is_factory(model: str) -> bool:
    return ":" in model and model.rsplit(":", 1)[0].endswith(".py")


def load_program(model: str, dtype, device: str, max_cache_len: int | None, batch: int):
    """Build/capture the model once; returns the whole-model Program."""
    if _is_factory(model):
        path, func = model.rsplit(":", 1)
        spec = importlib.util.spec_from_file_location(f"tkcc_model_factory_{abs(hash(path))}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if not hasattr(mod, func):
            raise EngineError(f"model factory {path!r} has no function {func!r}")
        program = getattr(mod, func)(dtype=dtype, device=device, max_cache_len=max_cache_len, batch=batch)
    else:  # a built-in name, a local Hugging Face directory, or module:factory returning the nn.Module
        from tkcc.frontend import capture
        from tkcc.frontend.user_models import build_user_model

        kw = {"batch": batch}
        if max_cache_len:
            kw["max_cache_len"] = max_cache_len
        program = capture(build_user_model(model, dtype, device), **kw)
    program.meta.setdefault("model", model)
    program.meta.setdefault("batch", batch)
    return program


def fast_blocks_for(num_blocks: int, requested: int | None) -> int:
    """Blocks in the fast tier: ``requested`` if given, else a fifth of the model (at least 1)."""
    if requested is None:
        return max(1, num_blocks // 5)
    if not 1 <= requested <= num_blocks:
        raise EngineError(f"--fast-blocks {requested}: must be in 1..{num_blocks} (the model has {num_blocks} blocks)")
    return requested


def build_tiers(program, fast_blocks: int) -> dict:
    """{'fast': first k blocks, 'slow': whole model}; weights shared (Program.truncate)."""
    fast = program.truncate(fast_blocks)
    return {"fast": fast, "slow": program}


def check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise EngineError(f"unknown tier {tier!r}; the engine has tiers {list(TIERS)}")
    return tier
