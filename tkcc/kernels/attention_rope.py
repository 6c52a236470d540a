"""Decode attention in one launch per layer: q/k norm + rotary + KV-cache write + split-KV + combine.

The separate path (``rotary.rope`` then ``attention.attention`` and, with
several splits, its combine kernel) costs 2-3 launches per layer, each mostly
latency at short context (16 layers x ~2.4 us each on an H200). Here every
(kv head, split) program derives this token's rotated q (its G heads) and k
from the fused projection ``[q | k | v]`` itself, the program whose split
holds ``pos`` writes k and v into the cache, the new position enters the
softmax from registers, and the last program of each kv head to finish merges
the splits (an arrival counter per kv head, reset by that program). That
merge is serial in the splits; above ``MERGE_MAX_SPLITS`` splits (long
caches) attention's own combine kernel, parallel over heads, merges them
instead (two launches). Same
cache layout and arithmetic as the separate kernels; ``rope_ref`` +
``attention_ref`` is the reference.
"""
from __future__ import annotations

import math

import torch
import triton

from tkcc.errors import TkccError
from tkcc.kernels.attention import LOG2E, attention_ref, combine
from tkcc.kernels.common import fallback_reason, next_pow2, note_fallback
from tkcc.kernels.graph_replay import launch_pdl
from tkcc.kernels.render import load
from tkcc.kernels.rotary import rope_ref


def attention_rope_ref(qkv, k_cache, v_cache, pos, inv_freq, hq, hkv, q_norm=None, k_norm=None, eps=1e-5,
                       scale=None):
    """Eager: rope_ref (writes the cache at pos) then attention over positions [0, pos]. Returns [hq, D]."""
    p = int(pos.reshape(-1)[0]) if isinstance(pos, torch.Tensor) else int(pos)
    q = rope_ref(qkv, k_cache, v_cache, p, inv_freq, hq, hkv, q_norm, k_norm, eps)
    return attention_ref(q, k_cache, v_cache, p + 1, scale)


MERGE_MAX_SPLITS = 16  # one BLOCK_SP tile per head in the in-kernel merge
# the kernel's tiles (positions per loop step, warps) and positions per split-KV program a caller may pick;
# the lowered step's parameter space spells them as params (tkcc.passes.lower.space; a test holds them equal)
TILES = [(64, 4), (32, 4), (16, 4), (128, 4), (128, 8), (256, 8), (32, 2)]
CHUNKS = [64, 128, 256, 512, 1024, 2048]


