"""Every rewrite of ``lowered_decode`` against its pattern, on fresh random inputs and several shapes.

Each case is a small module whose forward is a rewrite's pattern (the plain PyTorch of the region, with its
weights and caches as the module's own tensors, as in a captured model). It is captured like a Program's
graphs, lowered by the pass's own stages (``decode.lower``), and both run on fresh random inputs: the
lowered graph must hold the rewrite's op (the region matched), and agree with the pattern run eagerly —
bit for bit for a rewrite declared exact, within the kernels' tolerance otherwise (``tkcc.kernels.checks``).
Cases that write a cache compare the cache too. Used by the CPU tests (under the Triton interpreter, fp32
and fp16, so the kernels run) and the GPU tests (bf16). Each check returns rows
``{case, shape, dtype, op, rel_err, tol, exact, ok}``.
"""
from __future__ import annotations

import inspect

import torch

from tkcc.kernels.checks import TOL, rel_err


def _rand(shape, g, device, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


class Region(torch.nn.Module):
    """``fn(self, *inputs)`` with the tensors given as buffers (weights, caches): a region as a model holds it."""

    def __init__(self, fn, tensors: dict):
        super().__init__()
        self.fn = fn
        for k, v in tensors.items():
            self.register_buffer(k, v, persistent=False)

    def forward(self, *inputs):
        return self.fn(self, *inputs)


def _capture(module, inputs):
    from tkcc.frontend.export import export_graph

    with torch.no_grad():
        gm, _ = export_graph(module, inputs, what="lowering check region")
    return gm


def _options(chunk=64, tile=(16, 4), pdl=False):
    return {"pdl": pdl, "attention_layout": lambda hq, hkv, D, S: (chunk, tile), "gemv_configs": {}}


def run_case(name, module, make_inputs, op, exact, dtype, options=None, state=(), gone=()):
    """Capture ``module``, lower it, and compare on two fresh inputs; ``state``: buffer names it writes; ``gone``:
    aten ops the region holds that the lowered graph must not (folded into ``op``)."""
    from tkcc.passes.lower.decode import lower

    gm = _capture(module, make_inputs())
    lowered = _capture(module, make_inputs())
    info = lower(lowered, dtype, options or _options())
    ops = [str(n.target) for n in lowered.graph.nodes if n.op == "call_function"]
    left = sorted({o for o in ops if o in gone})
    rows = []
    if op not in ops or left:
        return [{"case": name, "dtype": str(dtype), "op": op, "rel_err": float("inf"), "tol": 0, "exact": exact,
                 "ok": False, "why": f"{op} not in the lowered graph, or {left} left in it ({ops}); "
                                     f"notes: {info.notes}"}]
    for _ in range(2):
        inputs = make_inputs()
        saved = {k: getattr(module, k).clone() for k in state}
        with torch.no_grad():
            ref = module(*inputs)
        ref_state = {k: getattr(module, k).clone() for k in state}
        for k, v in saved.items():
            getattr(module, k).copy_(v)
        with torch.no_grad():
            got = lowered(*inputs)
        refs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
        gots = list(got) if isinstance(got, (tuple, list)) else [got]
        refs += [ref_state[k] for k in state]
        gots += [getattr(module, k) for k in state]
        same = all(torch.equal(a, b) for a, b in zip(refs, gots))
        err = max(rel_err(b, a) for a, b in zip(refs, gots))
        tol = 0.0 if exact else TOL[dtype]
        rows.append({"case": name, "dtype": str(dtype).replace("torch.", ""), "op": op, "rel_err": err, "tol": tol,
                     "exact": exact, "ok": bool(same if exact else err <= tol)})
    return rows


# ---- cases ------------------------------------------------------------------------------------------------

def check_norms(device, dtype, g, shapes=(48, 200, 2048)):
    from tkcc.passes.lower import norms

    rows = []
    for H in shapes:
        w = _rand((H,), g, device, dtype, 0.5) + 1
        b = _rand((H,), g, device, dtype, 0.1)
        x = lambda: (_rand((1, 1, H), g, device, dtype),)  # noqa: E731
        rows += run_case(f"rms_norm[{H}]", Region(lambda s, x: norms.rms_norm(x, s.w, eps=1e-6), {"w": w}), x,
                         "tkcc.rms_norm.default", False, dtype)
        rows += run_case(f"rms_norm_offset[{H}]",
                         Region(lambda s, x: norms.rms_norm_offset(x, s.w, eps=1e-6, offset=1.0), {"w": w}), x,
                         "tkcc.rms_norm.default", False, dtype)
        rows += run_case(f"rms_norm_weight_fp32[{H}]",
                         Region(lambda s, x: norms.rms_norm_weight_fp32(x, s.w, eps=1e-6), {"w": w}), x,
                         "tkcc.rms_norm.default", False, dtype)
        rows += run_case(f"layer_norm[{H}]", Region(lambda s, x: norms.layer_norm(x, s.w, s.b, eps=1e-5),
                                                    {"w": w, "b": b}), x, "tkcc.layer_norm.default", True, dtype)
    return rows


def check_gemv(device, dtype, g, shapes=((40, 48), (96, 200), (256, 64))):
    from tkcc.passes.lower import projections

    rows = []
    for (N, K), (norm, bias, gated, residual, up_act) in zip(
            [s for s in shapes for _ in range(5)],
            [(True, False, False, False, ""), (False, True, False, True, ""), (True, False, True, False, ""),
             (True, True, True, False, ""), (False, True, False, False, "gelu_tanh"),
             (False, False, False, True, ""), (True, True, False, False, ""), (False, False, "gelu_tanh", False, ""),
             (False, False, False, False, ""), (True, False, False, False, "relu2"),
             (True, False, False, True, ""), (False, True, "gelu", False, ""), (True, True, False, True, ""),
             (False, True, False, False, ""), (False, False, False, False, "gelu")]):
        pattern = projections._gemv_pattern(norm, bias, gated, residual, up_act)[0]
        n_out = 2 * N if gated else N
        t = {"w": _rand((n_out, K), g, device, dtype, K ** -0.5)}
        if bias:
            t["b"] = _rand((n_out,), g, device, dtype, 0.1)
        if norm:
            t["nw"] = _rand((K,), g, device, dtype, 0.5) + 1

        def fn(s, x, *r, norm=norm, bias=bias, pattern=pattern):
            ts = [x, s.w] + ([s.b] if bias else []) + ([s.nw] if norm else []) + list(r)
            return pattern(*ts, **({"eps": 1e-5} if norm else {}))

        def make(residual=residual, K=K, N=N):
            return (_rand((1, 1, K), g, device, dtype),) + ((_rand((1, 1, N), g, device, dtype),) if residual else ())

        tag = projections._tag(norm, bias, gated, residual, up_act)
        rows += run_case(f"gemv[{tag}][{N}x{K}]", Region(fn, t), make, "tkcc.gemv.default", False, dtype)
    return rows


ALPHAS = (1.681792830507429, 0.375, 2.5)  # MiniMax's alpha ((2 * 4) ** 0.25 at 4 layers), and two more


def check_scaled_residual(device, dtype, g, shapes=((40, 48), (96, 200), (64, 64))):
    """MiniMax's residual, the normed hidden state times alpha, added to a projection's output (either order of the
    add; with a norm prologue, a bias) -> ``tkcc.gemv``'s ``residual_scale``, and added to the routed experts of that
    state (its router, and the softmax one, renormalised or not) -> ``tkcc.moe``'s: no aten mul or add left."""
    from tkcc.passes.lower import projections, routed_experts

    rows = []
    for (N, K), alpha, (norm, bias, scaled) in zip(shapes, ALPHAS, ((False, False, "r*a+y"), (True, True, "y+r*a"),
                                                                    (False, True, "r*a+y"))):
        pattern = projections._gemv_pattern(norm, bias, False, True, "", scaled)[0]
        t = {"w": _rand((N, K), g, device, dtype, K ** -0.5)}
        if bias:
            t["b"] = _rand((N,), g, device, dtype, 0.1)
        if norm:
            t["nw"] = _rand((K,), g, device, dtype, 0.5) + 1

        def fn(s, x, r, norm=norm, bias=bias, pattern=pattern, alpha=alpha):
            ts = [x, s.w] + ([s.b] if bias else []) + ([s.nw] if norm else []) + [r]
            return pattern(*ts, alpha=alpha, **({"eps": 1e-5} if norm else {}))

        rows += run_case(f"gemv[{projections._tag(norm, bias, False, True, '', scaled)}, alpha {alpha:.3g}][{N}x{K}]",
                         Region(fn, t), lambda K=K, N=N: (_rand((1, 1, K), g, device, dtype),
                                                          _rand((1, 1, N), g, device, dtype)),
                         "tkcc.gemv.default", False, dtype, gone=("aten.mul.Tensor", "aten.add.Tensor"))
    for (E, H, I, k), alpha, (router, renorm) in zip(((8, 48, 20, 2), (12, 64, 32, 3), (16, 32, 16, 4)), ALPHAS,
                                                     (("softmax_fp32", True), ("softmax", False), ("softmax", True))):
        pattern = routed_experts.scaled_residual(router, renorm)[0]
        t = {"router": _rand((E, H), g, device, dtype, H ** -0.5),
             "gate_up": _rand((E, 2 * I, H), g, device, dtype, H ** -0.5),
             "down": _rand((E, H, I), g, device, dtype, I ** -0.5)}

        def fn(s, h, pattern=pattern, k=k, alpha=alpha):
            return pattern(h, s.router, s.gate_up, s.down, top_k=k, alpha=alpha)

        rows += run_case(f"moe[E={E} top-{k}, {H}x{I}, {router}{'+renorm' if renorm else ''}, + the input times "
                         f"{alpha:.3g}]", Region(fn, t),
                         lambda H=H, t=t, k=k: _clear_routing(lambda: (_rand((1, 1, H), g, device, dtype),),
                                                              _logits(t["router"]), k, _near(dtype)),
                         "tkcc.moe.default", False, dtype, gone=("aten.mul.Tensor", "aten.add.Tensor"))
    return rows


def check_residual2(device, dtype, g, shapes=((40, 48), (96, 200), (64, 64))):
    """DeepSeek's MoE layer end: the decoder's residual h added to the routed experts' output plus the shared down
    projection, ``h + (moe_out + down(x))`` (either order of the outer add; with a norm prologue, a bias) -> one
    ``tkcc.gemv`` with ``residual=moe_out, residual2=h``: no aten add left."""
    from tkcc.passes.lower import projections

    rows = []
    for (N, K), (norm, bias, second) in zip(shapes, ((False, False, "r2+t"), (True, True, "t+r2"),
                                                     (False, True, "t+r2"))):
        pattern = projections._gemv_pattern(norm, bias, False, True, "", "", second)[0]
        t = {"w": _rand((N, K), g, device, dtype, K ** -0.5)}
        if bias:
            t["b"] = _rand((N,), g, device, dtype, 0.1)
        if norm:
            t["nw"] = _rand((K,), g, device, dtype, 0.5) + 1

        def fn(s, x, r, r2, norm=norm, bias=bias, pattern=pattern):
            ts = [x, s.w] + ([s.b] if bias else []) + ([s.nw] if norm else []) + [r, r2]
            return pattern(*ts, **({"eps": 1e-5} if norm else {}))

        rows += run_case(f"gemv[{projections._tag(norm, bias, False, True, '', '', second)}][{N}x{K}]",
                         Region(fn, t), lambda K=K, N=N: (_rand((1, 1, K), g, device, dtype),
                                                          _rand((1, 1, N), g, device, dtype),
                                                          _rand((1, 1, N), g, device, dtype, 4.0)),
                         "tkcc.gemv.default", False, dtype, gone=("aten.add.Tensor",))
    return rows


def check_gather(device, dtype, g, shapes=((40, 48, 100), (96, 64, 300))):
    """The first GEMV reading the token's embedding row itself (and writing it out as the residual stream)."""
    from tkcc.passes.lower import projections

    rows = []
    for N, K, V in shapes:
        for bias in (False, True):
            t = {"table": _rand((V, K), g, device, dtype), "nw": _rand((K,), g, device, dtype, 0.5) + 1,
                 "w": _rand((N, K), g, device, dtype, K ** -0.5)}
            if bias:
                t["b"] = _rand((N,), g, device, dtype, 0.1)

            def fn(s, ids, bias=bias):
                if bias:
                    return projections.embed_gemv_bias(s.table, ids, s.nw, s.w, s.b, eps=1e-5)
                return projections.embed_gemv(s.table, ids, s.nw, s.w, eps=1e-5)

            rows += run_case(f"gemv_gather[{N}x{K}, {V} rows{', bias' if bias else ''}]", Region(fn, t),
                             lambda V=V: (torch.randint(0, V, (1, 1), generator=g).to(device),),
                             "tkcc.gemv_gather.default", False, dtype)
    return rows


def check_packing(device, dtype, g, shapes=((48, 16, 16), (64, 32, 32))):
    """q|k|v and gate|up siblings packed into one GEMV, split after; a per-head q|k|v projection stored split."""
    from tkcc.passes.lower import projections

    rows = []
    for K, n1, n2 in shapes:
        w = {f"w{i}": _rand((n, K), g, device, dtype, K ** -0.5) for i, n in enumerate((n1 + n2, n1, n2))}
        rows += run_case(f"pack3[{K}]", Region(lambda s, x: projections.linears3(x, s.w0, s.w1, s.w2), w),
                         lambda K=K: (_rand((1, 1, K), g, device, dtype),), "tkcc.gemv.default", False, dtype)
        rows += run_case(f"pack2[{K}]", Region(lambda s, x: projections.linears2(x, s.w0, s.w1), w),
                         lambda K=K: (_rand((1, 1, K), g, device, dtype),), "tkcc.gemv.default", False, dtype)
    # Falcon's ``x @ W.T [+ b]``: canonicalised to F.linear, then one GEMV
    for (K, N), rw in zip(((48, 40), (64, 96)), projections.MATMUL_LINEAR):
        bias = rw is projections.MATMUL_LINEAR[0]
        t = {"w": _rand((N, K), g, device, dtype, K ** -0.5)}
        if bias:
            t["b"] = _rand((N,), g, device, dtype, 0.1)
        rows += run_case(f"{rw.name}[{N}x{K}]", Region(lambda s, x, rw=rw, bias=bias: rw.pattern(
            x, s.w, *([s.b] if bias else [])), t), lambda K=K: (_rand((1, 1, K), g, device, dtype),),
            "tkcc.gemv.default", False, dtype)
    # GPT-NeoX's per-head [q_h | k_h | v_h] rows: one GEMV storing [q | k | v] (heads, head dim, with a bias or not)
    for (K, H, D), rw in zip(((48, 4, 16), (64, 2, 32), (40, 3, 8), (32, 1, 16)), projections.PER_HEAD_QKV * 2):
        bias = rw is projections.PER_HEAD_QKV[0]
        t = {"w": _rand((3 * H * D, K), g, device, dtype, K ** -0.5)}
        if bias:
            t["b"] = _rand((3 * H * D,), g, device, dtype, 0.1)

        def fn(s, x, rw=rw, bias=bias, D=D):
            return rw.pattern(x, s.w, *([s.b] if bias else []), width=3 * D)

        rows += run_case(f"{rw.name}[{H}x{D}, {K}]", Region(fn, t), lambda K=K: (_rand((1, 1, K), g, device, dtype),),
                         "tkcc.gemv.default", False, dtype)
    return rows


def step_mask(pos, S: int, window: int = 0):
    """The step's mask over an S-position cache as transformers builds it: sliding with a window, else causal."""
    from tkcc.passes.lower import attention

    return attention.sliding_mask(pos, kv_len=S, window=window) if window else attention.causal_mask(pos, kv_len=S)


def attention_case(pattern, hq, hkv, D, S, window, qk_norm, rope_scale, rotary_dim, g, device, dtype,
                   table_dtype=None, table=None):
    """(tensors, fn, make) of one attention region's check: fresh caches, the rotary table over ``rotary_dim`` of
    the head (in ``table_dtype``, default the activations'; ``table``: the rotary embedding that makes it, default
    ``rotary.cos_sin``), the q/k norm weights; ``fn`` runs ``pattern`` under the step's causal or sliding mask,
    ``make`` draws a q|k|v row and a position."""
    from tkcc.passes.lower import attention, rotary

    R = rotary_dim
    t = {"kc": _rand((1, hkv, S, D), g, device, dtype), "vc": _rand((1, hkv, S, D), g, device, dtype),
         "inv_freq": 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R)).to(device)}
    if qk_norm:
        t["qn"] = _rand((D if qk_norm in attention.PER_HEAD else hq * D,), g, device, dtype, 0.5) + 1
        t["kn"] = _rand((D if qk_norm in attention.PER_HEAD else hkv * D,), g, device, dtype, 0.5) + 1

    def fn(s, qkv, pos):
        cos, sin = (table or rotary.cos_sin)(s.inv_freq, pos.unsqueeze(0), scale=rope_scale,
                                             dtype=table_dtype or qkv.dtype)
        mask = step_mask(pos, S, window)
        norms = (s.qn, s.kn) if qk_norm else ()
        kw = {"eps": 1e-5} if qk_norm else {}
        return pattern(qkv, s.kc, s.vc, pos, cos, sin, mask, *norms, scale=D ** -0.5, **kw)

    def make():
        pos = torch.randint(0, S, (1,), generator=g).to(device)
        return _rand((1, 1, (hq + 2 * hkv) * D), g, device, dtype), pos

    return t, fn, make


