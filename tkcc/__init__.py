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

    See :func:`tkcc.compiler.compile` for the arguments.
    """
    from tkcc.compiler import compile as _compile

    return _compile(model, trace, **kwargs)


__all__ = ["compile", "TkccError", "__version__"]