class AttentionRope:
    """Scratch for one decoder (partials and per-kv-head counters, reused by every layer) and the launch."""

    def __init__(self, hq: int, hkv: int, D: int, max_cache_len: int, chunk: int, device, block_s: int = 64,
                 num_warps: int = 4, span: int | None = None):
        """``span``: the positions the grid is laid out for (default the whole cache). A context past it is
        still attended, by the last split (slower, never wrong): a decoder keeps a layout per context span and
        picks one per step by the position it knows on the host."""
        self.hq, self.hkv, self.D = hq, hkv, D
        self.span = min(span or max_cache_len, max_cache_len)
        self.chunk = min(chunk, self.span)
        self.splits = triton.cdiv(self.span, self.chunk)
        if self.splits == 1:
            self.chunk = max_cache_len
        self.block_s, self.num_warps = block_s, num_warps
        self.po = torch.empty(hq, self.splits, D, device=device, dtype=torch.float32)
        self.plse = torch.empty(hq, self.splits, device=device, dtype=torch.float32)
        self.count = torch.zeros(hkv, device=device, dtype=torch.int32)
        self.merge = self.splits <= MERGE_MAX_SPLITS

    def __call__(self, qkv, k_cache, v_cache, pos, inv_freq, q_norm=None, k_norm=None, eps=1e-5, scale=None,
                 out=None, pdl=None, seqlen=None, block_s=None, num_warps=None):
        """qkv [(hq + 2 hkv) D]; caches [hkv, S_max, D] (written at pos); pos: int32 device tensor [1];
        ``seqlen``: pos + 1 on the device (the combine launch reads it; computed here when not given);
        ``block_s`` / ``num_warps``: this call's tile (positions per loop step, at least 16) over the
        instance's."""
        hq, hkv, D = self.hq, self.hkv, self.D
        S_max = k_cache.shape[1]
        reason = fallback_reason(qkv, k_cache, v_cache, q_norm, k_norm)
        if reason is None and (hq % hkv or D != next_pow2(D) or D < 16 or k_cache.stride(2) != 1
                               or k_cache.stride() != v_cache.stride() or tuple(k_cache.shape) != (hkv, S_max, D)
                               or qkv.numel() != (hq + 2 * hkv) * D or self.chunk * self.splits < min(self.span, S_max)
                               or (q_norm is None) != (k_norm is None) or not isinstance(pos, torch.Tensor)):
            reason = (f"unsupported heads/layout hq={hq} hkv={hkv} D={D} cache {tuple(k_cache.shape)} strides "
                      f"{k_cache.stride()} qkv {qkv.numel()} splits {self.splits}x{self.chunk}")
        scale = scale if scale is not None else 1.0 / math.sqrt(D)
        if reason is not None:
            note_fallback("attention_rope", reason)
            p = int(pos.reshape(-1)[0]) if isinstance(pos, torch.Tensor) else int(pos)
            if p >= S_max:
                raise TkccError(f"attention: context {p + 1} is longer than the cache ({S_max} positions)")
            y = attention_rope_ref(qkv, k_cache, v_cache, p, inv_freq, hq, hkv, q_norm, k_norm, eps, scale)
            if out is None:
                return y
            out.copy_(y)
            return out
        if out is None:
            out = torch.empty(hq, D, device=qkv.device, dtype=qkv.dtype)
        return launch(qkv, k_cache, v_cache, pos, inv_freq, out, self.po, self.plse, self.count, hq=hq, hkv=hkv,
                      chunk=self.chunk, splits=self.splits, q_norm=q_norm, k_norm=k_norm, eps=eps, scale=scale,
                      pdl=pdl, seqlen=seqlen, block_s=block_s or self.block_s,
                      num_warps=num_warps or self.num_warps)