def check_attention(device, dtype, g, shapes=((4, 2, 16, 40, 16, 0), (4, 4, 32, 64, 64, 0), (8, 1, 16, 100, 16, 24),
                                              (4, 2, 16, 300, 16, 0), (4, 2, 16, 64, 16, 10))):
    """Cache write + attention (+ rotary, + q/k norm over the projection or each head, before or after the heads
    are transposed), GQA/MHA/MQA, one and several splits (the fourth shape:
    more splits than the in-kernel merge takes, so the combine launch runs), plain and scaled rotary, causal
    and sliding-window masks."""
    from tkcc.passes.lower import attention

    rows = []
    for i, (hq, hkv, D, S, chunk, window) in enumerate(shapes):
        for j, qk_norm in enumerate(("", "full", "head" if i % 2 == 0 else "head_transposed")):
            rope_scale = 1.0 if (i + j) % 2 == 0 else 0.75
            pattern = attention._attention_pattern(qk_norm)[0]
            t, fn, make = attention_case(pattern, hq, hkv, D, S, window, qk_norm, rope_scale, D, g, device, dtype)
            name = f"attention[{hq}/{hkv}x{D}, S={S}, chunk={chunk}{', ' + qk_norm + ' qk_norm' if qk_norm else ''}" \
                   f"{', rope x' + str(rope_scale) if rope_scale != 1.0 else ''}{f', window {window}' if window else ''}]"
            rows += run_case(name, Region(fn, t), make, "tkcc.attention_rope.default", False, dtype,
                             _options(chunk=chunk), state=("kc", "vc"))
    return rows + check_fused_heads_mqa(device, dtype, g) + check_plain_attention(device, dtype, g)


