"""Small modules and a capture helper shared by the codegen tests (no test functions here)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


class RMSNorm(torch.nn.Module):
    """The HF Llama RMSNorm pattern: to fp32, pow 2, mean, add eps, rsqrt, mul, cast back, weight."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        v = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(v + self.eps)
        return self.weight * h.to(dt)


class Block(torch.nn.Module):
    """RMSNorm -> gate/up -> SiLU * up -> down, plus a softmax head and a residual elementwise tail."""

    def __init__(self, d=32, f=48):
        super().__init__()
        self.norm = RMSNorm(d)
        self.gate = torch.nn.Linear(d, f, bias=False)
        self.up = torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        h = self.norm(x)
        y = self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
        r = x + y
        z = (r * self.scale - 0.25) / 1.5
        return torch.softmax(z, -1), torch.where(z > 0, z, -z) + r.neg()


class Pointwise(torch.nn.Module):
    """Only correctly rounded ops: what the exact variant fuses end to end."""

    def __init__(self, d=32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d))

    def forward(self, x, y):
        a = (x * self.w + y) / (y.abs() + 1.5)
        b = torch.where(a > 0.1, a, a * a - x)
        return (b - 0.5 * y).reciprocal().neg() + a, b * 3 + torch.pow(a, -2)


class DecodeTail(torch.nn.Module):
    """A shared expert's sigmoid gate after a decode step's MoE block (Qwen2-MoE), with the reshape of [1, H] to
    [1, 1, H] between its adds: a view of leading size-1 dims, which the fused kernel takes."""

    def forward(self, h, g, y, m):
        return h + (m + torch.sigmoid(g) * y).reshape(1, 1, -1)


def variant_shapes(kernel_node):
    """Input shape lists for the kernel: the captured one, more rows, odd sizes, one row."""
    shapes = [list(a.meta["val"].shape) for a in kernel_node.args]
    nd = max(len(s) for s in shapes)
    S = [1] * nd
    for s in shapes:
        for i, d in enumerate(s):
            S[nd - len(s) + i] = max(S[nd - len(s) + i], int(d))
    out = [shapes]
    for new in ([3 if d > 1 else 1 for d in S[:-1]] + [37 if S[-1] > 1 else 1],
                [1 if d > 1 else 1 for d in S[:-1]] + [S[-1]],
                [5 if d > 1 else 1 for d in S[:-1]] + [S[-1] * 2 + 1 if S[-1] > 1 else 1]):
        out.append([[new[nd - len(s) + i] if int(d) > 1 else 1 for i, d in enumerate(s)] for s in shapes])
    return out


def rand_like_meta(val, shape, gen, device="cpu"):
    """Fresh random inputs shaped ``shape`` with the dtype of a node's example value."""
    if val.dtype == torch.bool:
        return (torch.rand(shape, generator=gen) > 0.5).to(device)
    if not val.dtype.is_floating_point:
        return torch.randint(-5, 5, shape, generator=gen, dtype=val.dtype).to(device)
    return (torch.randn(shape, generator=gen) * 2).to(val.dtype).to(device)


def same(a, b, exact):
    if exact:
        return bool(a.shape == b.shape and a.dtype == b.dtype and torch.equal(
            torch.nan_to_num(a.float(), nan=12345.0), torch.nan_to_num(b.float(), nan=12345.0))
            and torch.equal(a.isnan(), b.isnan()))
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}[a.dtype] if a.dtype.is_floating_point else 0
    return bool(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol, equal_nan=True))


def capture(module, inputs, phase="forward"):
    """A Program for a plain module: the real frontend when it has landed, else export + Program."""
    import tkcc.frontend as fe

    if hasattr(fe, "capture"):
        return fe.capture(module, example_inputs=tuple(inputs))
    from tkcc.frontend.export import export_graph
    from tkcc.frontend.program import Program

    gm, _ = export_graph(module, tuple(inputs))
    return Program(graphs={phase: gm}, example_inputs={phase: tuple(inputs)}, layer_map={phase: {}}, num_blocks=0,
                   model=module, fingerprint=f"test-{type(module).__name__}")


def run_python(code: str, env_extra: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter from the repo root; fail with its output if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc
