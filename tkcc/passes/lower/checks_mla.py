"""The MLA rewrite (``mla.py``) against its pattern, on fresh random inputs and several shapes (as ``checks``).

Each case is the pattern as a region (projections' outputs in, the latent and rope-key caches as buffers, the
step's cos/sin table and causal mask computed inside as a model computes them), captured, lowered by the
pass's own stages and compared with the pattern run eagerly: output and both caches. Shapes cover fewer and
more heads than one split program's head block (16), one and several splits, both rotary forms, a scaled
rotary, and DeepSeek's own widths (C 512, R 64, N 128) on a GPU.
"""
from __future__ import annotations

import torch

from tkcc.passes.lower.checks import Region, _options, _rand, run_case

# (heads, nope, rope, v, latent, cache, chunk, interleaved, rope scale)
SHAPES = ((4, 16, 8, 16, 32, 40, 16, True, 1.0), (3, 13, 6, 11, 20, 64, 16, False, 1.0),
          (20, 16, 16, 8, 48, 100, 32, True, 0.75), (2, 32, 64, 32, 64, 300, 64, False, 1.0))
GPU_SHAPES = ((16, 128, 64, 128, 512, 4096, 256, True, 1.0), (128, 128, 64, 128, 512, 1024, 128, True, 1.0))


def check_mla(device, dtype, g, shapes=None):
    from tkcc.passes.lower import attention, mla, rotary

    shapes = shapes or (SHAPES + (GPU_SHAPES if torch.device(device).type == "cuda" else ()))
    rows = []
    for H, N, R, V, C, S, chunk, interleave, rope_scale in shapes:
        pattern = mla._mla_pattern(interleave)[0]
        t = {"kc": _rand((1, 1, S, C), g, device, dtype), "rc": _rand((1, 1, S, R), g, device, dtype),
             "nw": _rand((C,), g, device, dtype, 0.3) + 1, "kv_b": _rand((H * (N + V), C), g, device, dtype, C ** -0.5),
             "inv_freq": 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R)).to(device)}

        def fn(s, q, ckv, pos, pattern=pattern, S=S, N=N, R=R, rope_scale=rope_scale):
            cos, sin = rotary.cos_sin(s.inv_freq, pos.unsqueeze(0), scale=rope_scale, dtype=q.dtype)
            mask = attention.causal_mask(pos, kv_len=S)
            return pattern(q, ckv, s.nw, s.kv_b, s.kc, s.rc, pos, cos, sin, mask, eps=1e-6, scale=(N + R) ** -0.5,
                           nope=N)[0]

        def make(H=H, N=N, R=R, C=C, S=S):
            pos = torch.randint(0, S, (1,), generator=g).to(device)
            return _rand((1, 1, H * (N + R)), g, device, dtype), _rand((1, 1, C + R), g, device, dtype), pos

        name = (f"mla_attention[{H} heads x {N}+{R} (v {V}), latent {C}, S={S}, chunk={chunk}, "
                f"{'interleaved' if interleave else 'half'} rope{f' x{rope_scale}' if rope_scale != 1.0 else ''}]")
        rows += run_case(name, Region(fn, t), make, "tkcc.mla_attention.default", False, dtype,
                         _options(chunk=chunk, tile=(32, 4)), state=("kc", "rc"))
    return rows