def check_fused_heads_mqa(device, dtype, g, shapes=((4, 16, 40, 16, 0), (8, 32, 100, 16, 24), (2, 64, 300, 16, 0))):
    """Falcon's multi-query block (``attention.fused_heads_mqa``: the heads indexed out of the projection by list
    constants, one key head broadcast by sdpa): (hq, D, S, chunk, window); the third has more splits than the
    in-kernel merge takes."""
    from tkcc.passes.lower import attention, rotary

    rows = []
    for hq, D, S, chunk, window in shapes:
        t, _fn, make = attention_case(None, hq, 1, D, S, window, "", 1.0, D, g, device, dtype)

        def fn(s, qkv, pos, S=S, window=window):
            cos, sin = rotary.cos_sin(s.inv_freq, pos.unsqueeze(0), scale=1.0, dtype=qkv.dtype)
            mask = step_mask(pos, S, window)
            heads = (torch.tensor([-2], device=pos.device), torch.tensor([-1], device=pos.device))
            return attention.fused_heads_mqa(qkv, s.kc, s.vc, pos, cos, sin, mask, *heads)

        rows += run_case(f"attention[{hq}/1x{D}, S={S}, chunk={chunk}, fused heads (Falcon's multi-query)"
                         f"{f', window {window}' if window else ''}]", Region(fn, t), make,
                         "tkcc.attention_rope.default", False, dtype, _options(chunk=chunk), state=("kc", "vc"))
    return rows


