"""Host-read speculation: capture a forward that reads values on the host, when those values are the model's own.

torchdiffeq's fixed-grid solver compares its time grid on the host every step (``while t1 >= t[j]``): one
CUDA graph cannot hold a forward that synchronises. But a read whose value depends only on the model's
weights, buffers and constants is the same at every call. ``HostReads`` records those values in an eager
call and, inside a capture, returns them without synchronising; the graph also computes every read value,
and ``tkcc.kernels.graph_replay.CapturedCall`` compares them with the recorded ones after each replay
(on a difference the replay is discarded and the eager forward runs).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tkcc.kernels.graph_replay import SpeculationError


def _storage(x: torch.Tensor) -> int:
    try:
        return x.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensors without storage (fake, sparse) are never tainted
        return 0


class HostReads(TorchDispatchMode):
    """Record, then replay without syncing, the values a forward reads on the host (``.item()``, ``bool()``).

    Which reads may be speculated: only reads whose value does not depend on
    the call's inputs. Dependence is tracked by storage: the inputs' storages
    are tainted, every op with a tainted tensor argument taints its outputs and
    the arguments it writes. A read of a tainted tensor raises
    SpeculationError (that forward is split into regions instead). What stays
    is reads of weights, buffers and constants (torchdiffeq compares its own
    time grid every step): the same at every call, unless the model's state
    is changed in place, which the guards catch.

    ``record``: run eagerly, keep each value. ``replay`` (inside a capture):
    return the recorded values in order without synchronising, and keep a
    clone of each read tensor (a guard, computed by the graph at every replay).
    """

    def __init__(self, inputs, mode: str, recorded: list | None = None):
        super().__init__()
        self.mode = mode
        self.values: list = [] if mode == "record" else list(recorded or [])
        self.guards: list = []
        self.taint = {_storage(x) for x in inputs if isinstance(x, torch.Tensor)} - {0}
        self.i = 0

    def _tainted(self, x) -> bool:
        return isinstance(x, torch.Tensor) and _storage(x) in self.taint

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            x = args[0]
            if self._tainted(x):
                raise SpeculationError("a host read depends on the inputs (a data-dependent branch or size)")
            if self.mode == "record":
                v = func(*args, **kwargs)
                if not isinstance(v, (bool, int, float)) or (isinstance(v, int) and abs(v) > 2**53):
                    raise SpeculationError(f"host read of {type(v).__name__} {v!r} cannot be guarded exactly")
                self.values.append(v)
                return v
            if self.i >= len(self.values):
                raise SpeculationError("the forward read more values on the host than when it was recorded")
            v = self.values[self.i]
            self.i += 1
            self.guards.append(x.detach().reshape(()).clone())
            return v
        out = func(*args, **kwargs)
        flat = pytree.tree_leaves((args, kwargs))
        in_storages = {_storage(a) for a in flat if isinstance(a, torch.Tensor)}
        if not any(self._tainted(a) for a in flat):
            # a fresh output of untainted inputs may sit where a freed tainted tensor was: untaint its memory
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and _storage(o) not in in_storages:
                    self.taint.discard(_storage(o))
        else:
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    self.taint.add(_storage(o))
            for arg, a in zip(func._schema.arguments, args):
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, torch.Tensor):
                    self.taint.add(_storage(a))
            for name, a in kwargs.items():
                if isinstance(a, torch.Tensor) and name == "out":
                    self.taint.add(_storage(a))
        return out
