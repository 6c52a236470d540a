"""Check a sharded Program against the unsharded one on the same rank: logits and greedy tokens.

Run inside a rank of a process group (``launch``): every rank captures the
model, keeps the unsharded Program as the reference, shards a copy and runs
both on the same prompt. The sharded graph's collectives make every rank
produce the full logits, so each rank can compare on its own.
"""
from __future__ import annotations

import torch

from tkcc.frontend.generate import greedy


def compare_layout(program, degree: int, strategy: str, prompt: torch.Tensor, new_tokens: int = 6,
                   rtol: float = 1e-4, atol: float = 1e-4) -> dict:
    """Shard ``program`` (this rank) and compare it with the unsharded program on ``prompt`` (greedy tokens and
    the logits that chose them, from the one greedy loop)."""
    from tkcc.passes.sharding import shard_program

    with torch.no_grad():
        ref_tokens, ref = greedy(program, prompt, new_tokens, return_logits=True)
        sharded, info = shard_program(program, degree, strategy)
        got_tokens, got = greedy(sharded, prompt, new_tokens, return_logits=True)
    ref_logits, got_logits = ref.unbind(1), got.unbind(1)  # the float32 logits that chose each token
    from tkcc.parallel.cost import count_ops

    before, after = count_ops(program.graphs["decode"]), count_ops(sharded.graphs["decode"])
    added = {k: after[k] - before[k] for k in ("host_ops", "kernels")}  # what the sharding adds (no GEMVs)
    errs = [(a - b).abs().max().item() for a, b in zip(ref_logits, got_logits)]
    scale = max(a.abs().max().item() for a in ref_logits)
    close = all(torch.allclose(a, b, rtol=rtol, atol=atol) for a, b in zip(ref_logits, got_logits))
    return dict(degree=degree, strategy=strategy, max_abs_err=max(errs), logit_scale=scale, close=close,
                tokens_equal=bool(torch.equal(ref_tokens, got_tokens)), tokens=got_tokens.tolist(),
                ref_tokens=ref_tokens.tolist(), notes=info.notes, layout=sharded.meta.get("layout"),
                decode_ops_added=added)


def capture_cases(cases: list[tuple], max_cache_len: int = 32) -> dict:
    """Capture each distinct (model name, config overrides) once: {(name, overrides key): Program}."""
    from tkcc.frontend.hf import capture_hf
    from tkcc.frontend.models import build_model

    out = {}
    for name, _strategy, overrides in cases:
        key = (name, tuple(sorted(overrides.items())))
        if key not in out:
            out[key] = capture_hf(build_model(name, **overrides), max_cache_len=max_cache_len, batch=1)
    return out


def check_cases_on_rank(rank: int, world: int, cases: list[tuple], programs: dict | None = None,
                        max_cache_len: int = 32, prompt_len: int = 5, new_tokens: int = 6, seed: int = 0) -> list[dict]:
    """For each (model name, strategy, config overrides): shard at degree ``world`` and compare.

    ``programs`` (from ``capture_cases``, inherited through fork) saves every
    rank its own capture; without it each rank captures.
    """
    programs = programs if programs is not None else capture_cases(cases, max_cache_len)
    out = []
    for name, strategy, overrides in cases:
        program = programs[(name, tuple(sorted(overrides.items())))]
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, program.meta["vocab_size"], (1, prompt_len), generator=g)
        res = compare_layout(program, world, strategy, prompt, new_tokens)
        res.update(model=name, overrides=overrides, rank=rank)
        out.append(res)
    return out
