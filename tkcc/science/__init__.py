"""Scientific models (torchdiffeq, torch-geometric, e3nn, timm) and their bit-exact compiled forward.

``build(name)`` gives a model from its own library with seeded random weights,
its Workload and an input maker; ``compile_exact(model, workload, inputs=...)``
returns a forward whose outputs are ``torch.equal`` to eager and that replays
CUDA graphs where eager would launch kernel by kernel. See docs/science.md.
"""
from tkcc.science.compile import ExactForward, compile_exact, deterministic_mode
from tkcc.science.models import BUILDERS, ScienceModel, build

__all__ = ["build", "compile_exact", "ExactForward", "ScienceModel", "BUILDERS", "deterministic_mode"]
