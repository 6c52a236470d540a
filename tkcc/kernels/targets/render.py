"""Render the CUDA/HIP kernel templates: one body, two targets (see templates/cuda/prelude.cuh.jinja)."""
from __future__ import annotations

from functools import lru_cache

import jinja2

DTYPES = ("float32", "float16", "bfloat16")


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("tkcc.kernels", "templates"),
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                              keep_trailing_newline=True)


def render(template: str, target: str, dtype: str, **params) -> str:
    """Source of ``templates/cuda/<template>.cu.jinja`` for ``target`` in ("cuda", "hip")."""
    if target not in ("cuda", "hip"):
        raise ValueError(f"CUDA-family templates render for 'cuda' or 'hip', not {target!r}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; one of {DTYPES}")
    return _env().get_template(f"cuda/{template}.cu.jinja").render(target=target, dtype=dtype, **params)
