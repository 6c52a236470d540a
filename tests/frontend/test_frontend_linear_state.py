"""transformers' linear-attention cache layers (gated DeltaNet, short convolutions, Mamba2) captured over
Program.state: Qwen3-Next's state layout, its prompt in transformers' chunks, HF's own greedy tokens and cache
states, replay; OLMo hybrid, LFM2, Nemotron-H and Bamba through the same layer."""
from __future__ import annotations

import pytest
import torch

from tkcc.frontend import capture, greedy, reset_state
from tkcc.frontend.models import build_model

pytest.importorskip("transformers")

INIT = dict(initializer_range=0.3)
MAX_LEN = 160


def rand_ids(n, seed):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen3_next():
    return capture(build_model("qwen3next-tiny", **INIT), max_cache_len=MAX_LEN)


@pytest.mark.parametrize("b,t,h,dk,dv,l2,start", [(1, 1, 2, 8, 8, True, True), (1, 7, 2, 8, 16, True, False),
                                                    (2, 33, 3, 16, 8, False, True), (1, 70, 2, 8, 8, True, True)])
def test_one_chunk_gated_delta_rule_is_the_token_recurrence(b, t, h, dk, dv, l2, start):
    """The whole step as one chunk against transformers' per-token recurrence (its decode form), fresh inputs, from a
    random state and from none; T past transformers' chunk of 64 too. Both compute in float32 whatever the inputs."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    from tkcc.frontend.hf_gated_delta import chunk_gated_delta_rule

    g = torch.Generator().manual_seed(t)
    q, k = (torch.randn(b, t, h, dk, generator=g) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g)
    decay = -torch.rand(b, t, h, generator=g)
    beta = torch.rand(b, t, h, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g) if start else None
    out, new = chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=state, output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2)
    ref, ref_state = torch_recurrent_gated_delta_rule(q, k, v, decay, beta, initial_state=state,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=l2)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(new, ref_state, rtol=1e-4, atol=1e-5)
    assert chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=state)[1] is None


def test_linear_layers_keep_conv_window_and_recurrent_state_each_in_its_dtype():
    """A gated DeltaNet layer keeps its conv window in the model's dtype and its recurrent state in float32 (as
    transformers' cache does); an attention layer keeps keys and values."""
    prog = capture(build_model("qwen3next-tiny", dtype=torch.bfloat16), max_cache_len=32, phases=["decode"])
    cfg = prog.model.config
    assert [prog.state.kind(i) for i in range(4)] == ["recurrent"] * 3 + ["attention"]
    conv, rec = prog.state.state(0, "conv_0"), prog.state.state(0, "recurrent_0")
    channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * \
        cfg.linear_value_head_dim
    assert conv.shape == (2, 1, channels, cfg.linear_conv_kernel_dim) and conv.dtype == torch.bfloat16
    assert rec.shape == (2, 1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    assert rec.dtype == torch.float32
    assert prog.meta["state_layout"][0]["state_dtypes"] == {"recurrent_0": "float32"}


def test_prompts_go_in_transformers_chunks_and_tokens_are_hf_generate(qwen3_next):
    """Prompts shorter than a chunk, across one chunk boundary and two: HF's own greedy tokens."""
    prog = qwen3_next
    assert prog.meta["prefill_chunk"] == 64
    model = prog.model
    for n, seed in ((5, 3), (70, 4), (130, 5)):
        ids = rand_ids(n, seed)
        ref = model.generate(ids, max_new_tokens=10, do_sample=False)[:, n:]
        assert len(set(ref[0].tolist())) > 1, "degenerate test: the model repeats one token"
        assert torch.equal(greedy(prog, ids, 10), ref), n


def test_the_state_a_prompt_leaves_is_the_one_hf_caches_and_decode_replays(qwen3_next):
    prog = qwen3_next
    ids = rand_ids(9, 7)
    with torch.no_grad():
        reset_state(prog)
        prog.graphs["prefill"](ids, torch.arange(9))
        own = prog.model(input_ids=ids, use_cache=True).past_key_values
        for i in range(3):  # slot 9 % 2 holds the state after 9 tokens
            torch.testing.assert_close(prog.state.state(i, "conv_0")[1], own.layers[i].conv_states[0])
            torch.testing.assert_close(prog.state.state(i, "recurrent_0")[1], own.layers[i].recurrent_states[0],
                                       atol=1e-5, rtol=1e-5)
        before = [b.clone() for b in prog.state.buffers()]
        got = prog.graphs["decode"](ids[:, :1], torch.tensor([9]))
        assert not torch.equal(prog.state.state(0, "recurrent_0")[0], before_buffer(prog, before, 0)[0])
        again = prog.graphs["decode"](ids[:, :1], torch.tensor([9]))  # reads the slot it read the first time
        assert torch.equal(again, got)
        for b, s in zip(prog.state.buffers(), before):
            b.copy_(s)
        assert torch.equal(prog.eager(ids[:, :1], torch.tensor([9])), got)  # the graph is the eager step


def test_a_fresh_prompt_ignores_what_the_linear_state_holds(qwen3_next):
    prog = qwen3_next
    ids = rand_ids(6, 8)
    with torch.no_grad():
        reset_state(prog)
        ref = prog.graphs["prefill"](ids, torch.arange(6))
        prog.state.fill_random(9, torch.Generator().manual_seed(1))
        assert torch.equal(prog.graphs["prefill"](ids, torch.arange(6)), ref)


def before_buffer(prog, before, layer):
    names = [n for n, _b in prog.state.named_buffers()]
    return before[names.index(f"state_{layer}_recurrent_0")]


def test_the_override_is_in_place_during_a_step_only(qwen3_next):
    """The chunked rule the gated DeltaNet's forward resolves (in its modeling file's globals) is tkcc's inside a
    step and transformers' own after it."""
    import inspect

    from tkcc.frontend.hf_gated_delta import chunk_gated_delta_rule

    prog = qwen3_next
    mod = prog.model.model.layers[0].linear_attn
    ns = inspect.unwrap(type(mod).forward).__globals__
    own = ns["torch_chunk_gated_delta_rule"]
    seen = []
    hook = mod.register_forward_pre_hook(lambda m, a: seen.append(ns["torch_chunk_gated_delta_rule"]))
    try:
        with torch.no_grad():
            prog.eager(rand_ids(4, 1), torch.arange(4))
    finally:
        hook.remove()
    assert seen == [chunk_gated_delta_rule]
    assert ns["torch_chunk_gated_delta_rule"] is own


@pytest.mark.parametrize("model_type,extra,chunk", [
    ("lfm2", dict(layer_types=["conv", "full_attention"]), None),  # a short convolution's window: prompts in one step
    ("olmo_hybrid", dict(layer_types=["linear_attention", "full_attention"]), 64),  # gated DeltaNet, another file
    # Mamba2 (its chunked scan as one chunk of the step; prompts in steps of the layer's chunk_size)
    ("nemotron_h", dict(layer_types=["linear_attention", "full_attention"], mamba_num_heads=4, mamba_head_dim=16,
                        ssm_state_size=16, n_groups=1, chunk_size=32), 32),
    ("bamba", dict(num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                   mamba_chunk_size=32), 32),
])
def test_other_families_through_the_same_layer_give_hf_tokens(model_type, extra, chunk):
    import transformers

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=len(extra.get("layer_types", ())),
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, initializer_range=0.3,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = transformers.AutoConfig.for_model(model_type, **{**kw, **extra})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    prog = capture(model, max_cache_len=MAX_LEN)
    assert prog.state.kind(0) == "recurrent" and prog.state.kind(1) == "attention"
    assert prog.meta["prefill_chunk"] == chunk
    for n, seed in ((5, 3), (70, 4)):
        ids = rand_ids(n, seed)
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)[:, n:]
        assert len(set(ref[0].tolist())) > 1, "degenerate test: the model repeats one token"
        assert torch.equal(greedy(prog, ids, 8), ref), n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qwen3_next_bf16_on_gpu_is_hf_teacher_forced():
    """bf16 on the GPU: fed HF's own greedy tokens, each step's logits (a prompt over two of transformers' chunks,
    then decode steps) are HF's full forward's within bf16 rounding, and the token each chooses is HF's wherever
    HF's top-2 gap is beyond that rounding."""
    from tkcc.frontend.generate import greedy_steps

    model = build_model("qwen3next-tiny", dtype=torch.bfloat16, device="cuda", **INIT)
    prog = capture(model, max_cache_len=MAX_LEN)
    n, steps = 70, 12
    ids = rand_ids(n, 4).cuda()
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=steps, do_sample=False)
        ref = model(full).logits[0, n - 1:n - 1 + steps].float()
        got = torch.stack([last[0].float().clone() for _tok, last in
                           greedy_steps(prog, ids, steps, force=full[:, n:])])
    err = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(err.max()) < 0.05, err
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.03 * ref.abs().amax(-1)
    assert int(clear.sum()) >= steps // 2, clear
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_a_state_mamba_updates_in_place_is_written_and_decode_gives_hf_tokens():
    """Nemotron-H's Mamba2 layer updates its recurrent state in place on a one-token step (transformers'
    ``selective_state_update``) and never hands it back: the step writes it all the same, so decoding a prompt
    token by token, then generating, gives HF's own greedy tokens (the decode step alone: a prompt step hands its
    state back)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "nemotron_h", hidden_size=64, intermediate_size=128, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=1, vocab_size=256, initializer_range=0.3, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    prog = capture(model, phases=["decode"], max_cache_len=32)
    assert [prog.state.kind(i) for i in range(2)] == ["recurrent", "attention"]
    ids = rand_ids(6, 3)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)[0, 6:].tolist()
    assert len(set(ref)) > 1, "degenerate test: the model repeats one token"
    reset_state(prog)
    got, tok = [], None
    with torch.no_grad():
        for p in range(6 + 8 - 1):
            logits = prog.graphs["decode"](ids[:, p:p + 1] if p < 6 else tok, torch.tensor([p]))
            tok = logits[:, -1].argmax(-1, keepdim=True)
            if p >= 5:
                got.append(int(tok))
    assert got == ref
