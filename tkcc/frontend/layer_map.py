"""Layer map: which graph nodes belong to which repeated block (decoder layer).

A tier keeps the first k blocks of a model; passes that work per block (MoE
regrouping, KV staging) need to know where a block starts and ends. Export
records, on every node, the stack of modules it was called from
(``nn_module_stack``: ``{key: (path, type)}``), so a node belongs to block i
when one of those paths is ``<container>.<i>`` or lies below it. Parameter
reads (``get_attr``) carry no stack; their target path says the same thing.
"""
from __future__ import annotations

import re

import torch
import torch.fx


def block_index(path: str, container: str) -> int | None:
    """Block index of a module/attribute path under ``container`` (``"lm.model.layers"``), else None."""
    prefix = re.escape(container) + r"\." if container else ""
    m = re.match(prefix + r"(\d+)(?:\.|$)", path)
    return int(m.group(1)) if m else None


def layer_map(gm: torch.fx.GraphModule, container: str) -> dict[str, int]:
    """{node name: block index} for the nodes of ``gm`` inside ``container.<i>``; others are absent."""
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        idx = None
        if node.op == "get_attr":
            idx = block_index(str(node.target), container)
        else:
            for path, _type in (node.meta.get("nn_module_stack") or {}).values():
                idx = block_index(path, container)
                if idx is not None:
                    break
        if idx is not None:
            out[node.name] = idx
    return out


def structure_signature(module: torch.nn.Module):
    """A hashable description of a module tree: classes, child names, parameter/buffer shapes and dtypes."""
    own = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in list(module.named_parameters(recurse=False))
                + list(module.named_buffers(recurse=False)) if t is not None)
    kids = tuple((n, structure_signature(c)) for n, c in module.named_children())
    return (type(module).__qualname__, own, kids)


def find_repeated_blocks(model: torch.nn.Module) -> tuple[str, int] | None:
    """(path of the container, number of blocks) for the largest run of identical blocks, else None.

    A container is an ``nn.ModuleList`` or ``nn.Sequential`` with at least two
    children that all have the same structure. The one with the most blocks
    wins (the shallowest on a tie), so an encoder's ``layers`` beats a
    two-layer MLP inside each layer.
    """
    best: tuple[int, int, str] | None = None  # (-count, depth, path)
    for path, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) or len(mod) < 2:
            continue
        children = list(mod.children())
        if len(children) != len(mod):
            continue
        sig = structure_signature(children[0])
        if sig[2] == () and sig[1] == () and type(children[0]).__module__.startswith("torch.nn"):
            continue  # a run of parameter-free activations is not a block
        if all(structure_signature(c) == sig for c in children[1:]):
            key = (-len(children), path.count(".") if path else -1, path)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    return best[2], -best[0]
