"""CUDA graph capture of one forward on one bucket's shapes, and its replay on rotated inputs.

A captured graph owns static input tensors (inputs are copied into them
before a replay) and the static outputs the replay writes. Warm-up runs on a
side stream before capture, as torch requires. A forward that cannot be
captured (host synchronisation, data-dependent shapes) raises
GraphCaptureError; the engine then times it eagerly and says so.
"""
from __future__ import annotations

import torch

from tkcc.runtime.validation import tensors_of


class GraphCaptureError(Exception):
    pass


class CapturedGraph:
    def __init__(self, fn, inputs: tuple, device: torch.device, warmup: int = 3):
        self.device = device
        self.static_inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.no_grad(), torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn(*self.static_inputs)
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(self.graph):
                out = fn(*self.static_inputs)
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # capture is best-effort; the engine falls back to eager timing
            msg = str(e)
            if "illegal memory access" in msg or ("CUDA error" in msg and "captur" not in msg):
                raise  # a broken context, not an uncapturable forward: the worker must handle it
            raise GraphCaptureError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        self.static_outputs = tensors_of(out)

    def load(self, inputs: tuple) -> None:
        for s, x in zip(self.static_inputs, inputs):
            if isinstance(s, torch.Tensor):
                s.copy_(x, non_blocking=True)

    def replay(self) -> None:
        self.graph.replay()

    def run(self, inputs: tuple) -> list[torch.Tensor]:
        self.load(inputs)
        self.replay()
        return self.static_outputs
