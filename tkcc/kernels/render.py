"""Render a kernel template (plain Triton with a few jinja hooks) and import it.

Triton's ``@jit`` reads a kernel's source with ``inspect``, so a rendered
template must live in a real file: it is written once under a cache folder
named by the hash of its text and imported from there. The same hooks give the
same module object for the whole process, so each variant compiles once.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import jinja2

TEMPLATE_DIR = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                          trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
_MODULES: dict[str, object] = {}


def cache_dir() -> Path:
    d = Path(os.environ.get("TKCC_KERNEL_CACHE", Path(tempfile.gettempdir()) / f"tkcc-kernels-{os.getuid()}"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def render_source(template: str, **hooks) -> str:
    """The Python source of one kernel variant."""
    return _ENV.get_template(template).render(**hooks)


def import_source(prefix: str, src: str):
    """Import generated module text once per process. Triton's @jit reads its source from a file, so the
    text goes to a file named by its content hash in the cache folder (written atomically)."""
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    name = f"{prefix}_{digest}"
    mod = _MODULES.get(name)
    if mod is not None:
        return mod
    path = cache_dir() / f"{name}.py"
    if not path.exists() or path.read_text() != src:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(src)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    mod.TKCC_SOURCE = src
    _MODULES[name] = mod
    return mod


def load(template: str, **hooks):
    """Render ``template`` with ``hooks`` and return the imported module (cached per process)."""
    return import_source(f"tkcc_kernel_{template.split('.')[0]}", render_source(template, **hooks))
