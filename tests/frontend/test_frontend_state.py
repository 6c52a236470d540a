"""Program.state beyond one K/V shape: MLA's latent, sliding windows, MiniMax's recurrent state; the state bytes."""
from __future__ import annotations

import pytest
import torch

from tkcc.errors import TkccError
from tkcc.frontend import capture, greedy, reset_state
from tkcc.frontend.kv_cache import LayerState, state_bytes
from tkcc.frontend.models import build_model
from tkcc.traffic.workload import Bucket

pytest.importorskip("transformers")

INIT = dict(initializer_range=0.3)
MAX_LEN = 32


def rand_ids(shape, seed=0):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def minimax():
    return capture(build_model("minimax-tiny", **INIT), max_cache_len=MAX_LEN)


def test_mla_caches_its_latent_and_rotary_key_not_expanded_heads():
    prog = capture(build_model("deepseekv3-tiny", **INIT), max_cache_len=MAX_LEN, phases=["decode"])
    cfg = prog.model.config
    for i in range(cfg.num_hidden_layers):
        assert prog.state.key(i).shape == (1, 1, MAX_LEN, cfg.kv_lora_rank)
        assert prog.state.value(i).shape == (1, 1, MAX_LEN, cfg.qk_rope_head_dim)
    per_pos = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert prog.state.decode_bytes(10) == 10 * per_pos


