"""Families beyond the registered ones, as tiny random Hugging Face models (2 layers, 64 wide), with what
``lowered_decode`` lowers in each decode graph: shared by test_lowered_families.py (in-process, bit-exact off the
kernel path) and interp_lowered_families.py (greedy tokens with the kernels live under the Triton interpreter).

Each entry: how to build the model, the kernel ops the lowered decode graph holds (every ``torch.ops.tkcc`` kind,
with its count: a region claimed lowered that is not, or one more op than claimed, fails), and the aten ops allowed
to stay (anything else left in aten fails too).
"""
from __future__ import annotations

import contextlib
import os

import torch

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
A, G, GG, N, L = ("tkcc.attention_rope.default", "tkcc.gemv.default", "tkcc.gemv_gather.default",
                  "tkcc.rms_norm.default", "tkcc.layer_norm.default")

# name -> (registry name or (config class, model class, config overrides), kernel ops, aten ops allowed to stay)
FAMILIES = {
    # per-head sinks, sliding/full layers, q/k/v/o biases, YaRN over a half table; its MoE block (a biased router, top-k
    # then softmax, transposed biased experts, a clamped SwiGLU over interleaved gate / up) as tkcc.moe_gptoss
    "gpt-oss": ("gptoss-tiny", {A: 2, G: 4, GG: 1, N: 2, "tkcc.moe_gptoss.default": 2}, {"aten.add.Tensor"}),
    # partial rotary of a packed q|k|v (sliced), packed gate|up halved by chunk
    "phi3": (("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5)), {A: 2, G: 8, GG: 1}, set()),
    # 1 + w norms (sandwich: the residual adds stay), embedding scaled, final logit softcapping, sliding window
    "gemma2": (("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=8)), {A: 2, G: 9, N: 9},
               {"aten.add.Tensor", "aten.div.Tensor", "aten.embedding.default", "aten.mul.Tensor",
                "aten.tanh.default"}),
    # + per-head 1 + w q/k norms on the transposed heads
    "gemma3": (("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=8)), {A: 2, G: 9, N: 9},
               {"aten.add.Tensor", "aten.embedding.default", "aten.mul.Tensor"}),
    # per-head q/k norms (dense)
    "qwen3": (("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)), {A: 2, G: 8, GG: 1}, set()),
    # embedding / residual / attention / logits multipliers (stay as scalar products; at the default 1 the products
    # go, so the embedding feeds the first GEMV and the residual adds fold into the GEMVs)
    "granite": (("GraniteConfig", "GraniteForCausalLM", dict()), {A: 2, G: 8, GG: 1},
                {"aten.add.Tensor", "aten.div.Tensor", "aten.embedding.default", "aten.mul.Tensor"}),
    # LayerNorm, partial rotary, heads viewed by explicit counts
    "stablelm": (("StableLmConfig", "StableLmForCausalLM", dict()), {A: 2, G: 9, L: 5}, {"aten.embedding.default"}),
    # q/k RMSNorms over each head after the heads are transposed (a sliding layer rotates; the global one does not:
    # NoPE); norms after attention and MLP (the residual adds stay)
    "exaone4": (("Exaone4Config", "Exaone4ForCausalLM", dict(sliding_window=8, layer_types=["sliding_attention",
                                                                                          "full_attention"])),
                {A: 2, G: 9, N: 4},
                {"aten.add.Tensor", "aten.embedding.default"}),
    # GLM's interleaved pairs over the whole head, written without slices
    "helium": (("HeliumConfig", "HeliumForCausalLM", dict(head_dim=16)), {A: 2, G: 8, GG: 1}, set()),
    # LayerNorm with biases, a non-gated MLP whose up projection's tanh-GELU is its GEMV's epilogue
    "starcoder2": (("Starcoder2Config", "Starcoder2ForCausalLM", dict()), {A: 2, G: 9, L: 5}, {"aten.embedding.default"}),
    # LayerNorm1P (1 + w: its add stays), relu² after a non-gated up projection (the GEMV's epilogue)
    "nemotron": (("NemotronConfig", "NemotronForCausalLM", dict()), {A: 2, G: 9, L: 5},
                 {"aten.add.Tensor", "aten.embedding.default"}),
    # per-head [q_h | k_h | v_h] rows of one fused projection (its GEMV stores them as [q | k | v]), partial rotary
    # (a quarter of each head), LayerNorms with biases, a parallel residual, the GELU up projection
    "gpt-neox": (("GPTNeoXConfig", "GPTNeoXForCausalLM", dict()), {A: 2, G: 9, L: 5},
                 {"aten.add.Tensor", "aten.embedding.default"}),
    # linears written ``x @ W.T`` (canonicalised to F.linear: its q|k|v and MLP up packed into one GEMV, both read
    # the same norm, so the GELU stays), parallel attention; multi-query: the key and value heads indexed out of the
    # fused heads by list constants, the one key head broadcast by sdpa
    "falcon": (("FalconConfig", "FalconForCausalLM", dict()), {A: 2, G: 7, L: 3},
               {"aten.add.Tensor", "aten.add_.Tensor", "aten.embedding.default", "aten.gelu.default"}),
    # learned positions (no rotation: the fused attention given no frequencies), q|k|v split evenly; its Conv1D
    # projections (addmm over a weight stored [in, out]) and written-out tanh-GELU stay
    "gpt2": (("GPT2Config", "GPT2LMHeadModel", dict()), {A: 2, G: 1, L: 5},
             {"aten.add.Tensor", "aten.addmm.default", "aten.embedding.default", "aten.mul.Tensor",
              "aten.pow.Tensor_Scalar", "aten.tanh.default"}),
    # multi-query with learned positions: the one key and value head split off an unsqueezed projection
    "gpt-bigcode": (("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(multi_query=True)), {A: 2, G: 9, L: 5},
                    {"aten.add.Tensor", "aten.embedding.default"}),
    # a NoPE layer (every second one here) beside rotary ones
    "smollm3": (("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2)), {A: 2, G: 8, GG: 1}, set()),
    # interleaved pairs rotated in fp32 by its own repeat_interleave'd table (in bf16 rounded to the activations' dtype:
    # the attention's rope_fp32 and rope_table_rounded), its LayerNorm written out in fp32 (tkcc.layer_norm's
    # two_pass) feeding both the packed q|k|v and the gated MLP (parallel attention); the logit scale stays
    "cohere": (("CohereConfig", "CohereForCausalLM", dict()), {A: 2, G: 9, L: 3},
               {"aten.embedding.default", "aten.mul.Tensor"}),
    # the same with a sliding-window layer and a global one that rotates nothing (NoPE)
    "cohere2": (("Cohere2Config", "Cohere2ForCausalLM", dict(sliding_window=8, layer_types=["sliding_attention",
                                                                                          "full_attention"])),
                {A: 2, G: 9, L: 3},
                {"aten.embedding.default", "aten.mul.Tensor"}),
    # hybrid: three gated DeltaNet layers (their conv windows and recurrent states through transformers' linear-attention
    # cache API: the convolution over its cached window as tkcc.causal_conv, the delta-rule recurrence with its gates
    # and the broadcast of its 2 key heads over 4 value heads as tkcc.gated_delta, the gated norm after it as
    # tkcc.rms_norm's gated form, reading z in place in the projection; the cat of q|k|v before the convolution stays)
    # and a gated attention layer (a gate after each q head, read in place by the fused attention with its (1 + w)
    # per-head q/k norms and partial rotary; the gate's copy, sigmoid and product stay); its MoE with a shared expert
    # (the shared expert's sigmoid gate stays), the GEMVs, the other (1 + w) norms lower
    "qwen3-next": ("qwen3next-tiny", {A: 1, N: 12, G: 21, "tkcc.moe.default": 4, "tkcc.gated_delta.default": 3,
                                      "tkcc.causal_conv.default": 3},
                   {"aten.add.Tensor", "aten.cat.default", "aten.embedding.default", "aten.mul.Tensor",
                    "aten.sigmoid.default"}),
    # a short-convolution layer (its window through transformers' linear-attention cache API, the convolution over it
    # as tkcc.causal_conv; its input and output gates stay in aten) beside an attention layer with per-head q/k norms
    "lfm2": (("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention"])),
             {A: 1, G: 8, GG: 1, "tkcc.causal_conv.default": 1},
             {"aten.add.Tensor", "aten.chunk.default", "aten.mul.Tensor"}),
    # q/k norms over the whole projection (in bf16 w * norm(x) in fp32, and the rotation by its fp32 table in fp32: the
    # attention's norm_offset 0 and rope_fp32), norms after attention and MLP (the residual adds stay)
    "olmo2": (("Olmo2Config", "Olmo2ForCausalLM", dict()), {A: 2, G: 9, N: 4}, {"aten.add.Tensor", "aten.embedding.default"}),
    # a dense first layer, then MoE: the router's fp32 logits, the choice on their softmax plus a correction bias, the
    # renormalisation floored at norm_min (tkcc.moe's softmax_biased router); the routed plus shared experts' add stays;
    # the MoE layer's post-attention norm (read by the routed and the shared experts) is each one's prologue
    "ernie4_5-moe": (("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                      dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                           _experts_implementation="batched_mm")),
                     {A: 2, G: 8, GG: 1, "tkcc.moe.default": 1}, {"aten.add.Tensor"}),
    # a model that sizes its own attention mask by the tokens the cache has seen (captured with an all-ones mask of
    # the whole cache, whose term the canonical form drops); learned positions, LayerNorms, q|k|v with biases packed.
    # OPT scales q before the attention (q * scaling, then sdpa at scale 1): the fused attention's q_scale, q scaled and
    # rounded before the dot; its ReLU, learned positions' add and the embeddings stay
    "opt": (("OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, word_embed_proj_dim=64)), {A: 2, G: 9, L: 5},
            {"aten.add.Tensor", "aten.embedding.default", "aten.relu.default"}),
    "biogpt": (("BioGptConfig", "BioGptForCausalLM", dict()), {A: 2, G: 9, L: 5},
               {"aten.add.Tensor", "aten.embedding.default", "aten.mul.Tensor"}),
    # ALiBi (eager attention only): the bias slope_h * j over the cache, built from the all-ones mask, a constant of the
    # step whose slopes the fused attention reads (attention_plain's alibi form); its per-head [q_h | k_h | v_h]
    # projection selected out of a (B, T, H, 3, D) view (canonicalised to GPT-NeoX's chunk: the split_heads GEMV);
    # its GELU written out op by op stays
    "bloom": (("BloomConfig", "BloomForCausalLM", dict(_attn_implementation="eager")), {A: 2, G: 9, L: 6},
              {"aten.add.Tensor", "aten.embedding.default", "aten.mul.Tensor", "aten.tanh.default"}),
}


def build(family: str, dtype=torch.float32, seed: int = 0):
    """The family's tiny model, seeded, in eval mode."""
    spec = FAMILIES[family][0]
    if isinstance(spec, str):
        from tkcc.frontend.models import build_model

        return build_model(spec, dtype, "cpu", seed=seed)
    import transformers

    cfg_cls, model_cls, kw = spec
    private = {k: v for k, v in kw.items() if k.startswith("_")}  # set on the config, not passed to it
    cfg = getattr(transformers, cfg_cls)(**{**SHAPE, **{k: v for k, v in kw.items() if k not in private}})
    cfg._attn_implementation = "sdpa"
    for k, v in private.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # a weight matrix transformers leaves all zeros (Ernie's router) would tie every expert
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.to(dtype).eval()


def capture(family: str, dtype=torch.float32, max_cache_len: int = 32, phases=("decode",), seed: int = 0):
    from tkcc.frontend.capture import capture as capture_module

    return capture_module(build(family, dtype, seed), phases=list(phases), max_cache_len=max_cache_len)


def op_counts(gm) -> dict:
    """Kernel ops by kind, and the set of aten ops left (views aside)."""
    from collections import Counter

    from tkcc.passes.lower.decode import VIEWS

    c = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return {k: v for k, v in c.items() if k.startswith("tkcc.")}, {k for k in c if not k.startswith("tkcc.")
                                                                   and k not in VIEWS}


@contextlib.contextmanager
def kernels_off():
    """Every op takes its reference (the region's eager arithmetic) inside the block, even under the interpreter."""
    was = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if was is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = was


def same_decode(prog, forward, positions=(0, 9, 30), tol: float = 0.0) -> str | None:
    """Why ``forward`` (a lowered decode step) is not bit-exact with the captured one from the same random caches at
    these positions (logits and caches), or None. ``tol``: within this relative error (the norm of the difference
    over the reference's) and with the same greedy token, not bit for bit."""
    def same(a, b):
        if not tol:
            return torch.equal(a, b)
        return float((a.float() - b.float()).norm()) <= tol * float(a.float().norm())

    for i, p in enumerate(positions):
        g = torch.Generator().manual_seed(i)
        inp = list(prog.inputs("decode", generator=g))
        inp[1] = torch.full_like(inp[1], p)
        for b in prog.state.buffers():
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
        saved = [b.clone() for b in prog.state.buffers()]
        ref = prog.graphs["decode"](*inp)
        ref_state = [b.clone() for b in prog.state.buffers()]
        for b, v in zip(prog.state.buffers(), saved):
            b.copy_(v)
        got = forward(*inp)
        got = got[0] if isinstance(got, (tuple, list)) else got
        if not same(ref, got) or not torch.equal(ref.argmax(-1), got.argmax(-1)):
            return f"position {p}: logits differ by {float((ref.float() - got.float()).abs().max())}"
        if not all(same(a, b) for a, b in zip(ref_state, prog.state.buffers())):
            return f"position {p}: the caches differ"
    return None
