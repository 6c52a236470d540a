"""MoE routing skew: per-layer expert load probabilities, from real data or uniform.

Random router weights spread tokens evenly over experts; real text does not
(OLMoE top-8 on arxiv: the busiest expert gets 7.8x the mean). A Workload
carries a Routing so MoE paths are measured under the real skew as well as
uniform routing.

``probs[l, e]`` is the share of layer l's (token, slot) assignments that go
to expert e (rows sum to 1); with top-k routing an expert is chosen by a
token with probability ``min(1, k * probs[l, e])`` (see :meth:`inclusion`).

Layers missing from the data (the OLMoE CSV has layers 0, 7 and 15 only)
are filled as follows: a layer's position is mapped onto the source depth;
the *sorted* load profiles of the two nearest measured layers are linearly
interpolated by distance, and the profile is assigned to experts by a
seeded permutation. The skew's shape and magnitude interpolate; which expert
is hot does not (expert ids are unrelated across layers, so interpolating
per-expert shares would average unrelated experts into a flat profile).
The same quantile mapping resizes a profile to another number of experts.
"""
from __future__ import annotations

import csv
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tkcc.errors import TraceFormatError

OLMOE_MODEL = "allenai/OLMoE-1B-7B-0924"
MIXTRAL_MODEL = "mistralai/Mixtral-8x7B-v0.1"