def launch(qkv, k_cache, v_cache, pos, inv_freq, out, po, plse, count, *, hq, hkv, chunk, splits, q_norm=None,
           k_norm=None, eps=1e-5, scale, pdl=None, seqlen=None, block_s=64, num_warps=4, rope_scale=None,
           head_norm=False, window=0, rotary_dim=0, interleaved=False, sinks=None, norm_offset=None, dynamic=False,
           rope_fp32=False, rope_table_rounded=False, q_gated=False, q_scale=None, alibi=None, alibi_beta=1.0):
    """The launch itself, on caller-owned scratch: partials ``po`` [hq, splits, D] / ``plse`` [hq, splits] (fp32,
    any contents) and per-kv-head arrival counters ``count`` [hkv] (int32, zero, left zero). ``seqlen`` None
    with several splits above ``MERGE_MAX_SPLITS``: the combine reads ``pos`` and adds one itself.
    ``rope_scale``: cos and sin times this factor (scaled rotary), None for none. ``head_norm``: the q/k norms
    are per head (weights [D], Qwen3), not over the whole projection (OLMoE). ``window``: a sliding window
    of that many positions (the current one included), 0 for none. ``rotary_dim``: only the first this many
    elements of each head rotate (partial rotary; 0: all), ``interleaved``: pairs (2i, 2i + 1) rotate (GPT-J,
    GLM) instead of the halves. ``sinks``: [hq] learned logits in each head's softmax denominator (gpt-oss).
    ``norm_offset``: the q/k norms are ``norm(x) * (norm_offset + w)`` in fp32 rounded once (Gemma 3's per head:
    offset 1; OLMo 2's over the whole projection: 0), None for the Llama form (normed x rounded, then times w). ``dynamic``: the
    ``splits`` chunks are sized on the device to each step's context (``chunk`` unused), at most
    ``MERGE_MAX_SPLITS`` of them so that the kernel merges them itself. ``rope_fp32``: the table stays fp32 and
    the rotation is computed in fp32 from the upcast q and k, rounded once (Ernie 4.5, OLMo 2), not rounded at
    each product and sum; with ``rope_table_rounded`` the table is rounded to the activations' dtype first (Cohere's
    table, in the model's dtype, rotating the upcast q and k). ``inv_freq`` None: nothing rotates (learned
    positions, NoPE layers). ``q_gated``: each q head is followed by its gate in ``qkv`` (Qwen3-Next), per-head q/k
    norms only. ``q_scale``: q times this scalar, rounded to the activations' dtype before the dot (OPT: then
    ``scale`` 1); with nothing rotated and no q/k norms only. ``alibi``: [hq] fp32 ALiBi slopes, each score
    ``alibi_beta * alibi + scale * q.k`` with ``alibi = slopes[h] * j`` over key positions j rounded to the
    activations' dtype, the score rounded to it too (BLOOM's ``baddbmm``: its scores are in that dtype, and ALiBi
    makes them large, so the rounding shows); with nothing rotated only."""
    pdl = launch_pdl(pdl)  # None: the enclosing pdl_scope's setting
    if q_scale is not None and (inv_freq is not None or q_norm is not None):
        raise TkccError("attention: a q scale with a rotation or q/k norms (the kernel scales q only when nothing "
                        "else transforms it)")
    if alibi is not None and inv_freq is not None:
        raise TkccError("attention: ALiBi with a rotation (the kernel biases the scores of unrotated q and k only)")
    D = k_cache.shape[-1]
    S_max = k_cache.shape[1]
    G = hq // hkv
    qk_norm = q_norm is not None
    merge = splits <= MERGE_MAX_SPLITS
    dynamic = bool(dynamic) and splits > 1
    if dynamic and not merge:
        raise TkccError(f"attention: {splits} splits sized at run time; at most {MERGE_MAX_SPLITS} (the kernel "
                        "merges them itself)")
    if dynamic:
        chunk = block_s  # not read: the kernel sizes its chunks from the position
    norm_fp32 = norm_offset is not None and qk_norm
    # (the paired path also takes the fp32 rotation and the fp32 q/k norms over the whole projection)
    rope = inv_freq is not None
    pairs = (bool(interleaved) or bool(rotary_dim and rotary_dim != D) or bool(rope_fp32)
             or (norm_fp32 and not head_norm) or not rope)
    if not rope:  # the paired path with nothing paired: every element passes through
        inv_freq, rotary_dim, interleaved, rope_fp32, rope_scale = qkv, 0, False, False, None
    mod = load("attention_rope.py.jinja", pdl=pdl, rope_scale=rope_scale is not None, head_norm=head_norm,
               window=bool(window), pairs=pairs, sinks=sinks is not None, **({"rope_fp32": True} if rope_fp32 else {}),
               **({"rope_table_rounded": True} if rope_fp32 and rope_table_rounded else {}),
               **({"norm_fp32": True} if norm_fp32 else {}), **({} if rope else {"rope": False}),
               **({"q_gated": True} if q_gated else {}), **({"q_scale": True} if q_scale is not None else {}),
               **({"alibi": True} if alibi is not None else {}))
    mod.attn_rope_kernel[(hkv, splits)](
        qkv, k_cache, v_cache, out, po, plse, count, pos, inv_freq,
        q_norm if qk_norm else qkv, k_norm if qk_norm else qkv, eps,
        scale if alibi is not None else scale * LOG2E, chunk,  # (ALiBi: its scores rounded in their own units first)
        k_cache.stride(0), k_cache.stride(1), S_max, splits, hq, hkv, G=G, G_PAD=max(16, next_pow2(G)), D=D,
        HALF=D // 2, BLOCK_S=block_s, BLOCK_Q=min(4096, next_pow2(hq * D)), QK_NORM=qk_norm,
        SINGLE=splits == 1, BLOCK_SP=min(16, max(2, next_pow2(splits))), MERGE=merge, DYN=dynamic,
        num_warps=num_warps, **({"rope_scale": float(rope_scale)} if rope_scale is not None else {}),
        **({"window": int(window)} if window else {}),
        **({"ROT_DIM": int(rotary_dim or D) if rope else 0, "INTERLEAVED": bool(interleaved)} if pairs else {}),
        **({"sinks_ptr": sinks} if sinks is not None else {}),
        **({"norm_offset": float(norm_offset)} if norm_fp32 else {}),
        **({"q_scale": float(q_scale)} if q_scale is not None else {}),
        **({"alibi_ptr": alibi, "alibi_beta": float(alibi_beta)} if alibi is not None else {}),
        **({"launch_pdl": True} if pdl else {}))
    if splits > 1 and not merge:
        if seqlen is None:
            combine(po, plse, out, pos, chunk, splits, pdl, from_pos=True)
        else:
            combine(po, plse, out, seqlen, chunk, splits, pdl)
    return out


