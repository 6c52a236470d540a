"""Run under TRITON_INTERPRET=1 (by test_decode_decoder.py): the fused decoder's greedy tokens and logits
against the HF model on tiny models, fp32 on CPU. Prints one JSON line per model."""
import json
import sys

import torch

from tkcc.frontend.models import build_model
from tkcc.kernels.common import fallbacks
from tkcc.kernels.decoder import FusedDecoder

for name in sys.argv[1:]:
    m = build_model(name, torch.float32, "cpu", seed=int(torch.randint(0, 1000, (1,))))
    prompt = torch.randint(0, m.config.vocab_size, (3,)).tolist()
    new = 2
    with torch.no_grad():
        ref = m.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False)[0, len(prompt):].tolist()
        ref_logits = m(torch.tensor([prompt])).logits[0, -1]
    dec = FusedDecoder(m, max_cache_len=16)
    got = dec.generate(prompt, new)
    dec2 = FusedDecoder(m, max_cache_len=16)
    dec2.generate(prompt, 1)
    err = float((dec2.logits - ref_logits).norm() / ref_logits.norm())
    print(json.dumps(dict(model=name, ref=ref, got=got, logits_rel_err=err, fallbacks=fallbacks())), flush=True)
