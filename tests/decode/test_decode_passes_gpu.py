"""Every decode pass, one parameter value at a time, on the reference models' real layer shapes (two layers),
bf16 on the GPU, at short and long contexts of a 4096-position cache: the rewritten decode step gives the
reference's logits within bf16 tolerance, on fresh cache contents each time, and leaves the weights alone.

A campaign on the H200 found a candidate 61% off at context 1465 only after other candidates had been built
(a step that re-pointed weights that captured graphs still read); this sweep builds every candidate on
one shared Program, as the engine does, and re-checks the first one at the end.

Random-weight OLMoE routes on near-tied router logits: a last-bit difference in attention can move one
token to another expert and its logits by 20-35% of their scale (seen on the H200 with kernels that match
their references at every context in isolation, tests/targets). So a variant is judged by its median error
over contexts and seeds, which a wrong kernel or wiring exceeds and an occasional expert flip does not."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CACHE = 4096
CONTEXTS = (5, 1465, 4000)
BOUND = 0.05  # max |error| over max |reference logit|: the bf16 floor the engine's tolerance mode uses

VARIANTS = [
    ("moe_regroup", {}), ("moe_regroup", {"fused": False}), ("moe_regroup", {"expert_order": "hot_first"}),
    ("moe_regroup", {"target": "cuda"}),
    ("kv_split_attention", {}), ("kv_split_attention", {"chunk": 64}), ("kv_split_attention", {"chunk": 512}),
    ("kv_split_attention", {"target": "cuda"}), ("kv_split_attention", {"target": "cuda", "cuda_nsplit": 8}),
    ("kv_split_attention", {"target": "cuda", "cuda_nsplit": 128, "cuda_warps": 8}),
    ("decode_fusion", {}), ("decode_fusion", {"fuse_residual": False}), ("decode_fusion", {"target": "cuda"}),
    ("fuse_elementwise", {}), ("fuse_elementwise", {"include_norms": False, "intermediates": "fp32"}),
    ("lowered_decode", {}), ("lowered_decode", {"pdl": False}), ("lowered_decode", {"tune": True}),
    ("lowered_decode", {"attn_chunk": 64}), ("lowered_decode", {"attn_chunk": 512}),
    ("lowered_decode", {"attn_tile": "32x4", "attn_chunk": 64}), ("lowered_decode", {"attn_tile": "128x8"}),
    ("lowered_decode", {"gemv_config": "8x512x4"}),
]


def _program(name):
    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model

    return capture(build_model(name, torch.bfloat16, "cuda", num_hidden_layers=2), max_cache_len=CACHE,
                   phases=["decode"])


def _logits(out):
    return (out[0] if isinstance(out, (tuple, list)) else out).float()


def _check(prog, cand, seed):
    """Median scaled error of ``cand`` vs the reference over CONTEXTS x two seeds, each on fresh cache contents."""
    g = torch.Generator().manual_seed(seed)
    errs = []
    for c in CONTEXTS * 2:
        for _n, b in prog.state.named_buffers():
            b.copy_(torch.randn(b.shape, generator=g).to(b))
        saved = [b.clone() for _n, b in prog.state.named_buffers()]
        ids = torch.randint(0, prog.meta["vocab_size"], (1, 1), generator=g).cuda()
        pos = torch.tensor([c], device="cuda")
        ref = _logits(prog.graphs["decode"](ids, pos))
        for (_n, b), s in zip(prog.state.named_buffers(), saved):
            b.copy_(s)
        got = _logits(cand.graphs["decode"](ids, pos))
        assert torch.isfinite(got).all(), f"non-finite logits at context {c}"
        errs.append(float((got - ref).abs().max() / ref.abs().max()))
    return sorted(errs)[len(errs) // 2]


@pytest.mark.parametrize("name", ["olmoe-16l", "llama-1b-16l"])
def test_every_decode_pass_variant_at_long_context(name):
    from tkcc.passes.manager import apply_plan
    from tkcc.pipeline import pass_context
    from tkcc.passes.plan import PassPlan
    from tkcc.runtime.validation import changed_weight, weights_checksum

    prog = _program(name)
    before = weights_checksum(prog.model)
    built, errors = [], {}
    for i, (pname, params) in enumerate(VARIANTS):
        if pname == "moe_regroup" and not prog.model.config.model_type.startswith("olmoe"):
            continue
        cand, _logs = apply_plan(prog, PassPlan.of((pname, params)), mode="tolerance", check_numerics=False,
                                  context=pass_context())
        built.append((pname, params, cand))
        errors[f"{pname}{params}"] = _check(prog, cand, seed=i)
        assert changed_weight(before, weights_checksum(prog.model)) is None, (pname, params)
    # the first candidates again, after every other one was built on the same Program
    for pname, params, cand in built[:4]:
        errors[f"again {pname}{params}"] = _check(prog, cand, seed=100)
    bad = {k: round(v, 4) for k, v in errors.items() if not v <= BOUND}
    print({k: round(v, 4) for k, v in errors.items()})
    assert not bad, bad
