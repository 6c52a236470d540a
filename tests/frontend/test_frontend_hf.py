"""Capture of Hugging Face causal LMs: whole graphs per phase, numerics vs eager, layer map, truncation, greedy."""
from __future__ import annotations

import pytest
import torch

from tkcc.errors import TkccError
from tkcc.frontend import capture, capture_model, greedy, reset_state
from tkcc.frontend.fingerprint import model_fingerprint
from tkcc.frontend.models import build_model
from tkcc.traffic.workload import Bucket

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama-tiny", "mixtral-tiny", "qwen3moe-tiny", "olmoe-tiny", "qwen2moe-tiny", "deepseekv3-tiny",
            "minimax-tiny"]
MAX_LEN = 32
# Larger init than the default 0.02 so random-weight models produce varied tokens (greedy is a real check).
INIT = dict(initializer_range=0.3)

_cache: dict = {}


def program(name: str, batch: int = 1):
    key = (name, batch)
    if key not in _cache:
        model = build_model(name, **INIT)
        _cache[key] = capture(model, max_cache_len=MAX_LEN, batch=batch)
    return _cache[key]


def rand_ids(shape, seed=0, vocab=256):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def first_attention(prog) -> int:
    return prog.state.attention_layers[0]


def snapshot(prog):
    return [b.clone() for b in prog.state.buffers()]


def restore(prog, snap):
    with torch.no_grad():
        for b, s in zip(prog.state.buffers(), snap):
            b.copy_(s)


