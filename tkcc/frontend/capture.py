"""``capture(model) -> Program``: the one entry point from an nn.Module to whole FX graphs.

Hugging Face causal LMs get the phases "prefill" and "decode" over a static KV
cache (``tkcc.frontend.hf``); every other module gets one phase, "forward",
captured from example inputs (``tkcc.frontend.plain``). A model that cannot
be captured whole raises ``CaptureError`` listing each graph break.
"""
from __future__ import annotations

import torch

from tkcc.errors import CaptureError
from tkcc.frontend.program import Program


def capture(model, *, example_inputs=None, phases=None, max_cache_len: int | None = None, batch: int = 1,
            dynamic_shapes=None, exact: bool = True) -> Program:
    """Capture ``model`` as a Program.

    model:          an ``nn.Module``. An HF ``*ForCausalLM`` is captured as
                    phases "prefill"/"decode"; pass ``phases=["forward"]`` (and
                    ``example_inputs``) to capture its plain forward instead.
    example_inputs: plain modules: tuple of tensors of one forward call.
    phases:         subset of the model's phases to capture (default: all).
    max_cache_len:  causal LMs: KV cache length (default min(max_position_embeddings, 4096)).
    batch:          causal LMs: sequences per step (the KV cache is allocated for it).
    dynamic_shapes: plain modules: passed to ``torch.export`` (default: static shapes).
    exact:          recorded in ``meta["exact"]``: whether golden checks of this
                    model demand bitwise equality (True) or tolerances (False).
    """
    if not isinstance(model, torch.nn.Module):
        kind = type(model)
        raise CaptureError(f"capture() needs a torch.nn.Module, got {kind.__module__}.{kind.__qualname__} "
                           f"({_short_repr(model)}); wrap a function in an nn.Module whose forward calls it")
    from tkcc.frontend.hf import is_hf_causal_lm

    if is_hf_causal_lm(model) and (phases is None or list(phases) != ["forward"]):
        if example_inputs is not None:
            raise CaptureError("example_inputs are not used for a causal LM (its phases take (input_ids, "
                               "cache_position)); pass phases=['forward'] to capture model(*example_inputs) instead")
        from tkcc.frontend.hf import capture_hf

        return capture_hf(model, phases=phases, max_cache_len=max_cache_len, batch=batch, exact=exact)
    if phases is not None and list(phases) != ["forward"]:
        raise CaptureError(f"phases={list(phases)}: a plain module has the single phase 'forward'")
    if max_cache_len is not None or batch != 1:
        raise CaptureError("max_cache_len/batch apply to causal LMs only; a plain module's shapes come from "
                           "example_inputs")
    from tkcc.frontend.plain import capture_plain

    return capture_plain(model, example_inputs, dynamic_shapes=dynamic_shapes, exact=exact)


def capture_model(name: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                  max_cache_len: int | None = None, batch: int = 1, phases=None, seed: int = 0,
                  exact: bool = True) -> Program:
    """Build the registry model ``name`` (``tkcc.frontend.models``) and capture it."""
    from tkcc.frontend.models import build_model

    if isinstance(dtype, str):
        dt = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(dt, torch.dtype):
            raise CaptureError(f"dtype {dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
        dtype = dt
    model = build_model(name, dtype=dtype, device=device, seed=seed)
    return capture(model, phases=phases, max_cache_len=max_cache_len, batch=batch, exact=exact)


def reset_state(program: Program) -> None:
    """Zero the program's KV cache (``program.state``): the next step starts a new sequence."""
    program.reset_state()


def _short_repr(obj) -> str:
    r = repr(obj)
    return r if len(r) <= 60 else r[:57] + "..."
