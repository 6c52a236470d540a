"""The lowered step's parameter space, from the configs of the kernel ops it emits, pruned per device.

- ``attn_tile``: the fused attention kernel's tile (positions per loop step x warps), ``TILES`` of
  ``tkcc.kernels.attention_rope`` spelled ``POSITIONSxWARPS``. A tile whose shared memory exceeds what the device gives one block is pruned
  before any candidate uses it, with the reason: its use is found by compiling the kernel for the device's
  architecture at the model's head shapes (Triton ahead of time, specialised as the JIT specialises it:
  software pipelining of the cache loads is what makes large tiles large), e.g. the 256x8 tile at head
  dim 128 needs 274,432 B where an H200 gives 232,448.
- ``attn_chunk``: positions per split-KV program (``ATTN_CHUNKS``; 0 picks by the kv head count). Tuning also
  times ``ATTN_DYN_SPLITS``: N splits sized on the device to each step's context (a node's chunk -N).
- ``gemv_config``: one GEMV config (BLOCK_N x BLOCK_K x warps, ``tkcc.kernels.gemv.CONFIGS``) for every
  GEMV, or ``"auto"``: each GEMV's own, timed on the device when the pass tunes (``tune``), else the
  kernel's default. Tuned configs are written into the lowered graph (and so the artifact's source).
"""
from __future__ import annotations

import logging

log = logging.getLogger("tkcc.passes.lower")

# the fused attention kernel's configs, spelled as params (the kernel's own lists: tkcc.kernels.attention_rope's
# TILES and CHUNKS; 0 picks the chunk by the kv head count)
ATTN_TILES = ["64x4", "32x4", "16x4", "128x4", "128x8", "256x8", "32x2"]
ATTN_CHUNKS = [0, 64, 128, 256, 512, 1024, 2048]
# splits whose chunks the fused attention sizes to each step's context (written into a node as chunk -N): timed
# beside the fixed chunks when the step tunes its attention; at most attention_rope.MERGE_MAX_SPLITS
ATTN_DYN_SPLITS = [4, 8, 16]
# MLA's split kernel tiles (positions per loop step x warps; tkcc.kernels.mla_attention caps the positions by
# the latent width): timed with the chunks above when the lowered step tunes its attention
MLA_TILES = ["16x4", "32x4", "64x4", "32x8", "64x8"]
# the GEMV kernel's configs, spelled as params (the kernel's own list: tkcc.kernels.gemv.CONFIGS)
GEMV_CONFIGS = ["auto", "4x512x4", "8x512x4", "16x256x4", "2x1024x4", "4x1024x8", "8x256x2", "1x2048x4",
                "16x512x8", "2x2048x4", "4x2048x4", "4x2048x8", "8x2048x8", "8x1024x4", "32x256x8", "1x8192x4",
                "2x8192x8"]
# head shapes (group size, head dim, q/k norm) a space for a device alone is pruned at: the built-in
# reference models' (llama-1b-16l: 4 x 64; olmoe-16l: 1 x 128 with norms) and 8 x 128 (GQA-8 models)
DEVICE_SHAPES = ((4, 64, False), (1, 128, True), (8, 128, False))


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
    """Shared memory (bytes) of the fused attention at this tile and head shape on ``sm_<arch>``."""
    from tkcc.kernels.attention_rope import shared_memory

    bs, nw = parse_tile(tile)
    return shared_memory(arch, G, D, qk_norm, bs, nw, pdl)


def device_limits(device) -> tuple[int, int] | None:
    """(architecture, shared memory per block) of a CUDA device, None off CUDA (the interpreter has no limit)."""
    from tkcc.kernels.attention_rope import device_limits as limits

    return limits(device)


def attention_needs(arch: int, shapes) -> dict[tuple, int]:
    """{(tile, G, D, qk_norm): shared memory in bytes} of every tile at every head shape, compiled at once
    (in parallel, remembered per machine: ``tkcc.kernels.compile_facts``)."""
    from tkcc.kernels.attention_rope import shared_memory_many

    keys = [(tile, G, D, qk) for tile in ATTN_TILES for G, D, qk in shapes]
    needs = shared_memory_many([(arch, G, D, qk, *parse_tile(tile), True) for tile, G, D, qk in keys])
    return dict(zip(keys, needs))


def _some_tile_compiles(arch: int, shape, needs: dict) -> bool:
    """Whether the fused attention can run at this head shape at all (heads narrower than the kernel's dot
    products, e.g. DeepSeek's 8-wide rope part on a tiny config, compile at no tile): a shape it cannot run
    prunes nothing, its regions are not this kernel's."""
    G, D, qk = shape
    if any((t, G, D, qk) in needs for t in ATTN_TILES):
        return True
    for tile in ATTN_TILES:
        try:
            attention_smem(arch, G, D, qk, tile)
            return True
        except Exception:  # noqa: BLE001 - this tile does not compile here; another may
            continue
    log.info("lowered_decode: the fused attention compiles at no tile for heads %dx%d: not pruned by that shape",
             G, D)
    return False


def pruned_tiles(limits: tuple[int, int] | None, shapes) -> dict[str, str]:
    """tile -> why the device cannot run it at one of ``shapes`` ((G, D, qk_norm)); {} without limits."""
    if limits is None:
        return {}
    arch, smem = limits
    try:
        needs = attention_needs(arch, shapes)
    except Exception:  # noqa: BLE001 - the one that does not compile is found, and named, one by one below
        needs = {}
    out = {}
    shapes = [sh for sh in shapes if _some_tile_compiles(arch, sh, needs)]
    for tile in ATTN_TILES:
        for G, D, qk in shapes:
            try:
                need = needs.get((tile, G, D, qk))
                if need is None:
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