@pytest.mark.parametrize("name", FAMILIES)
def test_one_whole_graph_per_phase(name):
    prog = program(name)
    assert prog.phases == ["prefill", "decode"]
    n_layers = prog.model.config.num_hidden_layers
    for phase, gm in prog.graphs.items():
        assert isinstance(gm, torch.fx.GraphModule)
        ops = {n.op for n in gm.graph.nodes}
        assert "call_module" not in ops, f"{phase}: a graph break or submodule call left in the graph"
        assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["input_ids", "cache_position"]
        # Every attention layer writes its keys and values into the static cache, in place, inside the one
        # graph; every recurrent layer overwrites its state.
        writes = [str(n.args[0].target) for n in gm.graph.nodes
                  if n.op == "call_function" and n.target is torch.ops.aten.index_copy_.default]
        assert len([w for w in writes if w.startswith(("kv.key_", "kv.value_"))]) == \
            2 * len(prog.state.attention_layers)
        recurrent = [i for i in range(n_layers) if prog.state.kind(i) == "recurrent"]
        assert sorted(w for w in writes if w.startswith("kv.state_")) == [f"kv.state_{i}_linear" for i in recurrent]
        assert len(writes) == 2 * len(prog.state.attention_layers) + len(recurrent)
        assert "def forward(self, input_ids, cache_position)" in gm.code
    assert prog.meta["family"] in ("llama", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3", "minimax")
    assert [d["kind"] for d in prog.meta["state_layout"]] == [prog.state.kind(i) for i in range(n_layers)]
    assert prog.meta["num_layers"] == prog.num_blocks == n_layers
    assert prog.meta["max_cache_len"] == MAX_LEN and prog.meta["batch"] == 1 and prog.meta["exact"] is True


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_then_decode_matches_eager_hf(name):
    prog = program(name)
    model = prog.model
    ids = rand_ids((1, 6), seed=1)
    with torch.no_grad():
        reset_state(prog)
        got = prog.graphs["prefill"](ids, torch.arange(6))
        out = model(input_ids=ids, use_cache=True)  # with the cache the model builds itself (generate's)
        ref, dyn = out.logits, out.past_key_values
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        tok = got[:, -1:].argmax(-1)
        for step in range(4):
            snap = snapshot(prog)
            got = prog.graphs["decode"](tok, torch.tensor([6 + step]))
            # positions given, as generate does (MiniMaxCache counts them on layer 0, a linear layer: none)
            ref = model(input_ids=tok, past_key_values=dyn, use_cache=True,
                        position_ids=torch.tensor([[6 + step]])).logits
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
            # Bit-exact against the eager step module on the same cache contents.
            after = snapshot(prog)
            restore(prog, snap)
            eager = prog.eager(tok, torch.tensor([6 + step]))
            assert torch.equal(got, eager)
            assert all(torch.equal(a, b) for a, b in zip(after, snapshot(prog)))
            tok = got[:, -1:].argmax(-1)


@pytest.mark.parametrize("name", ["llama-tiny", "olmoe-tiny", "deepseekv3-tiny", "minimax-tiny"])
def test_chunked_prefill_is_exact_vs_eager(name):
    """A prefill that continues a cache (start > 0) takes the same path as eager: bitwise equal."""
    prog = program(name)
    with torch.no_grad():
        reset_state(prog)
        prog.graphs["prefill"](rand_ids((1, 5), seed=2), torch.arange(5))
        snap = snapshot(prog)
        chunk, pos = rand_ids((1, 4), seed=3), torch.arange(5, 9)
        got = prog.graphs["prefill"](chunk, pos)
        restore(prog, snap)
        assert torch.equal(got, prog.eager(chunk, pos))


@pytest.mark.parametrize("name", FAMILIES)
def test_layer_map_covers_every_block(name):
    prog = program(name)
    for phase, gm in prog.graphs.items():
        lmap = prog.layer_map[phase]
        assert set(lmap.values()) == set(range(prog.num_blocks))
        for node in gm.graph.nodes:
            if node.op == "get_attr" and ".layers." in str(node.target):
                assert lmap[node.name] == int(str(node.target).split(".layers.")[1].split(".")[0])
            if node.op == "call_function" and "index_copy_" in str(node.target):
                assert node.name in lmap  # the KV or state write belongs to its layer
        # Embedding and the LM head are outside every block.
        heads = [n for n in gm.graph.nodes if n.op == "get_attr" and "lm_head" in str(n.target)]
        assert all(n.name not in lmap for n in heads)


@pytest.mark.parametrize("name", FAMILIES)
def test_weights_and_cache_are_shared_not_copied(name):
    prog = program(name)
    model_ptrs = {p.data_ptr() for p in prog.model.parameters()}
    state_ptrs = {b.data_ptr() for b in prog.state.buffers()}
    for gm in prog.graphs.values():
        params = list(gm.parameters())
        assert params and all(p.data_ptr() in model_ptrs for p in params)
        kv = [b for n, b in gm.named_buffers() if n.startswith("kv.")]
        assert {b.data_ptr() for b in kv} == state_ptrs
    # Writing through the graph changes the Program's state tensors.
    with torch.no_grad():
        reset_state(prog)
        prog.graphs["decode"](rand_ids((1, 1)), torch.tensor([3]))
    k = prog.state.key(first_attention(prog))
    assert k[:, :, 3].abs().sum() > 0 and k[:, :, 4].abs().sum() == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_hf_generate(name):
    prog = program(name)
    prompt = rand_ids((1, 5), seed=4)
    tokens, logits = greedy(prog, prompt, 10, return_logits=True)
    ref = prog.model.generate(prompt, max_new_tokens=10, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)
    assert torch.equal(tokens, ref.sequences[:, 5:])
    assert len(set(tokens[0].tolist())) > 1, "degenerate test: the model repeats one token"
    torch.testing.assert_close(logits, torch.stack(list(ref.scores), 1).float(), atol=5e-5, rtol=1e-4)
    # A compiled artifact plugs in through `forwards`; the eager step module gives the same tokens.
    again = greedy(prog, prompt, 10, forwards={"decode": prog.eager})
    assert torch.equal(again, tokens)


def test_greedy_one_token_prompt_and_batch():
    prog = program("llama-tiny", batch=2)
    prompt = rand_ids((2, 4), seed=5)
    tokens = greedy(prog, prompt, 6)
    assert tokens.shape == (2, 6)
    for row in range(2):
        ref = prog.model.generate(prompt[row:row + 1], max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens[row], ref[0, 4:])
    one = greedy(prog, prompt[:, :1], 3)
    ref = prog.model.generate(prompt[:1, :1], max_new_tokens=3, do_sample=False)
    assert torch.equal(one[0], ref[0, 1:])
    with pytest.raises(TkccError, match="batch"):
        greedy(prog, prompt[:1], 2)
    with pytest.raises(TkccError, match="max_cache_len"):
        greedy(prog, prompt, MAX_LEN)


def test_make_inputs_for_buckets():
    prog = program("olmoe-tiny")
    gen = torch.Generator().manual_seed(0)
    ids, pos = prog.make_inputs["decode"](Bucket("decode", batch=1, context=10), gen)
    assert ids.shape == (1, 1) and pos.tolist() == [10]
    k = prog.state.key_0
    assert (k[:, :, :10].abs().sum(-1) > 0).all() and k[:, :, 10:].abs().sum() == 0
    ids2, _ = prog.make_inputs["decode"](Bucket("decode", batch=1, context=10), torch.Generator().manual_seed(0))
    assert torch.equal(ids, ids2)
    ids, pos = prog.make_inputs["prefill"](Bucket("prefill", batch=1, context=12), gen)
    assert ids.shape == (1, 12) and pos.tolist() == list(range(12))
    with torch.no_grad():  # the prefill graph takes any length up to max_cache_len
        assert prog.graphs["prefill"](ids, pos).shape == (1, 12, 256)
    assert prog.inputs("prefill")[0].shape == prog.example_inputs["prefill"][0].shape
    with pytest.raises(TkccError, match="batch=4"):
        prog.make_inputs["decode"](Bucket("decode", batch=4, context=3), gen)
    with pytest.raises(TkccError, match="max_cache_len"):
        prog.make_inputs["prefill"](Bucket("prefill", batch=1, context=MAX_LEN + 1), gen)
    with pytest.raises(TkccError, match="phase"):
        prog.make_inputs["prefill"](Bucket("decode", batch=1, context=3), gen)


@pytest.mark.parametrize("name,k", [("llama-tiny", 2), ("olmoe-tiny", 1), ("minimax-tiny", 1)])
def test_truncate_shares_weights_and_matches_truncated_eager(name, k):
    prog = program(name)
    n = prog.num_blocks
    small = prog.truncate(k)
    assert small.num_blocks == k and small.meta["num_layers"] == k and small.meta["truncated_from"] == n
    assert len(small.model.model.layers) == k and small.model.config.num_hidden_layers == k
    # The original is untouched.
    assert len(prog.model.model.layers) == n and prog.model.config.num_hidden_layers == n
    model_ptrs = {p.data_ptr() for p in prog.model.parameters()}
    assert all(p.data_ptr() in model_ptrs for p in small.model.parameters())
    for gm in small.graphs.values():
        assert all(p.data_ptr() in model_ptrs for p in gm.parameters())
    assert {b.data_ptr() for b in small.state.buffers()} <= {b.data_ptr() for b in prog.state.buffers()}
    for phase in small.phases:
        assert set(small.layer_map[phase].values()) == set(range(k))
    assert small.fingerprint != prog.fingerprint
    ids = rand_ids((1, 5), seed=6)
    with torch.no_grad():
        reset_state(small)
        got = small.graphs["prefill"](ids, torch.arange(5))
        ref = small.model(input_ids=ids).logits
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        full = prog.model(input_ids=ids).logits
        assert (got - full).abs().max() > 1e-3  # fewer layers really compute something else
        snap = snapshot(small)
        got = small.graphs["decode"](ids[:, :1], torch.tensor([5]))
        restore(small, snap)
        assert torch.equal(got, small.eager(ids[:, :1], torch.tensor([5])))
    assert prog.truncate(n) is prog
    with pytest.raises(ValueError):
        prog.truncate(n + 1)


def test_fingerprint_tracks_model_dtype_and_settings():
    prog = program("llama-tiny")
    model = prog.model
    settings = dict(phases=["prefill", "decode"], batch=1, max_cache_len=MAX_LEN)
    assert model_fingerprint(model, settings) == prog.fingerprint
    assert model_fingerprint(build_model("llama-tiny", **INIT), settings) == prog.fingerprint
    assert model_fingerprint(model, dict(settings, max_cache_len=64)) != prog.fingerprint
    assert model_fingerprint(build_model("llama-tiny", dtype=torch.float64), settings) != prog.fingerprint
    assert model_fingerprint(build_model("llama-tiny", num_hidden_layers=3), settings) != prog.fingerprint


def test_capture_model_and_bad_arguments():
    prog = capture_model("mixtral-tiny", dtype="float32", max_cache_len=16, phases=["decode"])
    assert prog.phases == ["decode"] and prog.meta["name"] == "mixtral-tiny"
    from tkcc.errors import CaptureError

    with pytest.raises(CaptureError, match="phase"):
        capture(prog.model, phases=["prefill", "verify"])
    with pytest.raises(CaptureError, match="example_inputs"):
        capture(prog.model, example_inputs=(torch.zeros(1, 2, dtype=torch.long),))
    with pytest.raises(CaptureError, match="dtype"):
        capture_model("llama-tiny", dtype="float33")
    with pytest.raises(TkccError, match="unknown model"):
        capture_model("no-such-model")
