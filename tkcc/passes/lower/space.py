"""The lowered step's parameter space, from the configs of the kernel ops it emits, pruned per device.

- ``attn_tile``: the fused attention kernel's tile (positions per loop step x warps), ``ATTN_TILES`` of
  ``tkcc.kernels.lowered``. A tile whose shared memory exceeds what the device gives one block is pruned
  before any candidate uses it, with the reason: its use is found by compiling the kernel for the device's
  architecture at the model's head shapes (Triton ahead of time, specialised as the JIT specialises it:
  software pipelining of the cache loads is what makes large tiles large), e.g. the 256x8 tile at head
  dim 128 needs 274,432 B where an H200 gives 232,448.
- ``attn_chunk``: positions per split-KV program (``ATTN_CHUNKS``; 0 picks by the kv head count).
- ``gemv_config``: one GEMV config (BLOCK_N x BLOCK_K x warps, ``tkcc.kernels.gemv.CONFIGS``) for every
  GEMV, or ``"auto"``: each GEMV's own, timed on the device when the pass tunes (``tune``), else the
  kernel's default. Tuned configs are written into the lowered graph (and so the artifact's source).
"""
from __future__ import annotations

import logging

log = logging.getLogger("tkcc.passes.lower")

# the fused attention kernel's configs (mirrors the ones the FusedDecoder tuned over)
ATTN_TILES = ["64x4", "32x4", "16x4", "128x4", "128x8", "256x8", "32x2"]
ATTN_CHUNKS = [0, 64, 128, 256, 512, 1024, 2048]
# the GEMV kernel's configs, spelled as params (the kernel's own list: tkcc.kernels.gemv.CONFIGS)
GEMV_CONFIGS = ["auto", "4x512x4", "8x512x4", "16x256x4", "2x1024x4", "4x1024x8", "8x256x2", "1x2048x4",
                "16x512x8", "2x2048x4", "4x2048x4", "4x2048x8", "8x2048x8", "8x1024x4", "32x256x8", "1x8192x4",
                "2x8192x8"]
# head shapes (group size, head dim, q/k norm) a space for a device alone is pruned at: the built-in
# reference models' (llama-1b-16l: 4 x 64; olmoe-16l: 1 x 128 with norms) and 8 x 128 (GQA-8 models)
DEVICE_SHAPES = ((4, 64, False), (1, 128, True), (8, 128, False))

_SMEM: dict[tuple, int] = {}  # compile facts: (arch, G, D, qk_norm, tile, pdl) -> bytes (deterministic)


def parse_tile(tile: str) -> tuple[int, int]:
    from tkcc.errors import PlanError

    try:
        bs, nw = (int(v) for v in str(tile).split("x"))
        if bs < 16 or bs & (bs - 1) or nw not in (1, 2, 4, 8, 16):
            raise ValueError
    except ValueError:
        raise PlanError(f"lowered_decode: attn_tile {tile!r} is not 'POSITIONSxWARPS' (positions a power of two "
                        ">= 16, warps 1-16), e.g. '64x4'") from None
    return bs, nw


def parse_gemv(cfg: str) -> tuple[int, int, int] | None:
    if cfg == "auto":
        return None
    bn, bk, nw = (int(v) for v in cfg.split("x"))
    return bn, bk, nw


def attention_smem(arch: int, G: int, D: int, qk_norm: bool, tile: str, pdl: bool = True) -> int:
    """Shared memory (bytes) of the fused attention kernel at this tile and head shape, compiled for
    ``sm_<arch>`` with the JIT's specialisation (pointers and strides 16-divisible)."""
    key = (arch, G, D, qk_norm, tile, pdl)
    if key in _SMEM:
        return _SMEM[key]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tkcc.kernels.render import load
    from tkcc.kernels.common import next_pow2

    bs, nw = parse_tile(tile)
    fn = load("attention_rope.py.jinja", pdl=pdl).attn_rope_kernel
    P = "*bf16"
    sig = {"qkv_ptr": P, "k_ptr": P, "v_ptr": P, "out_ptr": P, "po_ptr": "*fp32", "plse_ptr": "*fp32",
           "count_ptr": "*i32", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "qn_ptr": P, "kn_ptr": P, "eps": "fp32",
           "qk_scale": "fp32", "chunk": "i32", "stride_kh": "i32", "stride_ks": "i32", "S_MAX": "i32",
           "SPLITS": "i32", "HQ": "i32", "HKV": "i32", "G": "constexpr", "G_PAD": "constexpr", "D": "constexpr",
           "HALF": "constexpr", "BLOCK_S": "constexpr", "BLOCK_Q": "constexpr", "QK_NORM": "constexpr",
           "SINGLE": "constexpr", "BLOCK_SP": "constexpr", "MERGE": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n].startswith("*") or n in ("stride_kh", "stride_ks", "chunk")}
    consts = dict(G=G, G_PAD=max(16, next_pow2(G)), D=D, HALF=D // 2, BLOCK_S=bs, BLOCK_Q=2048, QK_NORM=qk_norm,
                  SINGLE=False, BLOCK_SP=16, MERGE=True)
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32), options={"num_warps": nw})
    _SMEM[key] = int(k.metadata.shared)
    return _SMEM[key]


def device_limits(device) -> tuple[int, int] | None:
    """(architecture, shared memory per block) of a CUDA device, None off CUDA (the interpreter has no limit)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(dev)
    major, minor = torch.cuda.get_device_capability(dev)
    return major * 10 + minor, int(getattr(p, "shared_memory_per_block_optin", 0) or p.shared_memory_per_block)


def pruned_tiles(limits: tuple[int, int] | None, shapes) -> dict[str, str]:
    """tile -> why the device cannot run it at one of ``shapes`` ((G, D, qk_norm)); {} without limits."""
    if limits is None:
        return {}
    arch, smem = limits
    out = {}
    for tile in ATTN_TILES:
        for G, D, qk in shapes:
            try:
                need = attention_smem(arch, G, D, qk, tile)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile cannot run either
                out[tile] = f"does not compile for sm_{arch} at heads {G}x{D}: {type(e).__name__}: {e}"
                break
            if need > smem:
                out[tile] = (f"needs {need:,} B of shared memory at {G} heads x {D} per kv head, the device "
                             f"gives {smem:,} B per block")
                break
    for tile, why in out.items():
        log.info("lowered_decode: attn_tile %s pruned from the space: %s", tile, why)
    return out