def check_plain_attention(device, dtype, g, shapes=((4, 4, 16, 40, 16, 0, "even", ""),
                                                    (8, 1, 32, 100, 16, 24, "unsqueezed", ""),
                                                    (4, 2, 16, 300, 16, 0, "split", "head_transposed"),
                                                    (4, 2, 32, 64, 16, 0, "split", "head"))):
    """The blocks with no rotation (``attention_plain``: GPT-2's even split, GPT-BigCode's multi-query, a NoPE
    layer's, with per-head q/k norms or not): (hq, hkv, D, S, chunk, window, form, q/k norm); the third has more
    splits than the in-kernel merge takes."""
    from tkcc.passes.lower import attention_plain

    rows = []
    for hq, hkv, D, S, chunk, window, form, qk_norm in shapes:
        t, _fn, make = attention_case(None, hq, hkv, D, S, window, qk_norm, 1.0, D, g, device, dtype)
        pattern = attention_plain._pattern(form, qk_norm)

        def fn(s, qkv, pos, S=S, window=window, pattern=pattern, qk_norm=qk_norm):
            mask = step_mask(pos, S, window)
            norms, kw = ((s.qn, s.kn), {"eps": 1e-5}) if qk_norm else ((), {})
            return pattern(qkv, s.kc, s.vc, pos, mask, *norms, scale=D ** -0.5, **kw)

        rows += run_case(f"attention[{hq}/{hkv}x{D}, S={S}, chunk={chunk}, no rotary, {form}"
                         f"{', ' + qk_norm + ' qk_norm' if qk_norm else ''}"
                         f"{f', window {window}' if window else ''}]", Region(fn, t), make,
                         "tkcc.attention_rope.default", False, dtype, _options(chunk=chunk), state=("kc", "vc"))
    return rows


