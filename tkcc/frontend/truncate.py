"""Shallow copies of a model that keep only the first k repeated blocks, sharing every weight.

Why shallow: a tier with 2 of 16 layers must not allocate or copy weights.
Only the modules on the path to the block container are copied (their child
dicts are new, so the original model is untouched); every block kept, and
every other submodule, is the very same object as in the original.
"""
from __future__ import annotations

import copy

import torch


def _shallow(mod: torch.nn.Module) -> torch.nn.Module:
    new = copy.copy(mod)
    new._modules = dict(mod._modules)
    new._parameters = dict(mod._parameters)
    new._buffers = dict(mod._buffers)
    return new


def keep_first_blocks(model: torch.nn.Module, container: str, k: int) -> torch.nn.Module:
    """``model`` with ``model.<container>`` cut to its first k children; weights shared.

    The container is rebuilt with its own type (``nn.ModuleList`` or
    ``nn.Sequential``). Returns the new root; for ``container == ""`` the root
    itself is the container.
    """
    blocks = model.get_submodule(container) if container else model
    kept = list(blocks.children())[:k]
    if isinstance(blocks, torch.nn.Sequential):
        cut = torch.nn.Sequential(*kept)
    else:
        cut = torch.nn.ModuleList(kept)
    if not container:
        return cut
    root = _shallow(model)
    parent = root
    *path, last = container.split(".")
    for name in path:
        child = _shallow(parent._modules[name])
        parent._modules[name] = child
        parent = child
    parent._modules[last] = cut
    return root


def copied_path(root: torch.nn.Module, container: str) -> list[torch.nn.Module]:
    """The modules on the path from ``root`` to the container's parent (the shallow copies)."""
    mods = [root]
    if container:
        for name in container.split(".")[:-1]:
            mods.append(mods[-1]._modules[name])
    return mods
