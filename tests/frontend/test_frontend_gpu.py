"""Capture on an NVIDIA GPU: tiny models against HF eager, and the BENCH.md reference models (capture time, exactness).

Run on the GPU machine: python -m pytest -q -s -m gpu tests/frontend
"""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["llama-tiny", "olmoe-tiny", "mixtral-tiny", "qwen3moe-tiny", "qwen2moe-tiny",
                                  "deepseekv3-tiny", "minimax-tiny"])
def test_tiny_greedy_matches_hf_on_gpu(name):
    from tkcc.frontend import capture, greedy
    from tkcc.frontend.models import build_model

    model = build_model(name, device="cuda", initializer_range=0.3)
    prog = capture(model, max_cache_len=64)
    assert prog.meta["device"].startswith("cuda")
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0)).cuda()
    tokens = greedy(prog, prompt, 12)
    ref = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(tokens, ref[:, 6:])


@pytest.mark.parametrize("name", ["olmoe-16l", "llama-1b-16l", "mixtral-16l", "qwen3moe-16l", "qwen2moe-16l",
                                  "deepseekv3-16l", "minimax-16l", "gptoss-8l"])
def test_reference_model_capture_on_gpu(name):
    from tkcc.frontend import capture, greedy
    from tkcc.frontend.models import build_model
    from tkcc.traffic.workload import Bucket

    t0 = time.perf_counter()
    model = build_model(name, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    t_build = time.perf_counter() - t0
    mem0 = torch.cuda.memory_allocated()
    prog = capture(model, max_cache_len=4096)
    t_capture = prog.meta["capture_seconds"]
    extra = torch.cuda.memory_allocated() - mem0
    kv_bytes = sum(b.numel() * b.element_size() for b in prog.state.buffers())
    # Capture allocates the KV cache and nothing weight-sized.
    assert extra <= kv_bytes + (64 << 20), f"capture allocated {extra / 2**20:.0f} MiB beyond the KV cache"
    # Decode at a bucket's context: graph and eager step agree bit for bit on the same cache contents.
    ids, pos = prog.make_inputs["decode"](Bucket("decode", batch=1, context=1000), torch.Generator().manual_seed(0))
    snap = [b.clone() for b in prog.state.buffers()]
    with torch.no_grad():
        got = prog.graphs["decode"](ids, pos)
        for b, s in zip(prog.state.buffers(), snap):
            b.copy_(s)
        ref = prog.eager(ids, pos)
    assert torch.equal(got, ref)
    t1 = time.perf_counter()
    tokens = greedy(prog, torch.randint(0, 1000, (1, 32)).cuda(), 8)
    torch.cuda.synchronize()
    t_greedy = time.perf_counter() - t1
    assert tokens.shape == (1, 8)
    print(f"\n[frontend-gpu] {name}: build {t_build:.1f}s, capture {t_capture:.1f}s (prefill+decode), "
          f"KV cache {kv_bytes / 2**20:.0f} MiB, greedy 32+8 on graphs {t_greedy:.2f}s, "
          f"nodes {dict((p, len(g.graph.nodes)) for p, g in prog.graphs.items())}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    assert t_capture < 180
