"""Shared fixtures for the core pipeline tests: one captured tiny LM per session (capture takes seconds)."""
import pytest
import torch


@pytest.fixture(scope="session")
def llama_program():
    from tkcc.frontend import capture_model

    return capture_model("llama-tiny")  # default max_cache_len, as the repository golden was recorded


@pytest.fixture(scope="session")
def small_program():
    """A plain module with a linear layer, a norm and a repeated subexpression, captured by the frontend."""
    from tkcc.frontend import capture

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 32)
            self.norm = torch.nn.LayerNorm(32)

        def forward(self, x):
            y = self.lin(x)
            a = torch.relu(y) * 2.0
            b = torch.relu(y) * 2.0  # the same computation again: CSE merges it
            z = (a + b).pow(2)
            return self.norm(z) + 1.0

    torch.manual_seed(0)
    return capture(Small().eval(), example_inputs=(torch.randn(4, 16),))