def _clear_routing(draw, choice, k, rel, tries=100):
    """``draw`` again until the top-k of ``choice(inputs)`` (the router's choice scores, [T, E]) is no rounding tie:
    the k-th and (k+1)-th scores lie further apart than ``rel`` times the largest, more than rounding could move
    them. A tie's two answers are both right and differ by a whole expert's output; ties themselves are the
    forced-ids cases' job."""
    for _ in range(tries):
        inputs = draw()
        sc = choice(inputs).float().sort(-1, descending=True).values
        if bool(((sc[:, k - 1] - sc[:, k]) > rel * sc.abs().amax(-1)).all()):
            return inputs
    raise RuntimeError(f"no input without a top-{k} tie in {tries} draws")


def _logits(router, norm_weight=None):
    """The router's logits of a case's first input (normed by ``norm_weight`` first, as the block does)."""
    from tkcc.kernels.lowered import rms_norm_ref

    def choice(inputs):
        x = inputs[0].float().reshape(-1, router.shape[-1])
        if norm_weight is not None:
            x = rms_norm_ref(x, norm_weight.float(), 1e-5)
        return torch.nn.functional.linear(x, router.float())
    return choice


def _near(dtype):
    return 16 * torch.finfo(dtype).eps


def check_moe(device, dtype, g, shapes=((8, 48, 20, 2), (12, 64, 32, 3), (16, 32, 16, 4))):
    """Norm + router + routed experts (+ residual): softmax / renormalised / Mixtral's fp32 weights; the routed
    experts of a normed input, also under GraniteMoE's top-k-then-softmax router."""
    from tkcc.passes.lower import moe, routed_experts

    rows = []
    variants = [("softmax", False, True), ("softmax", True, True), ("softmax_fp32", True, True),
                ("softmax", False, False)]
    for (E, H, I, k), (router, norm_topk, residual) in zip(shapes * 2, variants * 2):
        pattern = moe._moe_pattern(norm_topk, residual, router)[0]
        t = {"nw": _rand((H,), g, device, dtype, 0.5) + 1, "router": _rand((E, H), g, device, dtype, H ** -0.5),
             "gate_up": _rand((E, 2 * I, H), g, device, dtype, H ** -0.5),
             "down": _rand((E, H, I), g, device, dtype, I ** -0.5)}

        def fn(s, h, pattern=pattern, k=k):
            return pattern(h, s.nw, s.router, s.gate_up, s.down, eps=1e-5, top_k=k)

        name = f"moe[E={E} top-{k}, {H}x{I}, {router}{'+renorm' if norm_topk else ''}{'+residual' * residual}]"
        rows += run_case(name, Region(fn, t),
                         lambda H=H, t=t, k=k: _clear_routing(lambda: (_rand((1, 1, H), g, device, dtype),),
                                                              _logits(t["router"], t["nw"]), k, _near(dtype)),
                         "tkcc.moe.default", False, dtype)
    rows += check_deepseek_moe(device, dtype, g)
    rows += check_moe_forced(device, dtype, g, shapes)
    rows += check_gptoss_moe(device, dtype, g, shapes[:2])
    for (E, H, I, k), norm_min in zip(shapes[:2], (1e-12, 0.6)):  # the routed experts of a normed input (a block
        # with a shared expert); Ernie's floor under the renormalising sum at its default, and where it binds
        t = {"router": _rand((E, H), g, device, dtype, H ** -0.5),
             "gate_up": _rand((E, 2 * I, H), g, device, dtype, H ** -0.5),
             "down": _rand((E, H, I), g, device, dtype, I ** -0.5)}

        def draw(H=H, t=t, k=k):
            return _clear_routing(lambda: (_rand((1, H), g, device, dtype),), _logits(t["router"]), k, _near(dtype))

        rows += run_case(f"moe[E={E} top-{k}, {H}x{I}, routed experts of a normed input]",
                         Region(lambda s, xs, k=k: moe.routed(xs, s.router, s.gate_up, s.down, top_k=k), t),
                         draw, "tkcc.moe.default", False, dtype)
        # GraniteMoE's router: top-k of the fp32 logits, then a softmax over those k
        rows += run_case(f"moe[E={E} top-{k}, {H}x{I}, top-k then softmax]",
                         Region(lambda s, xs, k=k: routed_experts.topk_softmax_routed(xs, s.router, s.gate_up, s.down,
                                                                                       top_k=k), t),
                         draw, "tkcc.moe.default", False, dtype)
        # Ernie 4.5-MoE's router: fp32 logits, the choice on the softmax plus a bias, renorm over max(sum, norm_min)
        tb = {**t, "bias": _rand((1, E), g, device, torch.float32, 0.1)}

        def biased(inputs, tb=tb):
            p = torch.softmax(torch.nn.functional.linear(inputs[0].float(), tb["router"].float()), -1)
            return p + tb["bias"].reshape(-1)

        rows += run_case(f"moe[E={E} top-{k}, {H}x{I}, softmax+bias choice, renorm over max(sum, {norm_min})]",
                         Region(lambda s, xs, k=k, m=norm_min: routed_experts.biased_softmax_routed(
                             xs, s.router, s.bias, s.gate_up, s.down, top_k=k, norm_min=m), tb),
                         lambda H=H, k=k, c=biased: _clear_routing(lambda: (_rand((1, H), g, device, dtype),), c, k,
                                                                  1e-4),
                         "tkcc.moe.default", False, dtype)
    return rows


