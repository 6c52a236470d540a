"""torch.compile(model, backend="tkcc") matches eager on a small module and a tiny HF model."""
import torch

import tkcc.frontend.backend as backend


def test_backend_small_module_matches_eager():
    backend.register()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(16, 32)
            self.n = torch.nn.LayerNorm(32)

        def forward(self, x):
            y = self.l(x)
            return self.n(torch.relu(y) * 2.0 + torch.relu(y) * 2.0).sum(-1)

    torch.manual_seed(0)
    m = M().eval()
    c = torch.compile(m, backend="tkcc")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 16, generator=gen)
            assert torch.equal(c(x), m(x))


def test_backend_tiny_hf_model_matches_eager():
    from tkcc.frontend.models import build_model

    backend.register()
    lm = build_model("llama-tiny")
    c = torch.compile(lm, backend="tkcc")
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = lm(ids, use_cache=False).logits
        out = c(ids, use_cache=False).logits
    assert torch.equal(out, ref)
