"""Run under TRITON_INTERPRET=1 (by test_lowered_families.py), every kernel live on the CPU:

1. the sink and Gemma q/k-norm rewrites against their patterns (fresh random inputs, several shapes, fp32), and
   the op itself with a Gemma norm under each rotation path of the kernel (fp32, fp16); Cohere's attention and
   LayerNorm rewrites (fp32, fp16) and the op's rotation by the rounded table, key by key (fp16); gpt-oss's experts
   at every config the tuner may pick (fp32);
2. each family of ``lowered_families.FAMILIES`` captured, built through the ``lowered_decode`` plan into an
   artifact (codegen, load): its kernel ops and what stays in aten; the artifact's decode step bit-exact with the
   captured one while the ops take their references (``kernels_off``); its greedy tokens over a few steps with the
   kernels live against the captured graph's.

One JSON line per part: {"checks": rows, "fallbacks"} then {"family", "ref", "got", "logits_rel_err", "ops", "left",
"inexact", "fallbacks"} per family. Arguments: the seed, then the families (default all)."""
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lowered_families import FAMILIES, capture, kernels_off, op_counts, same_decode  # noqa: E402

from tkcc import pipeline  # noqa: E402
from tkcc.frontend.generate import greedy  # noqa: E402
from tkcc.kernels.checks import TOL, rel_err  # noqa: E402
from tkcc.kernels.common import fallbacks  # noqa: E402
from tkcc.kernels.lowered import attention_rope_ref  # noqa: E402
from tkcc.passes.lower.checks_variants import check_cohere, check_gated_attention, check_gated_norm, \
    check_gemma_qk_norm, check_sink_attention  # noqa: E402

STEPS = 4


def check_norm_offset_op(dtype, g):
    """tkcc.attention_rope with Gemma's q/k norm (norm_offset) under a partial and an interleaved rotation, against
    its reference: the kernel's pairs path with the fp32 norm."""
    rows = []
    for hq, hkv, D, S, chunk, R, il in ((4, 2, 16, 40, 16, 16, False), (4, 2, 16, 40, 16, 8, False),
                                        (4, 4, 32, 64, 16, 32, True)):
        rnd = lambda *s: torch.randn(*s, generator=g).to(dtype=dtype)  # noqa: E731
        qkv, kc, vc = rnd(1, 1, (hq + 2 * hkv) * D) * 2, rnd(1, hkv, S, D), rnd(1, hkv, S, D)
        qn, kn = rnd(D) * 0.5, rnd(D) * 0.5
        inv = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
        pos = torch.randint(0, S, (1,), generator=g)
        count = torch.zeros(hkv, dtype=torch.int32)
        k2, v2 = kc.clone(), vc.clone()
        rd = 0 if R == D else R
        ref = attention_rope_ref(qkv, kc, vc, pos, inv, 1.0, qn, kn, 1e-6, D ** -0.5, hq, 0, True, rd, il,
                                 norm_offset=1.0)
        got = torch.ops.tkcc.attention_rope(qkv, k2, v2, pos, inv, 1.0, qn, kn, 1e-6, D ** -0.5, hq, 0, chunk, 16, 4,
                                            count, False, True, rd, il, None, 1.0)
        err = max(rel_err(got, ref), rel_err(k2, kc), rel_err(v2, vc))
        rows.append({"case": f"norm_offset_op[{hq}/{hkv}x{D}, rotary {R}{', interleaved' if il else ''}]",
                     "dtype": str(dtype), "rel_err": err, "ok": err <= TOL[dtype] and int(count.sum()) == 0})
    return rows