def gptoss_weights(E, H, I, g, device, dtype) -> tuple:
    """A random gpt-oss MoE block's weights, in the op's order: router and its bias, gate_up [E, H, 2I] and its
    bias, down [E, I, H] and its bias."""
    return (_rand((E, H), g, device, dtype, H ** -0.5), _rand((E,), g, device, dtype, 0.1),
            _rand((E, H, 2 * I), g, device, dtype, 3 * H ** -0.5), _rand((E, 2 * I), g, device, dtype, 0.3),
            _rand((E, I, H), g, device, dtype, I ** -0.5), _rand((E, H), g, device, dtype, 0.1))


def check_gptoss_moe(device, dtype, g, shapes):
    """gpt-oss's block (``biased_experts.biased_moe``): the router's bias, top-k then softmax, the transposed experts
    with their biases, the SwiGLU clamped at gpt-oss's limit and at one that binds on most columns."""
    from tkcc.passes.lower import biased_experts

    rows = []
    for (E, H, I, k), limit in zip(shapes, (7.0, 1.5)):
        t = dict(zip(("rw", "rb", "gu", "gub", "dn", "dnb"), gptoss_weights(E, H, I, g, device, dtype)))

        def logits(inputs, t=t):
            return torch.nn.functional.linear(inputs[0].float(), t["rw"].float(), t["rb"].float())

        def fn(s, xs, k=k, limit=limit):
            return biased_experts.biased_moe(xs, s.rw, s.rb, s.gu, s.gub, s.dn, s.dnb, top_k=k, alpha=1.702, limit=limit)

        rows += run_case(f"moe[gpt-oss: E={E} top-{k}, {H}x{I}, limit {limit}]", Region(fn, t),
                         lambda H=H, k=k, c=logits: _clear_routing(lambda: (_rand((1, H), g, device, dtype),), c, k,
                                                                  _near(dtype)),
                         "tkcc.moe_gptoss.default", False, dtype)
    return rows


