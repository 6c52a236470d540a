"""Codegen: Program -> Artifact: the generated forward source that calls kernel ops (``tkcc.kernels``).

    from tkcc.codegen import build_artifact, Artifact
    art = build_artifact(program, plan, "out/art", aot_targets=("sm_90", "gfx942"))
    fns = Artifact.open("out/art").load(program)      # {phase: forward}

Names are imported lazily: loading an artifact imports only ``artifact`` and
the artifact's own ``_rt`` copy, never tkcc.passes or tkcc.frontend.
"""
from __future__ import annotations

_EXPORTS = {
    "Artifact": "tkcc.codegen.artifact",
    "build_artifact": "tkcc.codegen.artifact",
    "compile_kernel": "tkcc.codegen.aot",
    "FusedKernel": "tkcc.kernels.rowwise",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tkcc.codegen' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
