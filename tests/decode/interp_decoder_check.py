"""Run under TRITON_INTERPRET=1 (by test_decode_decoder.py): the fused decoder's greedy tokens and logits
against the HF model on tiny models, fp32 on CPU. Prints one JSON line per model.

An argument ``name:opt+opt`` turns decoder options on (``fused_attention``, ``routed_moe``; ``chunk4``: split-KV
chunks of 4 positions, so the split/combine paths run on these short prompts; ``tile16``: attention kernels
stepping 16 positions with 2 warps)."""
import json
import sys

import torch

from tkcc.frontend.generate import greedy_loop
from tkcc.frontend.models import build_model
from tkcc.kernels.common import fallbacks
from tkcc.kernels.decoder import FusedDecoder

for arg in sys.argv[1:]:
    name, _, opts = arg.partition(":")
    opts = [o for o in opts.split("+") if o]
    kw = {o: True for o in opts if o not in ("chunk4", "tile16")}
    if "chunk4" in opts:
        kw["attn_chunk"] = 4
    if "tile16" in opts:
        kw["attn_tile"] = (16, 2)
    m = build_model(name, torch.float32, "cpu", seed=int(torch.randint(0, 1000, (1,))))
    prompt = torch.randint(0, m.config.vocab_size, (3,)).tolist()
    new = 2
    with torch.no_grad():
        ref = m.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False)[0, len(prompt):].tolist()
        ref_logits = m(torch.tensor([prompt])).logits[0, -1]
    dec = FusedDecoder(m, max_cache_len=16, **kw)
    steps = list(greedy_loop({"prefill": dec.forward, "decode": dec.forward}, torch.tensor([prompt]), new,
                             max_cache_len=dec.max_cache_len, prefill_chunk=1))  # the prompt fed token by token
    got = [int(t) for t, _ in steps]
    err = float((steps[0][1][0] - ref_logits).norm() / ref_logits.norm())
    print(json.dumps(dict(model=name, options=opts, ref=ref, got=got, logits_rel_err=err, fallbacks=fallbacks())),
          flush=True)
