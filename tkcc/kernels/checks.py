"""Correctness checks of every kernel family against its PyTorch reference.

Fresh random inputs on every call, several shapes, outputs poisoned with NaN
before the kernel writes them. Used by the CPU tests (under the Triton
interpreter, fp32/fp16), the GPU tests (bf16) and the GPU benchmark, so the
three agree on what "correct" means. Each check returns rows
``{kernel, shape, dtype, rel_err, tol, ok}``.
"""
from __future__ import annotations

import inspect
import math

import torch

TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _row(kernel, shape, dtype, err, tol=None):
    tol = tol if tol is not None else TOL[dtype]
    return {"kernel": kernel, "shape": str(shape), "dtype": str(dtype).replace("torch.", ""), "rel_err": err,
            "tol": tol, "ok": bool(err <= tol)}


def _rand(*shape, device, dtype, g, scale=1.0):
    return (torch.randn(*shape, generator=g, device="cpu", dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def check_gemv(device, dtype, g, pdl=False, shapes=((256, 128), (96, 200), (64, 512))):
    """Seven hook combinations x two block shapes per shape (one of them full-K, the PDL prefetch layout); the
    residual also scaled (MiniMax's ``h * alpha + y``), or followed by a second one (DeepSeek's
    ``h + (moe_out + y)``)."""
    from tkcc.kernels.gemv import gemv, gemv_ref

    rows = []
    for N, K in shapes:
        for norm, gated, res, scale, res2 in ((False, False, False, 1.0, False), (True, False, False, 1.0, False),
                                              (False, False, True, 1.0, False), (True, True, False, 1.0, False),
                                              (True, False, True, 1.681792830507429, False),
                                              (False, False, True, 1.0, True), (True, False, True, 1.0, True)):
            x = _rand(K, device=device, dtype=dtype, g=g)
            w = _rand(2 * N if gated else N, K, device=device, dtype=dtype, g=g, scale=1 / math.sqrt(K))
            nw = _rand(K, device=device, dtype=dtype, g=g) if norm else None
            r = _rand(N, device=device, dtype=dtype, g=g) if res else None
            r2 = _rand(N, device=device, dtype=dtype, g=g, scale=4.0) if res2 else None  # (a residual stream's scale)
            for cfg in ((32, 512, 4), (8, 64, 2)):
                out = torch.full((N,), float("nan"), device=device, dtype=dtype)
                gemv(x, w, norm_w=nw, residual=r, gated=gated, out=out, config=cfg, pdl=pdl, residual_scale=scale,
                     residual2=r2)
                ref = gemv_ref(x.reshape(1, -1), w, nw, 1e-5, None if r is None else r.reshape(1, -1), gated,
                               residual_scale=scale, residual2=None if r2 is None else r2.reshape(1, -1)).reshape(-1)
                rows.append(_row(f"gemv{'+norm' * norm}{'+gated' * gated}{'+res' * res}{'+scaled' * (scale != 1.0)}"
                                 f"{'+res2' * res2}", (N, K, cfg), dtype, rel_err(out, ref)))
    return rows + _check_gemv_ends(device, dtype, g, pdl, *shapes[0])


def _check_gemv_ends(device, dtype, g, pdl, N, K):
    """The decode step's ends: x gathered from a table row (copied out), argmax of y with pos/seq advanced;
    twice in a row (the self-resetting slots and counters), the second time with every row tied; and 601
    one-row programs (arrival groups of 3, the last group of 1; on the CPU's interpreter, which runs programs one
    by one, 9 over a state of 8 slots: groups of 2, the last of 1, as NSLOT + 1 over NSLOT slots)."""
    from tkcc.kernels.gemv import ArgmaxState, gemv, gemv_ref

    rows = []
    table = _rand(37, K, device=device, dtype=dtype, g=g)
    nw = _rand(K, device=device, dtype=dtype, g=g)
    cpu = str(device) == "cpu"
    full = ArgmaxState(device)  # NSLOT slots: N rows' programs fill groups of 1
    few = ArgmaxState(device, nslot=8) if cpu else full
    many = 9 if cpu else 601
    for n, cfg, st in ((N, (32, 512, 4), full), (N, (8, 64, 2), full), (many, (1, 64, 2), few)):
        w = _rand(n, K, device=device, dtype=dtype, g=g, scale=1 / math.sqrt(K))
        for tied in (False, True):
            wt = torch.ones_like(w) if tied else w
            i = int(torch.randint(0, 37, (1,), generator=g))
            idx = torch.tensor([i], device=device)
            xout = torch.full((K,), float("nan"), device=device, dtype=dtype)
            tok = torch.full((1,), -1, device=device, dtype=torch.long)
            pos = torch.tensor([41], device=device, dtype=torch.int32)
            seq = torch.tensor([42], device=device, dtype=torch.int32)
            out = torch.full((n,), float("nan"), device=device, dtype=dtype)
            gemv(table, wt, norm_w=nw, out=out, config=cfg, pdl=pdl, gather=(idx, xout), argmax=(tok, st, pos, seq))
            ref = gemv_ref(table[i:i + 1], wt, nw, 1e-5).reshape(-1)
            ok = (torch.equal(xout, table[i]) and int(tok) == int(torch.argmax(out)) and int(pos) == 42
                  and int(seq) == 43 and bool((st.count == 0).all()) and bool((st.slots == -2**63).all()))
            # tied: every row is one sum of K terms, which may cancel to near zero; its error is judged against the
            # terms' magnitude (the sum of their absolute values: all of w is one), not against the sum itself
            err = rel_err(out, ref)
            if tied:
                terms = gemv_ref(table[i:i + 1], torch.eye(K, device=device, dtype=dtype), nw, 1e-5).float().abs().sum()
                err = float((out.float() - ref.float()).abs().max() / terms.clamp_min(1e-30))
            rows.append(_row(f"gemv+gather+argmax{'+tied' * tied}", (n, K, cfg), dtype, err if ok else float("inf")))
    return rows


def check_rmsnorm(device, dtype, g, pdl=False, shapes=((1, 64), (3, 200), (2, 2048))):
    from tkcc.kernels.rmsnorm import rmsnorm, rmsnorm_ref

    rows = []
    for shape in shapes:
        x = _rand(*shape, device=device, dtype=dtype, g=g)
        r = _rand(*shape, device=device, dtype=dtype, g=g)
        w = _rand(shape[-1], device=device, dtype=dtype, g=g)
        rows.append(_row("rmsnorm", shape, dtype, rel_err(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))))
        y, h = rmsnorm(x, w, 1e-6, residual=r)
        yr, hr = rmsnorm_ref(x, w, 1e-6, residual=r)
        rows.append(_row("rmsnorm+residual", shape, dtype, max(rel_err(y, yr), rel_err(h, hr))))
    return rows


def _distinct_logits(T, E, device, dtype, g):
    """Logits with no ties in any dtype (multiples of 1/8, |x| <= E/16): top-k is then unambiguous."""
    return torch.stack([(torch.randperm(E, generator=g).float() - E / 2) / 8 for _ in range(T)]).to(device, dtype)


def check_router(device, dtype, g, pdl=False, shapes=((1, 8, 2), (5, 64, 8), (2, 60, 4))):
    from tkcc.kernels.router import router, router_ref

    rows = []
    for T, E, k in shapes:
        for norm in (False, True):
            logits = _distinct_logits(T, E, device, dtype, g)
            ids, w = router(logits, k, norm)
            rids, rw = router_ref(logits, k, norm)
            same = bool(torch.equal(ids.cpu(), rids.cpu()))
            rows.append(_row(f"router{'+renorm' * norm}", (T, E, k), dtype, rel_err(w, rw) if same else float("inf")))
    return rows


def check_moe(device, dtype, g, pdl=False, shapes=((8, 32, 64, 2), (16, 48, 96, 4), (64, 16, 64, 8))):
    from tkcc.kernels.moe import moe, moe_ref

    rows = []
    for E, I, H, k in shapes:
        for i, (norm, res, norm_topk, forced) in enumerate(((False, False, False, False), (True, True, True, False),
                                                            (True, True, False, True))):
            x = _rand(H, device=device, dtype=dtype, g=g)
            logits = _distinct_logits(1, E, device, dtype, g).reshape(E)
            gu = _rand(E, 2 * I, H, device=device, dtype=dtype, g=g, scale=1 / math.sqrt(H))
            dn = _rand(E, H, I, device=device, dtype=dtype, g=g, scale=1 / math.sqrt(I))
            nw = _rand(H, device=device, dtype=dtype, g=g) if norm else None
            r = _rand(H, device=device, dtype=dtype, g=g) if res else None
            fid = (torch.randperm(E, generator=g)[:k].to(device=device, dtype=torch.int32) if forced else None)
            out = torch.full((H,), float("nan"), device=device, dtype=dtype)
            for cfg in (((4, 32, 4), (8, 64, 2))[i % 2],):
                moe(x, logits, gu, dn, k, norm_topk, residual=r, norm_w=nw, forced_ids=fid, out=out,
                    gate_up_config=cfg, down_config=cfg, pdl=pdl)
                ref = moe_ref(x.reshape(1, H), logits.reshape(1, E), gu, dn, k, norm_topk,
                              None if r is None else r.reshape(1, H), nw, 1e-5, fid).reshape(-1)
                name = f"moe{'+norm' * norm}{'+res' * res}{'+renorm' * norm_topk}{'+forced' * forced}"
                rows.append(_row(name, (E, I, H, k, cfg), dtype, rel_err(out, ref)))
    return rows


def check_attention(device, dtype, g, pdl=False, shapes=((4, 4, 32, 100, 77), (8, 2, 64, 300, 300), (4, 1, 16, 1024, 513))):
    from tkcc.kernels.attention import attention, attention_ref

    rows = []
    for Hq, Hkv, D, S, L in shapes:
        q = _rand(Hq, D, device=device, dtype=dtype, g=g)
        kc = _rand(Hkv, S, D, device=device, dtype=dtype, g=g)
        vc = _rand(Hkv, S, D, device=device, dtype=dtype, g=g)
        kc[:, L:] = float("nan")  # positions past the context must never be read
        vc[:, L:] = float("nan")
        seqlen = torch.tensor([L], device=device, dtype=torch.int32)
        ref = attention_ref(q, kc, vc, L)
        for i, splits in enumerate((1, 3, 8, 40, 300)):  # 300: more splits than one combine tile holds
            bs, nw = _attn_tile(i)
            out = torch.full((Hq, D), float("nan"), device=device, dtype=dtype)
            attention(q, kc, vc, seqlen, splits=splits, out=out, block_s=bs, num_warps=nw, pdl=pdl)
            rows.append(_row("attention", (Hq, Hkv, D, S, L, f"splits={splits}", f"tile={bs}x{nw}"), dtype,
                             rel_err(out, ref)))
    return rows


# on the interpreter, which runs programs one by one: MHA on two heads (the same masks and tiles as four), and GQA
check_attention.cpu_shapes = ((2, 2, 32, 100, 77), check_attention.__defaults__[1][1])


def _attn_tile(i: int) -> tuple[int, int]:
    """The i-th of the tiles a tuned step may pick for the attention kernels, cyclically: every tile is
    checked without multiplying the cases."""
    from tkcc.kernels.attention_rope import TILES

    return TILES[i % len(TILES)]


def _inv_freq(D: int, device) -> torch.Tensor:
    """Rotary frequencies of a head of D (base 10000), fp32, as the models' rotary embedding has them."""
    return (1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(device)


def check_rope(device, dtype, g, pdl=False, shapes=((4, 4, 32), (8, 2, 64), (2, 1, 16))):
    from tkcc.kernels.rotary import rope, rope_ref

    rows = []
    for hq, hkv, D in shapes:
        for norm in (False, True):
            S = 40
            pos = int(torch.randint(0, S, (1,), generator=g))
            qkv = _rand((hq + 2 * hkv) * D, device=device, dtype=dtype, g=g)
            inv_freq = _inv_freq(D, device)
            qn = _rand(hq * D, device=device, dtype=dtype, g=g) if norm else None
            kn = _rand(hkv * D, device=device, dtype=dtype, g=g) if norm else None
            kc, vc = (_rand(hkv, S, D, device=device, dtype=dtype, g=g) for _ in range(2))
            kr, vr = kc.clone(), vc.clone()
            q = rope(qkv, kc, vc, torch.tensor([pos], device=device, dtype=torch.int32), inv_freq, hq, hkv, qn, kn,
                     pdl=pdl)
            qr = rope_ref(qkv, kr, vr, pos, inv_freq, hq, hkv, qn, kn)
            err = max(rel_err(q, qr), rel_err(kc, kr), rel_err(vc, vr))
            rows.append(_row(f"rope{'+qknorm' * norm}+cache", (hq, hkv, D, pos), dtype, err))
    return rows


def check_moe_routed(device, dtype, g, pdl=False, shapes=((8, 32, 64, 2), (16, 48, 96, 4), (64, 16, 64, 8),
                                                            (64, 1024, 2048, 8))):
    """Router GEMV + top-k once per layer, then the experts (moe_routed.py), against the eager router + experts.
    Router weights are built so the logits are well separated (multiples of 1/8 up to rounding): the top-k is
    unambiguous in every dtype. Each shape also runs with a small register budget (the K-loop paths), and
    twice in a row (the self-resetting arrival counter)."""
    from tkcc.kernels import moe_routed as mr
    from tkcc.kernels.common import rms_ref

    rows = []
    for E, I, H, k in shapes:
        for i, (res, norm_topk, forced, tile, scale) in enumerate(((True, False, False, None, 1.0),
                                                                   (False, True, False, 256, 1.0),
                                                                   (True, False, True, None, 1.681792830507429))):
            x = _rand(H, device=device, dtype=dtype, g=g)
            nw = _rand(H, device=device, dtype=dtype, g=g)
            xn = rms_ref(x.float().reshape(1, H), nw.float(), 1e-5).reshape(H)
            a = _distinct_logits(1, E, "cpu", torch.float32, g).reshape(E)
            rw = (a[:, None] * xn.cpu()[None, :] / float((xn * xn).sum())).to(device=device, dtype=dtype)
            gu = _rand(E, 2 * I, H, device=device, dtype=dtype, g=g, scale=1 / math.sqrt(H))
            dn = _rand(E, H, I, device=device, dtype=dtype, g=g, scale=1 / math.sqrt(I))
            r = _rand(H, device=device, dtype=dtype, g=g) if res else None
            fid = torch.randperm(E, generator=g)[:k].to(device=device, dtype=torch.int32) if forced else None
            cfg = ((2, 4), (1, 2), (4, 8))[i]
            rm = mr.RoutedMoE(E, H, I, k, device, dtype)
            saved = mr.MAX_TILE
            mr.MAX_TILE = tile or saved
            try:
                for _rep in range(2):
                    out = torch.full((H,), float("nan"), device=device, dtype=dtype)
                    rm(x, rw, gu, dn, norm_topk, residual=r, norm_w=nw, forced_ids=fid, out=out, router_config=cfg,
                       gate_up_config=cfg, down_config=cfg, pdl=pdl, residual_scale=scale)
            finally:
                mr.MAX_TILE = saved
            ref = mr.moe_routed_ref(x, rw, gu, dn, k, norm_topk, r, nw, 1e-5, fid, scale)
            err = rel_err(out, ref) if int(rm.count.sum()) == 0 else float("inf")
            name = (f"moe_routed{'+res' * res}{'+scaled' * (scale != 1.0)}{'+renorm' * norm_topk}{'+forced' * forced}"
                    f"{'+kloop' * bool(tile)}")
            rows.append(_row(name, (E, I, H, k, cfg), dtype, err))
    return rows


def check_attention_rope(device, dtype, g, pdl=False, shapes=((4, 4, 32, 100, 76, 32), (8, 2, 16, 40, 17, 2),
                                                                (16, 16, 128, 600, 555, 128),
                                                                (32, 8, 64, 300, 299, 1024),
                                                                (32, 8, 64, 4100, 4000, 128),
                                                                (4, 2, 32, 300, 250, 32, 64),
                                                                (8, 2, 16, 600, 599, 16, 48),
                                                                (4, 4, 32, 200, 150, 64, 64),
                                                                (4, 2, 16, 200, 9, 16),
                                                                (4, 2, 16, 520, 20, 16))):
    """Norm + rotary + cache write + split-KV + combine (in the kernel up to MERGE_MAX_SPLITS splits, else
    attention's combine launch: shapes with 4, 20, 5, 1 and 33 splits) against rope_ref then attention_ref.
    Cache positions from pos on are NaN before the launch (pos must be written, never read; later ones
    never touched); two launches in a row (the self-resetting per-head counters). A 7th number is the span
    the layout is built for, shorter than the context: its last split takes the positions past the grid
    (2 splits over 250 positions, 3 over 599 with the in-kernel merge, one split of a 64-position span). The
    last two are a long cache at a short context, as a static split over the front door's one cache is: 13 splits
    merged in the kernel and 33 by the combine, of which 1 and 2 hold positions (the rest return at once and
    must not arrive at the counter or be merged)."""
    from tkcc.kernels.attention_rope import AttentionRope, attention_rope_ref, tile_fits

    rows = []
    for j, (hq, hkv, D, S, pos, chunk, *span) in enumerate(shapes):
        for norm in (False, True):
            bs, nw = _attn_tile(2 * j + norm)
            i = 2 * j + norm
            while not tile_fits(device, hq // hkv, D, norm, bs, nw):  # a tile the device cannot run: the next
                i += 1
                bs, nw = _attn_tile(i)
            qkv = _rand((hq + 2 * hkv) * D, device=device, dtype=dtype, g=g)
            inv_freq = _inv_freq(D, device)
            qn = _rand(hq * D, device=device, dtype=dtype, g=g) if norm else None
            kn = _rand(hkv * D, device=device, dtype=dtype, g=g) if norm else None
            kc, vc = (_rand(hkv, S, D, device=device, dtype=dtype, g=g) for _ in range(2))
            kc[:, pos:] = float("nan")
            vc[:, pos:] = float("nan")
            kr, vr = kc.clone(), vc.clone()
            ar = AttentionRope(hq, hkv, D, S, chunk, device, block_s=bs, num_warps=nw,
                               span=span[0] if span else None)
            p = torch.tensor([pos], device=device, dtype=torch.int32)
            for _rep in range(2):
                out = torch.full((hq, D), float("nan"), device=device, dtype=dtype)
                ar(qkv, kc, vc, p, inv_freq, qn, kn, out=out, pdl=pdl)
            ref = attention_rope_ref(qkv, kr, vr, pos, inv_freq, hq, hkv, qn, kn)
            err = max(rel_err(out, ref), rel_err(kc[:, :pos + 1], kr[:, :pos + 1]),
                      rel_err(vc[:, :pos + 1], vr[:, :pos + 1]))
            if int(ar.count.sum()) != 0 or not torch.isnan(kc[:, pos + 1:]).all():
                err = float("inf")
            rows.append(_row(f"attention_rope{'+qknorm' * norm}",
                             (hq, hkv, D, S, pos, f"splits={ar.splits}", f"tile={bs}x{nw}",
                              *(f"span={v}" for v in span)), dtype, err))
    return rows


# on the interpreter: the first two shapes and the three laid out for a span shorter than the context
check_attention_rope.cpu_shapes = check_attention_rope.__defaults__[1][:2] + check_attention_rope.__defaults__[1][5:]

LAYERS = 2  # caches one layout's scratch serves in a row in check_attention_long, as a step's layers share it


def check_attention_long(device, dtype, g, pdl=False, shapes=(
        (16, 16, 128, 8232, (8192, 8191, 5806), (64, 128, 256, 512, 1024, 2048), ((256, 1024), (512, 4096))),
        (32, 8, 64, 8232, (8192, 8191), (128, 512, 2048), ((256, 1024),)))):
    """Decode attention at long context on the reference models' heads: OLMoE's (16 MHA heads of 128, q/k
    norm over the whole projection) and Llama-1B's (32 q / 8 kv heads of 64), a cache of 8232 positions (the
    benchmark's at context 8192). The new token on a split boundary (8192: its split holds no cached position,
    only the new one) and inside a split; every chunk the tuners try (several splits merged in the kernel, more
    than MERGE_MAX_SPLITS merged by the combine launch) and layouts laid out for a shorter span
    (``AttentionRope(span=)``: its last split takes every position past the grid); tiles cycled. The fused
    kernel (attention_rope) and the separate path (rope, attention + combine, same layout) against rope_ref
    then attention_ref, each layout's scratch serving LAYERS caches in a row as a step's layers share it.
    Cache positions from pos on are NaN before the launch (pos is written, never read; later ones untouched).
    Shapes: (hq, hkv, D, S, positions, chunks, (chunk, span) layouts)."""
    from tkcc.kernels.attention import attention
    from tkcc.kernels.attention_rope import AttentionRope, attention_rope_ref, tile_fits
    from tkcc.kernels.rotary import rope

    rows = []
    i = 0
    for hq, hkv, D, S, positions, chunks, spans in shapes:
        inv_freq = _inv_freq(D, device)
        layouts = [(c, None) for c in chunks] + [tuple(s) for s in spans]
        for pos in positions:
            for chunk, span in layouts:
                bs, nw = _attn_tile(i)
                while not tile_fits(device, hq // hkv, D, True, bs, nw):  # a tile the device cannot run: the next
                    i += 1
                    bs, nw = _attn_tile(i)
                i += 1
                ar = AttentionRope(hq, hkv, D, S, chunk, device, block_s=bs, num_warps=nw, span=span)
                p = torch.tensor([pos], device=device, dtype=torch.int32)
                errs, sep = [], []
                for _layer in range(LAYERS):
                    qkv = _rand((hq + 2 * hkv) * D, device=device, dtype=dtype, g=g)
                    qn = _rand(hq * D, device=device, dtype=dtype, g=g)
                    kn = _rand(hkv * D, device=device, dtype=dtype, g=g)
                    kc, vc = (_rand(hkv, S, D, device=device, dtype=dtype, g=g) for _ in range(2))
                    kc[:, pos:] = float("nan")
                    vc[:, pos:] = float("nan")
                    kr, vr = kc.clone(), vc.clone()
                    k2, v2 = kc.clone(), vc.clone()
                    out = torch.full((hq, D), float("nan"), device=device, dtype=dtype)
                    ar(qkv, kc, vc, p, inv_freq, qn, kn, out=out, pdl=pdl)
                    ref = attention_rope_ref(qkv, kr, vr, pos, inv_freq, hq, hkv, qn, kn)
                    err = max(rel_err(out, ref), rel_err(kc[:, :pos + 1], kr[:, :pos + 1]),
                              rel_err(vc[:, :pos + 1], vr[:, :pos + 1]))
                    if int(ar.count.sum()) != 0 or not torch.isnan(kc[:, pos + 1:]).all():
                        err = float("inf")
                    errs.append(err)
                    if span is None:  # the separate path takes the whole cache's grid only
                        q = rope(qkv, k2, v2, p, inv_freq, hq, hkv, qn, kn, pdl=pdl)
                        out2 = torch.full((hq, D), float("nan"), device=device, dtype=dtype)
                        attention(q, k2, v2, p + 1, splits=ar.splits, chunk=ar.chunk, out=out2,
                                  partials=(ar.po, ar.plse), block_s=bs, num_warps=nw, pdl=pdl)
                        sep.append(rel_err(out2, ref))
                shape = (hq, hkv, D, S, pos, f"splits={ar.splits}x{ar.chunk}", f"tile={bs}x{nw}",
                         *((f"span={span}",) if span else ()))
                rows.append(_row("attention_long:attention_rope+qknorm", shape, dtype, max(errs)))
                if sep:
                    rows.append(_row("attention_long:rope+attention", shape, dtype, max(sep)))
    return rows


# on the interpreter: OLMoE's head (MHA, 128 wide) and a GQA head over 300 positions, the same cases at that
# scale: the new token on a split boundary (256) and inside one; 19 splits (combine), 10 (merged in the
# kernel), 3; a grid laid out for a 128-position span; the GQA head on the boundary over 19 splits
check_attention_long.cpu_shapes = ((2, 2, 128, 300, (256, 255), (16, 32, 128), ((32, 128),)),
                                   (4, 1, 64, 300, (256,), (16,), ()))


def check_cache_bounds(device, dtype, g, pdl=False, shapes=((4, 2, 32, 40, 16), (8, 2, 16, 24, 24),
                                                             (32, 8, 64, 300, 128))):
    """A position at or past the cache (a raw graph replay the host did not check): rope, attention_rope and
    attention write nothing and read nothing outside it. The caches are carved out of a larger buffer whose
    tail is a guard; cache and guard must come out bit-identical. Outputs: q rotated at that position
    (rope), attention of that q over the S cached positions only (attention_rope), attention over the S
    positions (attention told seqlen > S)."""
    from tkcc.kernels.attention import attention, attention_ref
    from tkcc.kernels.attention_rope import AttentionRope
    from tkcc.kernels.rotary import rope, rope_ref

    rows = []
    for hq, hkv, D, S, chunk in shapes:
        splits = -(-S // chunk)
        for pos in sorted({S, S + 1, max(S, splits * chunk - 1)}):  # the last: inside the last split's range
            qkv = _rand((hq + 2 * hkv) * D, device=device, dtype=dtype, g=g)
            inv_freq = _inv_freq(D, device)
            guard = 3 * S * D
            bufs = [_rand(hkv * S * D + guard, device=device, dtype=dtype, g=g) for _ in range(2)]
            kc, vc = (b[: hkv * S * D].view(hkv, S, D) for b in bufs)
            before = [b.clone() for b in bufs]
            scratch = [torch.zeros(hkv, pos + 1, D, device=device, dtype=dtype) for _ in range(2)]
            q_ref = rope_ref(qkv, *scratch, pos, inv_freq, hq, hkv)  # q does not depend on the cache
            p = torch.tensor([pos], device=device, dtype=torch.int32)
            untouched = lambda: all(torch.equal(b, b0) for b, b0 in zip(bufs, before))  # noqa: E731

            q = rope(qkv, kc, vc, p, inv_freq, hq, hkv, pdl=pdl)
            err = rel_err(q, q_ref) if untouched() else float("inf")
            rows.append(_row("cache_bounds:rope", (hq, hkv, D, S, pos), dtype, err))

            ar = AttentionRope(hq, hkv, D, S, chunk, device, block_s=16)
            out = torch.full((hq, D), float("nan"), device=device, dtype=dtype)
            ar(qkv, kc, vc, p, inv_freq, out=out, pdl=pdl)
            ref = attention_ref(q_ref, kc, vc, S)
            err = rel_err(out, ref) if untouched() and int(ar.count.sum()) == 0 else float("inf")
            rows.append(_row("cache_bounds:attention_rope", (hq, hkv, D, S, pos, f"splits={ar.splits}"), dtype, err))

            qa = _rand(hq, D, device=device, dtype=dtype, g=g)
            out = attention(qa, kc, vc, p + 1, splits=ar.splits, chunk=ar.chunk, block_s=16, pdl=pdl)
            err = rel_err(out, attention_ref(qa, kc, vc, S)) if untouched() else float("inf")
            rows.append(_row("cache_bounds:attention", (hq, hkv, D, S, pos + 1, f"splits={ar.splits}"), dtype, err))
    return rows


def check_argmax(device, dtype, g, pdl=False, shapes=((1, 4133, None), (3, 128256, None), (2, 50000, 1024))):
    """The index torch.argmax gives, exactly: random rows, rows of few distinct values (ties: the first), NaN and
    infinities (the first NaN), signed zeros (equal), rows read from a [B, 2, V] tensor's last position."""
    from tkcc.kernels.argmax import argmax, argmax_ref

    rows = []
    for B, V, block in shapes:
        x = _rand(B, V, device=device, dtype=dtype, g=g)
        cases = {"random": x, "ties": torch.randint(0, 3, (B, V), generator=g).to(device=device, dtype=dtype),
                 "zeros": torch.zeros(B, V, device=device, dtype=dtype) * torch.where(
                     torch.rand(B, V, generator=g) < 0.5, -1.0, 1.0).to(device=device, dtype=dtype)}
        special = x.clone()
        cols = torch.randint(0, V, (4,), generator=g).tolist()
        special[:, cols[0]] = float("inf")
        special[-1, cols[1]] = float("nan")
        special[-1, cols[2]] = float("nan")
        special[0, cols[3]] = float("-inf")
        cases["nan_inf"] = special
        cases["strided"] = torch.stack([_rand(B, V, device=device, dtype=dtype, g=g), x], dim=1)[:, -1]
        for name, t in cases.items():
            got, ref = argmax(t, block=block), argmax_ref(t)
            rows.append(_row(f"argmax:{name}", (B, V, block), dtype, 0.0 if torch.equal(got, ref) else float("inf")))
    return rows


check_argmax.cpu_shapes = ((1, 4133, 512), (3, 1000, 64))


FAMILIES = {
    "gemv": check_gemv,
    "argmax": check_argmax,
    "rmsnorm": check_rmsnorm,
    "router": check_router,
    "moe": check_moe,
    "attention": check_attention,
    "rope": check_rope,
    "moe_routed": check_moe_routed,
    "attention_rope": check_attention_rope,
    "attention_long": check_attention_long,
    "cache_bounds": check_cache_bounds,
}


def run_checks(device="cpu", dtype=torch.float32, families=None, seed=None, pdl=False,
               cpu_shapes: int | None = None):
    """``pdl``: launch with programmatic dependent launch (GPU, Hopper+) — the variant a captured step uses.
    ``cpu_shapes``: only the first N of each family's CPU shapes (a second dtype's run, whose masks and tiles the
    first one covered)."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, (1,))))
    rows = []
    for name in families or FAMILIES:
        fn = FAMILIES[name]
        kw = {}
        if str(device) == "cpu":  # the interpreter runs programs one by one: the first two shapes per family
            default = inspect.signature(fn).parameters["shapes"].default
            kw["shapes"] = getattr(fn, "cpu_shapes", default[:2])[:cpu_shapes]
        got = fn(device, dtype, g, pdl=pdl, **kw)
        for r in got:
            r["pdl"] = pdl
        rows += got
    return rows


if __name__ == "__main__":  # python -m tkcc.kernels.checks [family ...] (TKCC_CHECK_DTYPE, TKCC_CHECK_SHAPES)
    import json
    import os
    import sys

    dt = getattr(torch, os.environ.get("TKCC_CHECK_DTYPE", "float32"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = os.environ.get("TKCC_CHECK_SHAPES")
    res = run_checks(dev, dt, sys.argv[1:] or None, cpu_shapes=int(n) if n else None)
    bad = [r for r in res if not r["ok"]]
    print(json.dumps({"n": len(res), "failed": bad}, indent=1))
    sys.exit(1 if bad else 0)