def test_lightning_block_is_the_token_recurrence():
    """The one-block form of a T-token step against transformers' per-token recurrence, fresh inputs."""
    from tkcc.frontend.hf_minimax import lightning_block

    g = torch.Generator().manual_seed(0)
    for b, h, t, d in [(1, 2, 1, 4), (1, 4, 7, 8), (2, 3, 33, 16)]:
        q, k, v = (torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(3))
        state = torch.randn(b, h, d, d, generator=g, dtype=torch.float64)
        slope = torch.rand(h, 1, 1, generator=g, dtype=torch.float64)
        out, new = lightning_block(q, k, v, state, slope)
        s, ref = state.clone(), []
        for i in range(t):
            s = torch.exp(-slope) * s + k[:, :, i:i + 1].transpose(-1, -2) @ v[:, :, i:i + 1]
            ref.append(q[:, :, i:i + 1] @ s)
        torch.testing.assert_close(out, torch.cat(ref, 2), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(new, s, rtol=1e-10, atol=1e-10)


def test_recurrent_state_lives_in_program_state_and_decode_writes_it_in_place(minimax):
    prog = minimax
    rec = [i for i in range(prog.num_blocks) if prog.state.kind(i) == "recurrent"]
    assert rec == [0, 2] and prog.state.attention_layers == [1, 3]
    cfg = prog.model.config
    s0 = prog.state.state(0, "linear")  # slot p % 2: the state after p tokens
    assert s0.shape == (2, 1, cfg.num_attention_heads, cfg.head_dim, cfg.head_dim)
    with pytest.raises(TkccError, match="layer 0 keeps recurrent state"):
        prog.state.key(0)
    ids = rand_ids((1, 7), seed=1)
    with torch.no_grad():
        reset_state(prog)
        prog.graphs["prefill"](ids, torch.arange(7))
        # the state the prompt left (slot 7 % 2) is the one the model's own cache (MiniMaxCache) holds after it
        own = prog.model(input_ids=ids, use_cache=True).past_key_values
        for i in rec:
            torch.testing.assert_close(prog.state.state(i, "linear")[1], own.linear_cache[i], atol=1e-5, rtol=1e-5)
        assert s0[0].abs().sum() == 0
        before = [b.clone() for b in prog.state.buffers()]
        ptr = s0.data_ptr()
        got = prog.graphs["decode"](ids[:, :1], torch.tensor([7]))
        assert s0.data_ptr() == ptr and s0[0].abs().sum() > 0 and torch.equal(s0[1], before_slot(prog, before, 1))
        # replayed, the decode step reads the slot it read the first time: the same logits and state
        again = prog.graphs["decode"](ids[:, :1], torch.tensor([7]))
        assert torch.equal(again, got)
        after = [b.clone() for b in prog.state.buffers()]
        for b, s in zip(prog.state.buffers(), before):
            b.copy_(s)
        assert torch.equal(prog.eager(ids[:, :1], torch.tensor([7])), got)  # the graph is the eager step
        assert all(torch.equal(a, b) for a, b in zip(after, prog.state.buffers()))


def test_a_fresh_prompt_ignores_what_the_state_holds(minimax):
    prog = minimax
    ids = rand_ids((1, 5), seed=3)
    with torch.no_grad():
        reset_state(prog)
        ref = prog.graphs["prefill"](ids, torch.arange(5))
        prog.state.fill_random(9, torch.Generator().manual_seed(1))
        assert torch.equal(prog.graphs["prefill"](ids, torch.arange(5)), ref)


def before_slot(prog, before, slot):
    names = [n for n, _b in prog.state.named_buffers()]
    return before[names.index("state_0_linear")][slot]


def test_decode_bucket_fills_recurrent_state_too(minimax):
    prog = minimax
    prog.make_inputs["decode"](Bucket("decode", batch=1, context=5), torch.Generator().manual_seed(0))
    assert prog.state.state(0, "linear").abs().sum() > 0
    k = prog.state.key(1)
    assert (k[:, :, :5].abs().sum(-1) > 0).all() and k[:, :, 5:].abs().sum() == 0
    prog.make_inputs["decode"](Bucket("decode", batch=1, context=0), torch.Generator().manual_seed(0))
    assert prog.state.state(0, "linear").abs().sum() == 0


def test_sliding_window_layers_match_hf_beyond_the_window():
    """Qwen2-MoE with its sliding window on (layer 0 sliding, layer 1 full): the same greedy tokens as HF's own
    generate over a context well past the window, and not those of the model without the window."""
    kw = dict(INIT, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    model = build_model("qwen2moe-tiny", **kw)
    prog = capture(model, max_cache_len=MAX_LEN)
    assert [ls.window for ls in prog.state.layout] == [4, None]
    prompt = rand_ids((1, 9), seed=2)
    tokens = greedy(prog, prompt, 10)
    assert torch.equal(tokens, model.generate(prompt, max_new_tokens=10, do_sample=False)[:, 9:])
    plain = build_model("qwen2moe-tiny", **INIT)
    assert not torch.equal(tokens, plain.generate(prompt, max_new_tokens=10, do_sample=False)[:, 9:])


def test_state_bytes_counts_what_a_step_must_move():
    f32 = torch.float32
    layout = [LayerState("attention", f32, key=(2, 16), value=(2, 8)),
              LayerState("attention", f32, key=(2, 16), value=(2, 16), window=4),
              LayerState("recurrent", f32, states=(("linear", (3, 16, 16)),)),
              LayerState("none")]
    assert state_bytes(layout, 10) == 10 * (32 + 16) * 4 + 4 * (32 + 32) * 4 + 2 * 3 * 256 * 4
    assert state_bytes(layout, 2, batch=2) == 2 * (2 * (48 + 64) * 4 + 2 * 3 * 256 * 4)
    with pytest.raises(ValueError, match="kind"):
        LayerState("conv")


@pytest.mark.parametrize("name", ["llama-tiny", "deepseekv3-tiny", "qwen2moe-tiny"])
def test_bytes_per_token_reads_active_weights_once(name):
    """Weights: all but the untied embedding table (one row) and the unchosen routed experts; state: the probe's."""
    from tkcc.frontend.decode_bytes import bytes_per_token

    model = build_model(name)
    cfg = model.config
    every = sum(p.numel() for p in model.parameters())
    experts = [p for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    unread = sum(p.numel() - p.numel() * cfg.num_experts_per_tok // p.shape[0] for p in experts)
    if not cfg.tie_word_embeddings:
        unread += (cfg.vocab_size - 1) * cfg.hidden_size
    got = bytes_per_token(model, 10)
    assert got["weights"] == (every - unread) * 4
    prog = capture(model, max_cache_len=MAX_LEN, phases=["decode"])
    assert got["state"] == prog.state.decode_bytes(10) > 0
    assert got["total"] == got["weights"] + got["state"]


def test_sparse_attention_indexer_keys_live_in_the_state_and_tokens_are_hf_generate():
    """DeepSeek V3.2's sparse attention (DSA) caches its indexer's keys per position beside the MLA latent: they are
    a buffer of Program.state written at the step's positions, and with the indexer choosing 8 of the positions
    (fewer than the prompt) the greedy tokens are HF's own."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "deepseek_v32", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=256, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, index_topk=8, initializer_range=0.3, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    cfg.head_dim = cfg.qk_rope_head_dim  # MLA: the rotary part's
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    prog = capture(model, max_cache_len=64)
    dim = prog.state.layout[0].indexer
    assert dim == cfg.index_head_dim and prog.state.indexer(0).shape == (1, 64, dim)
    for n, seed in ((5, 3), (40, 4)):
        ids = rand_ids((1, n), seed=seed)
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)[:, n:]
        assert len(set(ref[0].tolist())) > 1, "degenerate test: the model repeats one token"
        assert torch.equal(greedy(prog, ids, 8), ref), n
    written = prog.state.indexer(0)[0, :47].abs().sum(-1)
    assert (written > 0).all() and prog.state.indexer(0)[0, 47:].abs().sum() == 0