def check_moe_forced(device, dtype, g, shapes):
    """The op with ``forced_ids`` (the benchmark's real-routing hook) against ``moe_ref`` given the same ids, and
    ``moe_ref`` forced to the router's own top-k against ``moe_ref`` routing by itself."""
    from tkcc.kernels.lowered import moe_ref, rms_norm_ref

    rows = []
    for (E, H, I, k), (router, norm_topk) in zip(shapes, (("softmax", False), ("softmax", True),
                                                       ("softmax_fp32", True))):
        nw, rw = _rand((H,), g, device, dtype, 0.5) + 1, _rand((E, H), g, device, dtype, H ** -0.5)
        gu, dn = _rand((E, 2 * I, H), g, device, dtype, H ** -0.5), _rand((E, H, I), g, device, dtype, I ** -0.5)
        h = _rand((1, 1, H), g, device, dtype)
        ids = torch.randperm(E, generator=g)[:k].to(device=device, dtype=torch.int32)
        count = torch.zeros(1, device=device, dtype=torch.int32)
        got = torch.ops.tkcc.moe(h, nw, 1e-5, rw, gu, dn, k, norm_topk, True, count, router=router, forced_ids=ids)
        ref = moe_ref(h, nw, 1e-5, rw, gu, dn, k, norm_topk, True, router, forced_ids=ids)
        err = rel_err(got, ref)
        name = f"moe forced[E={E} top-{k}, {H}x{I}, {router}{'+renorm' if norm_topk else ''}]"
        x = rms_norm_ref(h.view(1, H), nw, 1e-5)
        own = torch.topk(torch.softmax(torch.nn.functional.linear(x, rw).float(), -1), k, -1).indices[0]
        same = torch.equal(moe_ref(h, nw, 1e-5, rw, gu, dn, k, norm_topk, True, router, forced_ids=own),
                           moe_ref(h, nw, 1e-5, rw, gu, dn, k, norm_topk, True, router))
        rows += _forced_rows(name, dtype, "tkcc.moe.default", err, "moe_ref", same)
    rows += _check_gptoss_forced(device, dtype, g, shapes[:2])
    return rows


def _forced_rows(name, dtype, op, err, ref, same) -> list[dict]:
    """A forced-routing case's two rows: the op against its reference given the ids, and the reference forced to
    its own top-k against it routing by itself (bit for bit)."""
    dt = str(dtype).replace("torch.", "")
    return [{"case": name, "dtype": dt, "op": op, "rel_err": err, "tol": TOL[dtype], "exact": False,
             "ok": bool(err <= TOL[dtype])},
            {"case": name + " own top-k", "dtype": dt, "op": ref, "rel_err": 0.0 if same else float("inf"),
             "tol": 0.0, "exact": True, "ok": same}]


def _check_gptoss_forced(device, dtype, g, shapes):
    """``tkcc.moe_gptoss`` with ``forced_ids`` against ``moe_gptoss_ref`` given the same ids, and the reference
    forced to the router's own top-k against it routing by itself."""
    from tkcc.kernels.lowered import moe_gptoss_ref
    from tkcc.kernels.moe_gptoss import counters_any

    rows = []
    for E, H, I, k in shapes:
        w = gptoss_weights(E, H, I, g, device, dtype)
        xs = _rand((1, H), g, device, dtype)
        ids = torch.randperm(E, generator=g)[:k].to(device=device, dtype=torch.int32)
        count = torch.zeros(counters_any(H, I, k), device=device, dtype=torch.int32)
        got = torch.ops.tkcc.moe_gptoss(xs, *w, k, 1.702, 7.0, count, forced_ids=ids)
        err = rel_err(got, moe_gptoss_ref(xs, *w, k, 1.702, 7.0, ids))
        own = torch.topk(torch.nn.functional.linear(xs, w[0], w[1]), k, -1).indices[0]
        same = torch.equal(moe_gptoss_ref(xs, *w, k, 1.702, 7.0, own), moe_gptoss_ref(xs, *w, k, 1.702, 7.0))
        rows += _forced_rows(f"moe forced[gpt-oss: E={E} top-{k}, {H}x{I}]", dtype, "tkcc.moe_gptoss.default", err,
                             "moe_gptoss_ref", same)
    return rows


