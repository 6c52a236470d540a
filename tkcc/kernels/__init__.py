"""Triton kernels for the decode fast path, one module per family, each beside its PyTorch reference.

Kernels are rendered from ``templates/*.py.jinja`` (plain Triton with a few
jinja hooks) by ``tkcc.kernels.render``; ``checks`` compares every family with
its reference; ``ops`` holds the graph-callable ops the decode passes insert; ``lowered`` the ``torch.ops.tkcc`` custom ops
the graph-lowered decode step (``tkcc.passes.lower``) is made of; ``targets`` the same families for CUDA C++,
HIP and NKI (templates under ``templates/cuda`` and ``templates/nki``).
"""
