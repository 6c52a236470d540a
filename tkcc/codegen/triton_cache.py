"""Triton's file cache with a SHA-256 per file in each group: what ``tkcc.codegen.kernel_cache`` installs.

Named by ``TRITON_CACHE_MANAGER`` (``kernel_cache.MANAGER``), so every process that uses the shared cache
(the engine's JIT, the compile pool's workers) reads and writes entries this way; see ``kernel_cache``.
"""
from __future__ import annotations

import json

from triton.runtime.cache import FileCacheManager

from tkcc.codegen.kernel_cache import SUMS, _sha256, _write_atomically, check_group, invalidate


class ChecksummedCacheManager(FileCacheManager):
    """Triton's file cache, with a SHA-256 per file in each group (see the module docstring)."""

    def get_group(self, filename: str):
        if self.cache_dir is None:
            return None
        grp = f"__grp__{filename}"
        group, why = check_group(self.cache_dir, grp)
        if group is None and why:
            invalidate(self.cache_dir, why)
        return group

    def put(self, data, filename, binary=True) -> str:
        if not self.cache_dir:
            raise RuntimeError("Could not create or locate cache dir")
        data = data if isinstance(data, bytes) else str(data).encode()
        path = self._make_path(filename)
        _write_atomically(path, data)
        return path

    def put_group(self, filename: str, group: dict) -> str:
        sums = {child: _sha256(p) for child, p in group.items()}
        body = json.dumps({"child_paths": group, SUMS: sums}).encode()
        return self.put(body, f"__grp__{filename}")
