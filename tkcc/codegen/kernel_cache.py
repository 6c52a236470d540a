"""The shared on-disk kernel cache: Triton's own cache, every entry checksummed.

One folder (``default_dir()``: ``$TKCC_KERNEL_CACHE_DIR``, else
``~/.cache/tkcc/triton``) holds every compiled kernel of every tier,
candidate and campaign on this machine. It *is* Triton's cache
(``TRITON_CACHE_DIR``), so the key is Triton's: the kernel's source and what
it calls, its specialisation, the compile options, the target and
``triton_key()`` (the compiler's version); the engine's JIT, the compile
pool's workers (``tkcc.codegen.compile_pool``) and a later campaign all look
kernels up by that key. ``use(folder)`` points this process and the processes
it starts at it.

What it adds to Triton's ``FileCacheManager`` (``tkcc.codegen.triton_cache``,
the one part that imports Triton) is a checksum per entry. Triton keeps an
entry as a folder of files (IR, binary, metadata) and a group file naming
them, and trusts whatever it finds. Here the group file also records every
file's SHA-256 (``tkcc_sha256``); an entry whose group does not parse, or a
file that is missing, truncated (a full disk under a writer that does not
rename atomically, an interrupted copy from another machine) or changed, is
reported, moved out of the way and compiled again, never loaded. A write that fails (a full disk) raises ``KernelCacheError`` naming
the folder, and leaves no half-written entry that could be found later.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import threading
import uuid

from tkcc.errors import TkccError

log = logging.getLogger("tkcc.kernel_cache")
MANAGER = "tkcc.codegen.triton_cache:ChecksummedCacheManager"  # Triton's own cache, checksummed
SUMS = "tkcc_sha256"
# what this process found rebuilt (entry folder -> why), for tests and status
REBUILT: dict[str, str] = {}
_REBUILT_LOCK = threading.Lock()


class KernelCacheError(TkccError):
    """The kernel cache could not be written (its folder is named)."""


def default_dir() -> str:
    return os.environ.get("TKCC_KERNEL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tkcc",
                                                                      "triton")


def use(folder: str | os.PathLike) -> str:
    """Make ``folder`` this process's Triton cache, with checksummed entries (also for processes it starts)."""
    folder = os.path.abspath(os.fspath(folder))
    os.makedirs(folder, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = folder
    os.environ["TRITON_CACHE_MANAGER"] = MANAGER
    return folder


def env_for(folder: str | os.PathLike) -> dict:
    """The environment variables that make a process use ``folder`` as its checksummed kernel cache."""
    return {"TRITON_CACHE_DIR": os.path.abspath(os.fspath(folder)), "TRITON_CACHE_MANAGER": MANAGER}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomically(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling, so ``path`` is whole or absent."""
    tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        what = "the disk is full" if e.errno == errno.ENOSPC else e.strerror or str(e)
        raise KernelCacheError(f"kernel cache {os.path.dirname(path)}: could not write {os.path.basename(path)} "
                               f"({what}); the kernel is compiled again when next needed") from None


def invalidate(folder: str, why: str) -> None:
    """Move a bad entry aside (then remove it): the next lookup misses and the kernel is compiled again."""
    with _REBUILT_LOCK:
        REBUILT[os.path.basename(folder)] = why
    log.warning("kernel cache entry %s is damaged (%s): compiling it again", folder, why)
    aside = f"{folder}.bad.{uuid.uuid4().hex[:8]}"
    try:
        os.rename(folder, aside)
    except OSError:
        aside = folder
    shutil.rmtree(aside, ignore_errors=True)
    os.makedirs(folder, exist_ok=True)


def check_group(folder: str, group_file: str) -> tuple[dict | None, str]:
    """(child paths, '') of a sound entry; (None, why) when the group or a file fails its checksum."""
    path = os.path.join(folder, group_file)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as e:
        return None, f"group file {group_file} unreadable ({type(e).__name__})"
    children, sums = data.get("child_paths"), data.get(SUMS)
    if not isinstance(children, dict) or not isinstance(sums, dict):
        return None, f"group file {group_file} has no checksums"
    out = {}
    for child, p in children.items():
        local = os.path.join(folder, os.path.basename(p))  # an entry copied from elsewhere: its files are here
        if not os.path.isfile(local):
            return None, f"{child} is missing"
        if _sha256(local) != sums.get(child):
            return None, f"{child} does not match its checksum"
        out[child] = local
    return out, ""


class KernelCache:
    """The cache folder seen from outside Triton: install entries compiled on another machine, look them up."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = os.path.abspath(os.fspath(folder or default_dir()))
        os.makedirs(self.folder, exist_ok=True)

    def has(self, entry: str) -> bool:
        """Is ``entry`` (a cache folder name) present and sound?"""
        folder = os.path.join(self.folder, entry)
        try:
            groups = [n for n in os.listdir(folder) if n.startswith("__grp__")]
        except OSError:
            return False
        return bool(groups) and all(check_group(folder, g)[0] is not None for g in groups)

    def install(self, entry: str, files: dict[str, bytes]) -> None:
        """Write an entry's files (from ``compile_job(return_files=True)`` elsewhere): each file whole, the group
        files last and re-checksummed here, so a reader finds a sound entry or none."""
        if os.sep in entry or entry.startswith("."):
            raise KernelCacheError(f"kernel cache {self.folder}: bad entry name {entry!r}")
        folder = os.path.join(self.folder, entry)
        os.makedirs(folder, exist_ok=True)
        groups = {n: d for n, d in files.items() if n.startswith("__grp__")}
        for name, data in files.items():
            if name not in groups:
                if os.sep in name:
                    raise KernelCacheError(f"kernel cache {self.folder}: bad file name {name!r} in entry {entry}")
                _write_atomically(os.path.join(folder, name), data)
        for name, data in groups.items():
            children = json.loads(data)["child_paths"]
            local = {c: os.path.join(folder, os.path.basename(p)) for c, p in children.items()}
            sums = {c: _sha256(p) for c, p in local.items()}
            _write_atomically(os.path.join(folder, name), json.dumps({"child_paths": local, SUMS: sums}).encode())

    def entries(self) -> list[str]:
        return sorted(n for n in os.listdir(self.folder) if os.path.isdir(os.path.join(self.folder, n))
                      and ".bad." not in n)

    def stats(self) -> dict:
        n, size = 0, 0
        for e in self.entries():
            n += 1
            for f in os.listdir(os.path.join(self.folder, e)):
                try:
                    size += os.path.getsize(os.path.join(self.folder, e, f))
                except OSError:
                    pass
        return {"folder": self.folder, "entries": n, "bytes": size, "rebuilt": dict(REBUILT)}