@dataclass
class Routing:
    probs: np.ndarray               # (num_layers, num_experts), rows sum to 1
    top_k: int
    source: str = "uniform"
    measured_layers: tuple = ()     # layers taken from data as-is; the others are interpolated
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        p = np.asarray(self.probs, dtype=np.float64)
        if p.ndim != 2 or p.shape[0] < 1 or p.shape[1] < 1:
            raise ValueError(f"Routing.probs must be (num_layers, num_experts), got shape {p.shape}")
        if (p < 0).any() or not np.isfinite(p).all():
            raise ValueError("Routing.probs must be finite and non-negative")
        s = p.sum(axis=1, keepdims=True)
        if (s <= 0).any():
            raise ValueError("every layer needs some load")
        self.probs = p / s
        if not 1 <= int(self.top_k) <= p.shape[1]:
            raise ValueError(f"top_k {self.top_k} must be in 1..num_experts ({p.shape[1]})")
        self.top_k = int(self.top_k)

    @property
    def num_layers(self) -> int:
        return self.probs.shape[0]

    @property
    def num_experts(self) -> int:
        return self.probs.shape[1]

    # -- constructors ---------------------------------------------------------
    @classmethod
    def uniform(cls, num_layers: int, num_experts: int, top_k: int) -> "Routing":
        return cls(np.full((num_layers, num_experts), 1.0 / num_experts), top_k, source="uniform",
                   measured_layers=tuple(range(num_layers)))

    @classmethod
    def from_counts(cls, counts, top_k: int, source: str = "counts") -> "Routing":
        """From (num_layers, num_experts) assignment counts (e.g. summed from a tkcc trace)."""
        c = np.asarray(counts, dtype=np.float64)
        return cls(c, top_k, source=source, measured_layers=tuple(range(c.shape[0])),
                   meta={"tokens_per_layer": (c.sum(axis=1) / top_k).tolist()})

    @classmethod
    def from_olmoe_counts(cls, path=None, domain: str = "c4", model: str = OLMOE_MODEL, selection: str | None = None,
                          num_layers: int | None = None, num_experts: int | None = None, top_k: int | None = None,
                          seed: int = 0) -> "Routing":
        """Expert loads from the OLMoE paper's counts CSV (bundled when ``path`` is None).

        ``model`` is the HF id in the CSV (OLMoE-1B-7B-0924, its -SFT/-Instruct, or Mixtral-8x7B-v0.1);
        ``selection`` defaults to top8 (OLMoE) or top2 (Mixtral); ``top1`` gives first choices only.
        ``num_layers``/``num_experts``/``top_k`` fit the result to another model (see module doc).
        """
        if path is None:
            path = Path(__file__).resolve().parent.parent / "data" / "traces" / "moe_routing_olmoe" / \
                "olmoe_paper_expert_counts.csv"
        sel = selection or ("top2" if "mixtral" in model.lower() else "top8")
        layers: dict[int, dict[int, float]] = {}
        seen = set()
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            need = {"model", "domain", "selection", "layer", "expert", "count"}
            if not reader.fieldnames or not need <= set(reader.fieldnames):
                raise TraceFormatError(f"expert-count CSV needs columns {sorted(need)}, has {reader.fieldnames}",
                                       path=str(path), line=1)
            for row in reader:
                seen.add((row["model"], row["domain"], row["selection"]))
                if row["model"] != model or row["domain"] != domain or row["selection"] != sel:
                    continue
                try:
                    layer, expert, count = int(row["layer"]), int(row["expert"]), float(row["count"])
                except ValueError as e:
                    raise TraceFormatError(f"bad number: {e}", path=str(path), line=reader.line_num) from None
                if count < 0:
                    raise TraceFormatError("negative count", path=str(path), line=reader.line_num, field="count")
                layers.setdefault(layer, {})[expert] = count
        if not layers:
            avail = sorted(seen)
            raise TraceFormatError(f"no rows for model={model!r} domain={domain!r} selection={sel!r}; available: "
                                   f"{avail}", path=str(path))
        ne = max(max(d) for d in layers.values()) + 1
        known = sorted(layers)
        measured = np.array([[layers[l].get(e, 0.0) for e in range(ne)] for l in known])
        k_src = 1 if sel == "top1" else int(sel[3:])
        src_layers = 16 if "olmoe" in model.lower() else 32  # OLMoE-1B-7B has 16 layers, Mixtral-8x7B 32
        r = _fill(measured, known, src_layers, num_layers or src_layers, num_experts or ne, seed)
        rt = cls(r[0], top_k or k_src, source=f"olmoe-paper:{model}:{domain}:{sel}", measured_layers=r[1],
                 meta={"source_layers": known, "source_experts": ne, "source_top_k": k_src, "seed": seed})
        return rt

    @classmethod
    def for_model(cls, num_layers: int, num_experts: int, top_k: int, domain: str = "c4", seed: int = 0) -> "Routing":
        """Real skew for any MoE shape: Mixtral data for <= 8 experts, OLMoE data otherwise, fitted to the shape."""
        model = MIXTRAL_MODEL if num_experts <= 8 else OLMOE_MODEL
        return cls.from_olmoe_counts(domain=domain, model=model, num_layers=num_layers, num_experts=num_experts,
                                     top_k=top_k, seed=seed)

    # -- queries --------------------------------------------------------------
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(f"{self.top_k}:{self.probs.shape}".encode())
        h.update(np.round(self.probs, 9).tobytes())
        return h.hexdigest()[:16]

    def imbalance(self, layer: int | None = None) -> float:
        """max/mean expert load: of one layer, or the largest over layers."""
        per = self.probs.max(axis=1) * self.num_experts
        return float(per[layer] if layer is not None else per.max())

    def imbalance_per_layer(self) -> np.ndarray:
        return self.probs.max(axis=1) * self.num_experts

    def inclusion(self, layer: int) -> np.ndarray:
        """P(token picks expert e) under top-k: k*probs capped at 1, the excess spread over the others."""
        return _capped_inclusion(self.probs[layer], self.top_k)

    def sample_topk(self, layer: int, n_tokens: int, generator=None):
        """Draw (n_tokens, top_k) distinct expert ids whose per-expert frequency follows this layer's skew.

        Systematic (Madow) sampling over a random expert order per token:
        each token gets exactly k distinct experts and expert e is picked with
        probability exactly ``inclusion(layer)[e]``. ``generator``: a
        ``torch.Generator`` (returns a torch int64 tensor), a
        ``numpy.random.Generator`` or an int seed (return numpy int64).
        """
        as_torch = False
        if generator is not None and type(generator).__name__ == "Generator" and \
                type(generator).__module__.startswith("torch"):
            import torch

            seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
            rng, as_torch = np.random.default_rng(seed), True
        elif isinstance(generator, np.random.Generator):
            rng = generator
        else:
            rng = np.random.default_rng(generator)
        pi = self.inclusion(layer)
        n, e, k = int(n_tokens), self.num_experts, self.top_k
        order = np.argsort(rng.random((n, e)), axis=1)
        cum = np.cumsum(pi[order], axis=1)
        cum[:, -1] = k
        u = rng.random((n, 1))
        prev = np.concatenate([np.zeros((n, 1)), cum[:, :-1]], axis=1)
        picked = (np.floor(cum - u) - np.floor(prev - u)) >= 1
        rows, cols = np.nonzero(picked)
        out = order[rows, cols].reshape(n, k)
        if as_torch:
            import torch

            return torch.from_numpy(out.astype(np.int64))
        return out.astype(np.int64)

    def expert_load(self, layer: int, n_tokens: int) -> np.ndarray:
        """Expected tokens per expert for n_tokens tokens at this layer."""
        return self.inclusion(layer) * n_tokens

    def to_dict(self) -> dict:
        return {"top_k": self.top_k, "source": self.source, "measured_layers": list(self.measured_layers),
                "probs": np.round(self.probs, 9).tolist(), "fingerprint": self.fingerprint()}

    @classmethod
    def from_dict(cls, d: dict) -> "Routing":
        return cls(np.array(d["probs"]), d["top_k"], source=d.get("source", ""),
                   measured_layers=tuple(d.get("measured_layers", ())))