def deepseek_moe_block(E=16, H=64, I=32, k=4, n_group=4, topk_group=2, norm_topk=True, dtype=torch.float32,
                       device="cpu", g=None):
    """Hugging Face's own DeepSeek-V3 MoE block (sigmoid router with bias-corrected grouped top-k, routed and
    shared experts), random weights and correction bias."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = transformers.DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E,
                                        num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                                        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=norm_topk)
    cfg._experts_implementation = "batched_mm"
    m = DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * prm.shape[-1] ** -0.5)
        m.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    return m.to(device=device, dtype=dtype)


def check_deepseek_moe(device, dtype, g, shapes=((16, 64, 32, 4, 4, 2), (32, 48, 16, 6, 8, 3))):
    rows = []
    for (E, H, I, k, ng, tg), renorm in zip(shapes, (True, False)):
        m = deepseek_moe_block(E, H, I, k, ng, tg, renorm, dtype, device, g)
        rows += run_case(f"moe[DeepSeek-V3 block: E={E} top-{k} of {tg}/{ng} groups{', renorm' if renorm else ''}]", m,
                         lambda H=H: (_rand((1, 1, H), g, device, dtype),), "tkcc.moe.default", False, dtype)
    return rows


def qwen2_moe_block(E=8, H=64, I=32, k=2, dtype=torch.float32, device="cpu", g=None):
    """Hugging Face's own Qwen2-MoE sparse block (softmax router, routed experts, a shared expert behind a sigmoid
    gate), random weights."""
    import transformers
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = transformers.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=2 * I,
                                      num_experts=E, num_experts_per_tok=k, norm_topk_prob=False)
    cfg._experts_implementation = "batched_mm"
    m = Qwen2MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * prm.shape[-1] ** -0.5)
    return m.to(device=device, dtype=dtype)


def check_norm_readers(device, dtype, g, shapes=((16, 64, 32, 4), (8, 48, 16, 2))):
    """A MoE layer's second half as its decoder layer runs it, ``h + block(rms_norm(h))``, where the norm feeds the
    routed experts and the shared ones (DeepSeek-V3: the shared gate|up; Qwen2-MoE: also the shared expert's sigmoid
    gate): the norm goes into every reader's prologue, no ``tkcc.rms_norm`` left; DeepSeek's residual also goes
    (the shared down projection's second residual). Inputs drawn clear of routing ties (the router now norms its
    own copy of the row)."""
    from tkcc.kernels.lowered import rms_norm_ref
    from tkcc.passes.lower import norms

    eps = 1e-5
    rows = []
    for (E, H, I, k), family in zip(shapes, ("deepseek", "qwen2")):
        nw = _rand((H,), g, device, dtype, 0.5) + 1
        if family == "deepseek":  # every group eligible: the choice is the top-k of sigmoid scores + bias
            block = deepseek_moe_block(E, H, I, k, 4, 4, True, dtype, device, g)

            def choice(inputs, block=block, nw=nw):
                x = rms_norm_ref(inputs[0].float().reshape(-1, H), nw.float(), eps)
                return torch.sigmoid(torch.nn.functional.linear(x, block.gate.weight.float())) + \
                    block.gate.e_score_correction_bias.float()
            gone = ("tkcc.rms_norm.default", "aten.add.Tensor")
        else:
            block = qwen2_moe_block(E, H, I, k, dtype, device, g)
            choice, gone = _logits(block.gate.weight, nw), ("tkcc.rms_norm.default",)
        region = Region(lambda s, h: h + s.block(norms.rms_norm(h, s.nw, eps=eps)), {"nw": nw})
        region.block = block
        rows += run_case(f"rms_norm[into every reader's prologue: {family} E={E} top-{k}, {H}x{I}]", region,
                         lambda H=H, c=choice, k=k: _clear_routing(lambda: (_rand((1, 1, H), g, device, dtype),), c,
                                                                   k, _near(dtype)),
                         "tkcc.moe.default", False, dtype, gone=gone)
    return rows


FAMILIES = {"norms": check_norms, "gemv": check_gemv, "gather": check_gather, "packing": check_packing,
            "attention": check_attention, "moe": check_moe, "scaled_residual": check_scaled_residual,
            "residual2": check_residual2, "norm_readers": check_norm_readers}
from tkcc.passes.lower.checks_variants import FAMILIES as _VARIANTS  # noqa: E402 - rotary, sinks, linear attention

FAMILIES.update(_VARIANTS)


def check_mla(device, dtype, g, shapes=None):
    from tkcc.passes.lower.checks_mla import check_mla as check  # (imports this module: its cases are run_case's)

    return check(device, dtype, g, shapes)


FAMILIES["mla"] = check_mla


def run_checks(device="cpu", dtype=torch.float32, families=None, seed=None, first_shapes: int | None = None):
    """``first_shapes``: only each family's first N shapes (a second dtype's run under the interpreter, whose
    masks and tiles the first dtype's run covered)."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, (1,))))
    rows = []
    for name in families or FAMILIES:
        fn = FAMILIES[name]
        kw = {}
        if first_shapes is not None:
            default = inspect.signature(fn).parameters["shapes"].default
            if default:  # (None: the family picks its shapes by device, as MLA does)
                kw["shapes"] = tuple(default)[:first_shapes]
        rows += fn(device, dtype, g, **kw)
    return rows


if __name__ == "__main__":  # python -m tkcc.passes.lower.checks [family ...] (dtype by TKCC_CHECK_DTYPE)
    import json
    import os
    import sys

    from tkcc.kernels.common import fallbacks

    dt = getattr(torch, os.environ.get("TKCC_CHECK_DTYPE", "float32"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = run_checks(dev, dt, sys.argv[1:] or None)
    bad = [r for r in res if not r["ok"]]
    print(json.dumps({"n": len(res), "failed": bad, "fallbacks": fallbacks()}, indent=1))
    sys.exit(1 if bad else 0)
