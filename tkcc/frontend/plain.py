"""Plain PyTorch modules -> Program with one phase, "forward", captured from example inputs.

The graph takes the same positional tensors as ``model(*example_inputs)`` and
returns the same tensor (or flat tuple of tensors). The repeated blocks are
the children of the largest ``nn.ModuleList``/``nn.Sequential`` whose children
all have the same structure (see ``layer_map.find_repeated_blocks``); without
one the Program has a single block and nothing to truncate.
"""
from __future__ import annotations

import time

import torch

from tkcc.errors import CaptureError, TkccError
from tkcc.frontend.export import export_graph
from tkcc.frontend.fingerprint import model_fingerprint
from tkcc.frontend.layer_map import find_repeated_blocks, layer_map
from tkcc.frontend.program import Program
from tkcc.frontend.truncate import keep_first_blocks

PHASE = "forward"

_TRAINING_ONLY = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm,
                  torch.nn.modules.instancenorm._InstanceNorm)


def check_inference_mode(model: torch.nn.Module) -> None:
    """Refuse to capture dropout / batch-norm in training mode: the graph would not be an inference forward."""
    for path, mod in model.named_modules():
        if isinstance(mod, _TRAINING_ONLY) and mod.training:
            raise CaptureError(f"{type(model).__name__}.{path or '<root>'} ({type(mod).__name__}) is in training "
                               "mode, which would capture training behaviour; call model.eval() before capture")


def normalize_example_inputs(example_inputs) -> tuple:
    """A tuple of tensors, or a CaptureError naming the bad position and type."""
    if example_inputs is None:
        raise CaptureError("capturing a plain nn.Module needs example_inputs=(tensor, ...): the positional inputs "
                           "of one forward call")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError(f"example_inputs must be a tuple of tensors, got {type(example_inputs).__name__}")
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise CaptureError(f"example_inputs[{i}] is a {type(x).__name__}, not a torch.Tensor (capture takes "
                               "tensor inputs; bind other arguments with functools.partial or a wrapper module)")
    return tuple(example_inputs)


def capture_plain(model: torch.nn.Module, example_inputs, *, dynamic_shapes=None, exact: bool = True,
                  _parent: Program | None = None) -> Program:
    """Capture ``model(*example_inputs)`` as one graph (phase ``"forward"``)."""
    t0 = time.perf_counter()
    example_inputs = normalize_example_inputs(example_inputs)
    check_inference_mode(model)
    with torch.no_grad():
        gm, out_spec = export_graph(model, example_inputs, dynamic_shapes=dynamic_shapes, what="module")
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]

    blocks = find_repeated_blocks(model)
    container, num_blocks = blocks if blocks is not None else (None, 1)
    lmap = layer_map(gm, container) if container is not None else {}

    tensors = list(model.parameters()) + list(model.buffers())
    dtype = tensors[0].dtype if tensors else example_inputs[0].dtype
    device = tensors[0].device if tensors else example_inputs[0].device
    settings = dict(phases=[PHASE], inputs=[(list(x.shape), str(x.dtype)) for x in example_inputs],
                    dynamic=dynamic_shapes is not None)
    prog = Program(
        graphs={PHASE: gm},
        example_inputs={PHASE: example_inputs},
        layer_map={PHASE: lmap},
        num_blocks=num_blocks,
        model=model,
        fingerprint=model_fingerprint(model, settings),
        meta=dict(
            kind="module",
            family=type(model).__name__,
            name=getattr(model, "tkcc_name", None),
            model_class=type(model).__name__,
            dtype=str(dtype).replace("torch.", ""),
            device=str(device),
            num_params=sum(p.numel() for p in model.parameters()),
            exact=exact,
            inputs={PHASE: names},
            input_shapes={PHASE: [list(x.shape) for x in example_inputs]},
            dynamic=dynamic_shapes is not None,
            block_container=container,
            out_spec=str(out_spec) if out_spec is not None else None,
            capture_seconds=round(time.perf_counter() - t0, 3),
            torch_version=torch.__version__,
            truncated_from=_parent.num_blocks if _parent is not None else None,
        ),
        make_inputs={PHASE: _input_maker(names, example_inputs, dynamic_shapes is not None)},
        eager=model,
    )
    if container is not None:
        prog.recapture = lambda k: capture_plain(keep_first_blocks(model, container, k), example_inputs,
                                                 dynamic_shapes=dynamic_shapes, exact=exact, _parent=prog)
    return prog


def _input_maker(names: list[str], examples: tuple, dynamic: bool):
    """make_inputs["forward"](bucket, generator): random tensors like the examples, or of the bucket's shapes."""

    def make(bucket=None, generator: torch.Generator | None = None) -> tuple:
        shapes = [tuple(x.shape) for x in examples]
        if bucket is not None and bucket.shapes:
            given = dict(bucket.shapes)
            unknown = sorted(set(given) - set(names))
            if unknown:
                raise TkccError(f"bucket {bucket.key()}: unknown input(s) {unknown}; inputs are {names}")
            shapes = [tuple(given.get(n, s)) for n, s in zip(names, shapes)]
            if not dynamic:
                for n, s, x in zip(names, shapes, examples):
                    if s != tuple(x.shape):
                        raise TkccError(f"bucket {bucket.key()}: input {n!r} shape {list(s)} differs from the "
                                        f"captured {list(x.shape)}; capture with dynamic_shapes or with "
                                        "example inputs of that shape")
        gen_device = generator.device if generator is not None else torch.device("cpu")
        out = []
        for shape, x in zip(shapes, examples):
            if x.dtype.is_floating_point or x.dtype.is_complex:
                t = torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float32).to(x.dtype)
            elif x.dtype == torch.bool:
                t = torch.randint(0, 2, shape, generator=generator, device=gen_device).bool()
            else:  # integer inputs are usually indices: stay within the example's range
                lo, hi = (int(x.min()), int(x.max()) + 1) if x.numel() else (0, 1)
                t = torch.randint(lo, hi, shape, generator=generator, device=gen_device, dtype=torch.int64).to(x.dtype)
            out.append(t.to(x.device))
        return tuple(out)

    return make