def _capped_inclusion(p: np.ndarray, k: int) -> np.ndarray:
    pi = k * p
    capped = np.zeros(p.size, dtype=bool)
    for _ in range(p.size):
        over = (pi > 1.0 + 1e-12) & ~capped
        if not over.any():
            break
        capped |= over
        rest = k - capped.sum()
        free = ~capped
        pi = np.where(capped, 1.0, 0.0)
        tot = p[free].sum()
        pi[free] = p[free] / tot * rest if tot > 0 else rest / free.sum()
    return np.clip(pi, 0.0, 1.0)


def _resize_profile(sorted_desc: np.ndarray, n: int) -> np.ndarray:
    """Quantile-map a descending load profile to n experts (same shape of skew)."""
    if sorted_desc.size == n:
        return sorted_desc.copy()
    src = np.linspace(0, 1, sorted_desc.size)
    dst = np.linspace(0, 1, n)
    out = np.interp(dst, src, sorted_desc)
    return out / out.sum()


def _fill(measured: np.ndarray, known: list[int], src_layers: int, num_layers: int, num_experts: int, seed: int):
    """Measured layers -> (num_layers, num_experts) probs, plus which target layers kept measured data as-is."""
    measured = measured / measured.sum(axis=1, keepdims=True)
    profiles = -np.sort(-measured, axis=1)
    out = np.zeros((num_layers, num_experts))
    kept = []
    for l in range(num_layers):
        x = l * (src_layers - 1) / max(num_layers - 1, 1)
        exact = [i for i, k in enumerate(known) if abs(k - x) < 1e-9]
        if exact and measured.shape[1] == num_experts:
            out[l] = measured[exact[0]]
            kept.append(l)
            continue
        if x <= known[0]:
            prof = profiles[0]
        elif x >= known[-1]:
            prof = profiles[-1]
        else:
            j = int(np.searchsorted(known, x, side="right"))
            a, b = known[j - 1], known[j]
            w = (x - a) / (b - a)
            prof = (1 - w) * profiles[j - 1] + w * profiles[j]
        prof = _resize_profile(prof / prof.sum(), num_experts)
        perm = np.random.default_rng([seed, l]).permutation(num_experts)
        out[l, perm] = prof
    return out, tuple(kept)
