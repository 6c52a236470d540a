"""tkcc: a continual compiler for inference.

    import tkcc
    compiled = tkcc.compile(model, trace)       # runs the loop for a budget; returns the winner
    compiled.generate(ids, 64)                  # at the speed the engine measured
    compiled.save("out/"); tkcc.load("out/", model)
"""
from tkcc.errors import TkccError
from tkcc.version import __version__


def compile(model, trace=None, **kwargs):  # noqa: A001 - the public name is the point
    """Capture ``model``, run the optimisation loop on ``trace`` and return the winner (:func:`tkcc.compiler.compile`)."""
    from tkcc.compiler import compile as _compile

    return _compile(model, trace, **kwargs)


def load(path, model, **kwargs):
    """The compiled model saved at ``path`` (``compiled.save(path)``), rebuilt on ``model`` without any search."""
    from tkcc.compiled import load as _load

    return _load(path, model, **kwargs)


__all__ = ["compile", "load", "TkccError", "__version__"]