def check_rounded_table_op(dtype, g):
    """tkcc.attention_rope rotating in fp32 by the table rounded to the activations' dtype (Cohere's
    ``rope_table_rounded``) against its reference: within tolerance, and in fp16 the new key as the reference writes
    it, element for element but for a rare one whose cos the interpreter and torch round apart (at most 2%), where
    the reference by the unrounded table differs on a twentieth or more (``unrounded``: the criterion can fail)."""
    rows = []
    for hq, hkv, D, S, chunk, window, rs in ((4, 2, 64, 40, 16, 0, 1.0), (4, 4, 128, 64, 16, 12, 0.75),
                                             (8, 1, 64, 100, 64, 0, 1.0)):
        rnd = lambda *s: torch.randn(*s, generator=g).to(dtype=dtype)  # noqa: E731
        qkv, kc, vc = rnd(1, 1, (hq + 2 * hkv) * D) * 2, rnd(1, hkv, S, D), rnd(1, hkv, S, D)
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        pos = torch.randint(S // 2, S, (1,), generator=g)  # (at position 0 the table is 1s and 0s: nothing rounds)
        count = torch.zeros(hkv, dtype=torch.int32)
        k2, v2, k3, v3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        ref = attention_rope_ref(qkv, kc, vc, pos, inv, rs, None, None, 1e-6, D ** -0.5, hq, window, False, 0, True,
                                 rope_fp32=True, rope_table_rounded=True)
        attention_rope_ref(qkv, k3, v3, pos, inv, rs, None, None, 1e-6, D ** -0.5, hq, window, False, 0, True,
                           rope_fp32=True)
        got = torch.ops.tkcc.attention_rope(qkv, k2, v2, pos, inv, rs, None, None, 1e-6, D ** -0.5, hq, window, chunk,
                                            16, 4, count, False, False, 0, True, rope_fp32=True,
                                            rope_table_rounded=True)
        err = max(rel_err(got, ref), rel_err(k2, kc), rel_err(v2, vc))
        p = int(pos)
        keys = float((k2[:, :, p] != kc[:, :, p]).float().mean())  # the new key, element by element
        unrounded = float((k3[:, :, p] != kc[:, :, p]).float().mean())
        sharp = dtype == torch.float32 or (keys <= 0.02 and unrounded >= 0.05)  # (fp32: the rounding is no rounding)
        rows.append({"case": f"rounded_table_op[{hq}/{hkv}x{D}, S={S}, rope x{rs}, window {window}]",
                     "dtype": str(dtype), "rel_err": err, "keys_off": keys, "unrounded": unrounded,
                     "ok": err <= TOL[dtype] and sharp and int(count.sum()) == 0})
    return rows


def check_gptoss_configs(dtype, g):
    """tkcc.moe_gptoss at every (gate_up, down) config the tuner may pick, twice (each launch's last program resets
    its arrival counters), against its reference: widths no block divides, rows that every split of every config
    has a share of (its last, shorter, too)."""
    from tkcc.kernels import moe_gptoss as mg
    from tkcc.kernels.lowered import moe_gptoss_ref
    from tkcc.passes.lower.checks import gptoss_weights

    E, H, I, k = 6, 488, 488, 2
    w = gptoss_weights(E, H, I, g, "cpu", dtype)
    count = torch.zeros(mg.counters_any(H, I, k), dtype=torch.int32)
    rows = []
    for gc, dc in zip(mg.GATE_UP_CONFIGS + [mg.INTERP[1]], mg.DOWN_CONFIGS + [mg.INTERP[2]]):
        errs = []
        for _ in range(2):
            xs = torch.randn(1, H, generator=g).to(dtype)
            ref = moe_gptoss_ref(xs, *w, k, 1.702, 7.0)
            got = torch.ops.tkcc.moe_gptoss(xs, *w, k, 1.702, 7.0, count, [*mg.INTERP[0], *gc, *dc])
            errs.append(rel_err(got, ref))
        rows.append({"case": f"moe_gptoss configs gate_up {gc} down {dc}", "dtype": str(dtype), "rel_err": max(errs),
                     "ok": max(errs) <= TOL[dtype] and int(count.abs().sum()) == 0})
    return rows


def main():
    g = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    t0 = time.perf_counter()
    rows = []
    # the rewrites (fp32): GQA, MHA and MQA, one split and more than the kernel merges (the combine launch), sliding
    # windows, YaRN-scaled tables, the chunked and the partial rotation; the op (fp32 and fp16: the fp16 sink kernel
    # is test_lowered_variants'): Gemma's norm under each of the kernel's rotation paths; Cohere's rewrites (fp32 at
    # every shape, fp16 at two) and its rotation by the rounded table in the op
    rows += check_sink_attention("cpu", torch.float32, g, shapes=((4, 4, 32, 64, 64, 12), (4, 2, 16, 300, 16, 8)))
    rows += check_gemma_qk_norm("cpu", torch.float32, g, shapes=((8, 1, 16, 100, 16, 24),))
    rows += check_norm_offset_op(torch.float32, g) + check_norm_offset_op(torch.float16, g)
    rows += check_cohere("cpu", torch.float32, g) + check_cohere("cpu", torch.float16, g, shapes=(
        (4, 2, 16, 40, 16, 0, 48), (2, 1, 64, 48, 16, 10, 1000)))
    rows += check_rounded_table_op(torch.float32, g) + check_rounded_table_op(torch.float16, g)
    rows += check_gptoss_configs(torch.float32, g)
    rows += check_gated_norm("cpu", torch.float32, g) + check_gated_norm("cpu", torch.float16, g, shapes=((1, 4, 128),))
    rows += check_gated_attention("cpu", torch.float32, g) + check_gated_attention("cpu", torch.float16, g, shapes=(
        (4, 2, 16, 300, 16, 4), (2, 1, 64, 48, 16, 16)))
    print(json.dumps({"checks": rows, "fallbacks": fallbacks(), "seconds": round(time.perf_counter() - t0, 1)},
                     default=str), flush=True)

    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(5))
    for family in sys.argv[2:] or list(FAMILIES):
        t0 = time.perf_counter()
        prog = capture(family, max_cache_len=160, phases=("prefill", "decode"), seed=11)
        with tempfile.TemporaryDirectory() as d:
            build = pipeline.build(prog, [{"name": "lowered_decode", "params": {"attn_chunk": 64}}], f"{d}/art",
                                   mode="tolerance", check_numerics=False, log_code=False)
            ops, left = op_counts(build.program.graphs["decode"])
            with kernels_off():
                inexact = same_decode(prog, build.forwards["decode"], positions=(0, 9, 100))
            before = dict(fallbacks())
            ref, ref_logits = greedy(prog, prompt, STEPS, return_logits=True)
            got, got_logits = greedy(prog, prompt, STEPS, forwards=build.forwards, return_logits=True)
        err = float((got_logits - ref_logits).norm() / ref_logits.norm())
        new_fallbacks = {k: v for k, v in fallbacks().items() if k not in before}
        print(json.dumps(dict(family=family, ref=ref[0].tolist(), got=got[0].tolist(), logits_rel_err=err, ops=ops,
                              left=sorted(left), inexact=inexact,
                              fallbacks=new_fallbacks, seconds=round(time.perf_counter() - t0, 1))), flush=True)


if __name__ == "__main__":
    main()
