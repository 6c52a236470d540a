"""Bytes per decoded token of the built-in GPU reference models, and their floors (no GPU needed).

Each model is built on the meta device in bf16 (no memory) and probed for its state layout; the bytes come
from ``tkcc.frontend.decode_bytes``, the mechanism ``benchmarks/decode.py`` computes its floor rows with.
The floor here divides by BENCH.md's H200 copy bandwidth (4255 GB/s, read + written); decode.py measures
the bandwidth in its own run.

  python benchmarks/model_bytes.py [--models ...] [--contexts 128 2048 8192 32768] [--markdown] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tkcc.frontend.decode_bytes import bytes_per_token  # noqa: E402
from tkcc.frontend.hf_cache import probe_layout  # noqa: E402
from tkcc.frontend.models import REGISTRY, _model_cls, make_config  # noqa: E402

BENCH_BANDWIDTH = 4255e9  # bytes/s, BENCH.md's device-to-device copy on one H200


def rows(names, contexts) -> list[dict]:
    out = []
    for name in names:
        spec = REGISTRY[name]
        with torch.device("meta"):
            model = _model_cls(spec.family)(make_config(name)).to(torch.bfloat16)
        layout, _api = probe_layout(model, 1)
        per = {c: bytes_per_token(model, c, layout) for c in contexts}
        out.append(dict(model=name, family=spec.family, params=sum(p.numel() for p in model.parameters()),
                        weight_bytes=per[contexts[0]]["weights"],
                        state_bytes={c: per[c]["state"] for c in contexts},
                        floor_ms={c: per[c]["total"] / BENCH_BANDWIDTH * 1e3 for c in contexts}))
    return out


def markdown(table, contexts) -> str:
    head = "| model | family | params | weights read per token | " + " | ".join(
        f"state at {c // 1024}k" if c >= 1024 else f"state at {c}" for c in contexts) + " | floor (ms) at " + \
        " / ".join(f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts) + " |"
    lines = [head, "|" + "---|" * (5 + len(contexts))]
    for r in table:
        lines.append(f"| `{r['model']}` | {r['family']} | {r['params'] / 1e9:.2f} B | {r['weight_bytes'] / 1e9:.2f} GB | "
                     + " | ".join(f"{r['state_bytes'][c] / 1e6:.1f} MB" for c in contexts) + " | "
                     + " / ".join(f"{r['floor_ms'][c]:.3f}" for c in contexts) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[n for n in REGISTRY if not n.endswith("-tiny")])
    ap.add_argument("--contexts", nargs="+", type=int, default=[128, 2048, 8192, 32768])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    table = rows(a.models, a.contexts)
    print(markdown(table, a.contexts) if a.markdown else json.dumps(table, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
