"""Realistic graphs built in code (nothing downloaded): molecule batches and citation networks.

Both generators hit an exact node and edge count, because a workload bucket
fixes the input shapes (x: (N, F), edge_index: (2, E)) while every fresh input
is a different graph of that size.

- Molecules: drug-like sizes (10 to 30 heavy atoms), a random spanning tree
  of bonds (valence at most 4) plus ring closures between atoms two to five
  bonds apart, as in organic rings; edges stored in both directions, as
  PyG's molecule data sets store them. No self-loops.
- Citation networks: Cora-, CiteSeer- and PubMed-sized; endpoint choice
  follows a power law (a few papers are cited very often), undirected and
  stored in both directions, no self-loops and no duplicate edges.
"""
from __future__ import annotations

import numpy as np
import torch

# (nodes, directed edges, features, classes) of the classic Planetoid citation graphs
CITATION_SIZES = {
    "cora": (2708, 10556, 1433, 7),
    "citeseer": (3327, 9104, 3703, 6),
    "pubmed": (19717, 88648, 500, 3),
}


def _rng(generator: torch.Generator | None, seed: int | None = None) -> np.random.Generator:
    if generator is not None:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())
    return np.random.default_rng(seed)


def molecule_sizes(n_atoms: int, rng: np.random.Generator, lo: int = 10, hi: int = 30) -> list[int]:
    """Split ``n_atoms`` into molecules of ``lo``..``hi`` atoms (the last may be smaller, at least 2)."""
    sizes, left = [], n_atoms
    while left > 0:
        s = int(rng.integers(lo, hi + 1))
        if left - s < 2 and left - s != 0:
            s = left
        s = min(s, left)
        sizes.append(s)
        left -= s
    return sizes


def molecule_bonds(sizes: list[int], n_bonds: int, rng: np.random.Generator) -> np.ndarray:
    """Undirected bonds (2, n_bonds) for molecules of the given sizes: trees plus ring closures."""
    bonds, offset, valence = [], 0, {}
    for s in sizes:
        for i in range(1, s):
            # attach to an earlier atom with free valence
            cand = [j for j in range(max(0, i - 6), i) if valence.get(offset + j, 0) < 4] or [i - 1]
            j = int(rng.choice(cand))
            bonds.append((offset + j, offset + i))
            valence[offset + i] = valence.get(offset + i, 0) + 1
            valence[offset + j] = valence.get(offset + j, 0) + 1
        offset += s
    tree = len(bonds)
    if n_bonds < tree:
        raise ValueError(f"molecule_bonds: {n_bonds} bonds cannot connect molecules of sizes {sizes} "
                         f"(a spanning forest needs {tree})")
    have = set(bonds)
    starts = np.cumsum([0] + sizes[:-1])
    big = [(int(o), s) for o, s in zip(starts, sizes) if s >= 5]
    tries = 0
    while len(bonds) < n_bonds:
        tries += 1
        if tries > 200 * n_bonds + 1000 or not big:
            raise ValueError(f"molecule_bonds: cannot place {n_bonds - tree} ring closures in molecules {sizes}")
        o, s = big[int(rng.integers(len(big)))]
        i = int(rng.integers(s))
        j = i + int(rng.integers(2, 6))
        if j >= s:
            continue
        e = (o + i, o + j)
        if e in have:
            continue
        have.add(e)
        bonds.append(e)
    return np.asarray(bonds, dtype=np.int64).T


def molecule_batch(n_atoms: int, n_edges: int, generator: torch.Generator | None = None, seed: int | None = None):
    """(edge_index (2, n_edges) both directions, batch (n_atoms,)) for a batch of molecules."""
    if n_edges % 2:
        raise ValueError(f"molecule_batch: n_edges={n_edges} must be even (each bond is stored both ways)")
    rng = _rng(generator, seed)
    for _ in range(50):
        sizes = molecule_sizes(n_atoms, rng)
        if n_edges // 2 >= n_atoms - len(sizes):
            try:
                b = molecule_bonds(sizes, n_edges // 2, rng)
                break
            except ValueError:
                continue
    else:
        raise ValueError(f"molecule_batch: no molecule batch with {n_atoms} atoms and {n_edges} directed bonds")
    ei = np.concatenate([b, b[::-1]], axis=1)
    batch = np.repeat(np.arange(len(sizes)), sizes)
    return torch.from_numpy(np.ascontiguousarray(ei)), torch.from_numpy(batch)


def typical_molecule_edges(n_atoms: int, seed: int = 0) -> int:
    """Directed edge count of a typical batch of ``n_atoms`` atoms (about 1.1 bonds per atom)."""
    rng = np.random.default_rng(seed)
    sizes = molecule_sizes(n_atoms, rng)
    tree = n_atoms - len(sizes)
    rings = int(round(0.1 * n_atoms)) if any(s >= 5 for s in sizes) else 0
    return 2 * (tree + rings)


def citation_graph(n_nodes: int, n_edges: int, generator: torch.Generator | None = None,
                   seed: int | None = None, alpha: float = 0.8) -> torch.Tensor:
    """edge_index (2, n_edges), undirected with both directions stored, power-law endpoint popularity."""
    if n_edges % 2:
        raise ValueError(f"citation_graph: n_edges={n_edges} must be even (undirected, stored both ways)")
    m = n_edges // 2
    if m > n_nodes * (n_nodes - 1) // 2:
        raise ValueError(f"citation_graph: {m} undirected edges do not fit in {n_nodes} nodes")
    rng = _rng(generator, seed)
    w = 1.0 / np.arange(1, n_nodes + 1) ** alpha
    w = w / w.sum()
    perm = rng.permutation(n_nodes)
    have: set = set()
    out = np.empty((m, 2), dtype=np.int64)
    k = 0
    while k < m:
        need = m - k
        u = perm[rng.choice(n_nodes, size=2 * need, p=w)]
        v = rng.integers(0, n_nodes, size=2 * need)  # the citing paper: uniform
        for a, b in zip(u, v):
            if a == b:
                continue
            e = (a, b) if a < b else (b, a)
            if e in have:
                continue
            have.add(e)
            out[k] = e
            k += 1
            if k == m:
                break
    ei = np.concatenate([out.T, out.T[::-1]], axis=1)
    return torch.from_numpy(np.ascontiguousarray(ei))


def molecule_positions(batch: torch.Tensor, generator: torch.Generator | None = None, spacing: float = 1.5):
    """3-D positions: each molecule's atoms in a compact cloud (about ``spacing`` apart), molecules far apart."""
    rng = _rng(generator)
    b = batch.numpy()
    n_mol = int(b.max()) + 1 if b.size else 0
    pos = np.empty((b.size, 3), dtype=np.float32)
    for g in range(n_mol):
        idx = np.nonzero(b == g)[0]
        radius = spacing * (len(idx) ** (1.0 / 3.0)) * 0.62
        pts = rng.normal(size=(len(idx), 3))
        pts = pts / np.linalg.norm(pts, axis=1, keepdims=True) * (rng.random((len(idx), 1)) ** (1 / 3)) * radius
        pos[idx] = pts + np.array([g * 100.0, 0.0, 0.0])
    return torch.from_numpy(pos)
