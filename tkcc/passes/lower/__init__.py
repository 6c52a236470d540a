"""The decode step lowered from the captured aten graph, region by region, by op pattern.

``pattern`` holds the machinery (a rewrite is a pattern and a replacement, both plain PyTorch functions,
traced to aten and matched on the graph); one module per region family holds its rewrites (``norms``,
``projections``, ``rotary``, ``attention``, ``moe``); ``decode`` is the registered pass ``lowered_decode``
that applies them to the decode graph, and ``space`` its parameter space, pruned per device.
"""
from tkcc.passes.lower.decode import LoweredDecode  # noqa: F401 - registers the pass