def shared_memory(arch: int, G: int, D: int, qk_norm: bool, block_s: int, num_warps: int, pdl: bool = True) -> int:
    """Shared memory (bytes) one program of the kernel needs at this tile and head shape, compiled for
    ``sm_<arch>`` ahead of time (no GPU needed) with the JIT's specialisation (pointers and strides
    16-divisible): software pipelining of the cache loads is what makes large tiles large (256x8 at head
    dim 128: 274,432 B, more than an H200 gives a block). Remembered per machine (``compile_facts``)."""
    return shared_memory_many([(arch, G, D, qk_norm, block_s, num_warps, pdl)])[0]


def shared_memory_many(keys: list[tuple]) -> list[int]:
    """``shared_memory`` of each (arch, G, D, qk_norm, block_s, num_warps, pdl): the missing ones compiled in
    parallel processes."""
    from tkcc.kernels.compile_facts import facts, source_key
    from tkcc.kernels.render import TEMPLATE_DIR

    keys = [tuple(k) for k in keys]
    src = source_key((TEMPLATE_DIR / "attention_rope.py.jinja").read_text())
    got = facts("attn_rope_smem", src, keys, _compiled_smem)
    return [got[k] for k in keys]


def _compiled_smem(key: tuple) -> int:
    """One compile of the kernel for ``sm_<arch>`` at ``key``; its shared memory in bytes."""
    arch, G, D, qk_norm, block_s, num_warps, pdl = key
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = load("attention_rope.py.jinja", pdl=pdl).attn_rope_kernel
    P = "*bf16"
    sig = {"qkv_ptr": P, "k_ptr": P, "v_ptr": P, "out_ptr": P, "po_ptr": "*fp32", "plse_ptr": "*fp32",
           "count_ptr": "*i32", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "qn_ptr": P, "kn_ptr": P, "eps": "fp32",
           "qk_scale": "fp32", "chunk": "i32", "stride_kh": "i32", "stride_ks": "i32", "S_MAX": "i32",
           "SPLITS": "i32", "HQ": "i32", "HKV": "i32", "G": "constexpr", "G_PAD": "constexpr", "D": "constexpr",
           "HALF": "constexpr", "BLOCK_S": "constexpr", "BLOCK_Q": "constexpr", "QK_NORM": "constexpr",
           "SINGLE": "constexpr", "BLOCK_SP": "constexpr", "MERGE": "constexpr", "DYN": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n].startswith("*") or n in ("stride_kh", "stride_ks", "chunk")}
    consts = dict(G=G, G_PAD=max(16, next_pow2(G)), D=D, HALF=D // 2, BLOCK_S=block_s, BLOCK_Q=2048,
                  QK_NORM=qk_norm, SINGLE=False, BLOCK_SP=16, MERGE=True, DYN=False)
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return int(k.metadata.shared)


def device_limits(device) -> tuple[int, int] | None:
    """(architecture, shared memory per block) of a CUDA device, None off CUDA (the interpreter has no limit)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(dev)
    major, minor = torch.cuda.get_device_capability(dev)
    return major * 10 + minor, int(getattr(p, "shared_memory_per_block_optin", 0) or p.shared_memory_per_block)


def tile_fits(device, G: int, D: int, qk_norm: bool, block_s: int, num_warps: int) -> bool:
    """Whether ``device`` can run the kernel at this tile (always off CUDA)."""
    limits = device_limits(device)
    return limits is None or shared_memory(limits[0], G, D, qk_norm, block_s, num_warps) <= limits[1]
