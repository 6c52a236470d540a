"""tkcc: a continual compiler for inference.

    import tkcc
    compiled = tkcc.compile(model, trace)
    compiled(...)
    compiled.report()
"""
from tkcc.errors import TkccError

__version__ = "0.1.0"


def compile(model, trace=None, **kwargs):  # noqa: A001 - the public name is the point
    """Capture ``model``, optimise it for the traffic in ``trace`` and return a golden-checked callable.

    ``trace`` is a traffic trace (path or Trace) for language models, or a
    Workload of input shapes (``Workload.from_shapes``) for any other model:
    those get the bit-exact compile of :func:`tkcc.science.compile_exact`
    (whole-forward or per-region CUDA graphs, golden-checked on every shape).
    See :func:`tkcc.compiler.compile` for the language-model arguments.
    """
    from tkcc.traffic.workload import Workload

    if isinstance(trace, Workload) and trace.phases() <= {"forward"}:
        from tkcc.science import compile_exact

        return compile_exact(model, trace, **kwargs)
    from tkcc.compiler import compile as _compile

    return _compile(model, trace, **kwargs)


__all__ = ["compile", "TkccError", "__version__"]
