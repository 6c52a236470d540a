"""Projections: sibling linears packed into one (q|k|v, gate|up), then each linear as one batch-1 GEMV with
what surrounds it fused: the RMSNorm before it (prologue), its bias, the gated activation after a packed
gate|up (``act(g) * u``: SiLU, GELU, tanh-GELU) or the activation after a non-gated MLP's up projection (GELU,
tanh-GELU, relu²), the residual add after it (epilogue), the residual scaled first (MiniMax's ``h * alpha + y``),
a second residual added to that sum (DeepSeek's ``h + (moe_out + shared_down(x))``).

Packing: linears that read the same activation (a decoder layer's q, k and v; its gate and up) become one
linear over their weights stacked row-wise, split after. The stacked weight is a view when capture already
packed the parameters side by side (``tkcc.frontend.weight_packing``), else a copy owned by the lowered
graph (the model's parameters are never re-pointed); codegen rebuilds it from the parameters when the
artifact binds (``tkcc_packed_from``), so an artifact never embeds weights.

GEMV patterns are generated for every combination of the fused parts (as TorchInductor generates its
attention patterns from one parameterised function), most fused first, so the largest region wins.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from tkcc.passes.lower.norms import EPS, rms_norm
from tkcc.passes.lower.pattern import Rewrite

K_EX, N_EX = 48, 40  # example widths (distinct from every literal of the patterns)
ALPHA = 1.4375  # sentinel: a residual's scale
SCALED = ("", "r*a+y", "y+r*a")  # the residual as it is, or scaled and added first or second
SECOND = ("", "r2+t", "t+r2")  # no second residual, or one added to the first sum t = r + y, before it or after
ACT_FNS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}
# over a plain (not gated) output: a non-gated MLP's up projection (GPT-NeoX, StarCoder2, Falcon; Nemotron's relu²)
UP_ACT_FNS = {"gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
              "relu2": lambda y: torch.square(F.relu(y))}


# ---- packing ---------------------------------------------------------------------------------------------

def linears3(x, w1, w2, w3):
    return F.linear(x, w1), F.linear(x, w2), F.linear(x, w3)


def linears2(x, w1, w2):
    return F.linear(x, w1), F.linear(x, w2)


def _packed3(x, w1, w2, w3, *, packed):
    return torch.split(F.linear(x, packed), [w1.shape[0], w2.shape[0], w3.shape[0]], -1)


def _packed2(x, w1, w2, *, packed):
    return torch.split(F.linear(x, packed), [w1.shape[0], w2.shape[0]], -1)


def pack_rows(weights: list[torch.Tensor]) -> torch.Tensor:
    from tkcc.kernels.lowered import pack_rows as rows

    return rows(weights)


def _check_pack(m, weights=None) -> str | None:
    idx = list(weights if weights is not None else range(1, len(m.inputs)))
    if any(m.inputs[i].meta.get("tkcc_packed_from") for i in idx):
        return "a sibling is packed already (a gated MLP's gate|up: its gated GEMV takes it whole)"
    ws = [m.tensor(i) for i in idx]
    if any(w is None for w in ws):
        return "a sibling's weight is not a parameter of the model (computed in the graph)"
    w0 = ws[0]
    if any(w.dim() != 2 or w.shape[1] != w0.shape[1] or w.dtype != w0.dtype or w.device != w0.device for w in ws):
        return f"sibling weights {[tuple(w.shape) for w in ws]} {[str(w.dtype) for w in ws]} do not stack"
    return None


def _pack_params(m, ctx, weights=None):
    nodes = list(weights if weights is not None else m.inputs[1:])
    packed = pack_rows([m.tensor(m.inputs.index(n)) for n in nodes])
    node = ctx.tensor("packed", packed, packed_from=nodes, share_key=("pack", tuple(nodes)))
    return {"packed": node}


def _xw(dt, n):
    return (torch.empty(1, 1, K_EX, dtype=dt),) + tuple(torch.empty(N_EX + 8 * i, K_EX, dtype=dt) for i in range(n))


def linears3_bias(x, w1, w2, w3, b1, b2, b3):
    return F.linear(x, w1, b1), F.linear(x, w2, b2), F.linear(x, w3, b3)


def _packed3_bias(x, w1, w2, w3, b1, b2, b3, *, packed, packed_bias):
    return torch.split(F.linear(x, packed, packed_bias), [w1.shape[0], w2.shape[0], w3.shape[0]], -1)


def _pack_bias_params(m, ctx):
    out = _pack_params(m, ctx, weights=m.inputs[1:4])
    bs = [m.tensor(i) for i in range(4, 7)]
    out["packed_bias"] = ctx.tensor("packed_bias", pack_rows(bs), packed_from=m.inputs[4:7],
                                    share_key=("pack", tuple(m.inputs[4:7])))
    return out


def _check_pack_bias(m) -> str | None:
    why = _check_pack(m, weights=range(1, 4))
    if why:
        return why
    bs = [m.tensor(i) for i in range(4, 7)]
    if any(b is None or b.dim() != 1 for b in bs):
        return "a sibling's bias is not a parameter vector of the model"
    return None


def _gated_pair(act):
    """``act(x W_g^T) * (x W_u^T)`` (a gated MLP's gate and up): packed so that the gated GEMV can match."""
    fn = ACT_FNS[act]

    def pattern(x, wg, wu):
        return fn(F.linear(x, wg)) * F.linear(x, wu)

    def replacement(x, wg, wu, *, packed):
        g, u = torch.split(F.linear(x, packed), [wg.shape[0], wu.shape[0]], -1)
        return fn(g) * u

    def check(m):
        why = _check_pack(m)
        if why is None and m.val(1).shape != m.val(2).shape:
            return f"gate {tuple(m.val(1).shape)} and up {tuple(m.val(2).shape)} differ"
        return why

    return Rewrite(f"pack_gated_mlp[{act}]", pattern, replacement,
                   lambda dt: ((torch.empty(1, 1, K_EX, dtype=dt), torch.empty(N_EX, K_EX, dtype=dt),
                                torch.empty(N_EX, K_EX, dtype=dt)), {}),
                   region="projection", check=check, params=_pack_params)


def _chunked_gate(act):
    """A packed gate|up's output halved by ``chunk`` and gated as Phi-3 writes it (``up * act(gate)``) -> the split
    and ``act(g) * u`` that the gated GEMV matches. Exact: the halves are the same views, the product commutes."""
    fn = ACT_FNS[act]

    def pattern(y):
        gate, up = y.chunk(2, dim=-1)
        return up * fn(gate)

    def replacement(y):
        n = y.shape[-1] // 2
        g, u = torch.split(y, [n, n], -1)
        return fn(g) * u

    def check(m):
        return None if m.val(0).shape[-1] % 2 == 0 else f"an odd gate|up width {m.val(0).shape[-1]}"

    return Rewrite(f"canonical_gate[chunked, {act}]", pattern, replacement,
                   lambda dt: ((torch.empty(1, 1, 2 * N_EX, dtype=dt),), {}), region="projection", exact=True,
                   check=check)


def _per_head_qkv(bias: bool):
    """A fused q|k|v projection whose rows are per-head [q_h | k_h | v_h] blocks (GPT-NeoX: ``view(B, T, -1, 3 D)
    .transpose(1, 2).chunk(3, -1)``) -> one GEMV that stores its output as [q | k | v] over all heads
    (``split_heads``), then the split and heads every other family's attention has, which the fused attention
    matches. Not declared exact: the products are the GEMV kernel's (its sum order), as every GEMV rewrite's; the
    store hook itself only moves them."""

    def pattern(x, w, *b, width):
        qkv = F.linear(x, w, *b)
        qkv = qkv.view(x.shape[0], x.shape[1], -1, width).transpose(1, 2)
        return qkv.chunk(3, dim=-1)

    def replacement(x, w, *b, width, config, pdl):
        d = width // 3
        y = torch.ops.tkcc.gemv(x, w, b[0] if b else None, None, 1e-6, None, "", config, pdl, "", d)
        h = w.shape[0] // width
        q, k, v = torch.split(y, [h * d, h * d, h * d], -1)
        return tuple(t.view(x.shape[0], x.shape[1], -1, d).transpose(1, 2) for t in (q, k, v))

    def example(dt):
        ts = (torch.empty(1, 1, K_EX, dtype=dt), torch.empty(4 * 51, K_EX, dtype=dt))  # 4 heads of 3 x 17
        return ts + ((torch.empty(4 * 51, dtype=dt),) if bias else ()), {"width": 51}

    def check(m):
        x, w, width = m.val(0), m.val(1), m.scalars["width"]
        if x.numel() != x.shape[-1]:
            return f"x {tuple(x.shape)} is more than one token (a GEMV is batch-1 decode)"
        if w.dim() != 2 or w.stride(-1) != 1 or width % 3 or w.shape[0] % width:
            return f"weight {tuple(w.shape)} strides {tuple(w.stride())} are not heads of [q | k | v] rows of {width}"
        return None

    def params(m, ctx):
        w = m.val(1)
        key = gemv_key(w.shape[0], w.shape[1], False, "", False, bias, w.dtype, split_heads=True)
        return {"config": ctx.options.get("gemv_configs", {}).get(key), "pdl": bool(ctx.options.get("pdl"))}

    return Rewrite(f"qkv_per_head{'[bias]' if bias else ''}", pattern, replacement, example, region="projection",
                   check=check, params=params)


def _matmul_linear(bias: bool):
    """``x @ w.T [+ b]`` (Falcon's ``FalconLinear``) -> ``F.linear(x, w[, b])``, which the packing and GEMV rewrites
    match. Without a bias it is what ``aten::linear`` itself computes (``matmul(x, w.t())``): exact. With one,
    ``linear`` of a contiguous 3-D input adds the bias inside its GEMM (``addmm``), one rounding fewer: not
    exact."""

    def pattern(x, w, *b):
        y = x @ w.T
        return y + b[0] if b else y

    def replacement(x, w, *b):
        return F.linear(x, w, *b)

    def example(dt):
        ts = (torch.empty(1, 1, K_EX, dtype=dt), torch.empty(N_EX, K_EX, dtype=dt))
        return ts + ((torch.empty(N_EX, dtype=dt),) if bias else ()), {}

    def check(m):
        w = m.val(1)
        if w.dim() != 2 or (bias and tuple(m.val(2).shape) != (w.shape[0],)):
            return f"weight {tuple(w.shape)} (and bias) are not one linear layer's"
        return None

    return Rewrite(f"canonical_linear[x @ w.T{' + b' if bias else ''}]", pattern, replacement, example,
                   region="projection", exact=not bias, check=check)


MATMUL_LINEAR = [_matmul_linear(b) for b in (True, False)]
PER_HEAD_QKV = [_per_head_qkv(b) for b in (True, False)]
PACK = MATMUL_LINEAR + PER_HEAD_QKV + [_chunked_gate(a) for a in ("silu", "gelu_tanh", "gelu")] + [
    _gated_pair(a) for a in ("silu", "gelu_tanh", "gelu")] + [
    Rewrite("pack_linears3[bias]", linears3_bias, _packed3_bias,
            lambda dt: (_xw(dt, 3) + tuple(torch.empty(N_EX + 8 * i, dtype=dt) for i in range(3)), {}),
            region="projection", check=_check_pack_bias, params=_pack_bias_params),
    Rewrite("pack_linears3", linears3, _packed3, lambda dt: (_xw(dt, 3), {}), region="projection",
            check=_check_pack, params=_pack_params),
    Rewrite("pack_linears2", linears2, _packed2, lambda dt: (_xw(dt, 2), {}), region="projection",
            check=_check_pack, params=_pack_params),
]


# ---- GEMV ------------------------------------------------------------------------------------------------

def _gemv_pattern(norm: bool, bias: bool, gated, residual: bool, up_act: str = "", scaled: str = "",
                  second: str = ""):
    """The pattern for one combination: tensors (x, weight, [bias], [norm weight], [residual], [residual2]).
    ``gated``: False, or the gated activation (``ACT_FNS``; True is "silu") over the two halves of the output;
    ``up_act``: an activation over the whole output (``UP_ACT_FNS``); ``scaled`` (``SCALED``): the residual times a
    scalar ``alpha`` (MiniMax's ``h * alpha + y``), the op's ``residual_scale``; ``second`` (``SECOND``): a second
    residual added to ``r + y`` (the op's ``residual2``; only over a plain residual)."""
    act = ("silu" if gated is True else gated) if gated else ""
    # the op's last arguments, written only where they are used
    tail = (up_act,) if up_act else (("", 0) if scaled or second else ())

    def pattern(*ts, **kw):
        it = iter(ts)
        x, w = next(it), next(it)
        b = next(it) if bias else None
        nw = next(it) if norm else None
        r = next(it) if residual else None
        r2 = next(it) if second else None
        h = rms_norm(x, nw, eps=kw["eps"]) if norm else x
        y = F.linear(h, w, b)
        if up_act:
            y = UP_ACT_FNS[up_act](y)
        if gated:
            n = w.shape[0] // 2
            g, u = torch.split(y, [n, n], -1)
            y = ACT_FNS[act](g) * u
        if residual:
            y = r * kw["alpha"] + y if scaled == "r*a+y" else y + r * kw["alpha"] if scaled else r + y
        if second:
            y = r2 + y if second == "r2+t" else y + r2
        return y

    def replacement(*ts, **kw):
        it = iter(ts)
        x, w = next(it), next(it)
        b = next(it) if bias else None
        nw = next(it) if norm else None
        r = next(it) if residual else None
        scale = (float(kw["alpha"]),) if scaled else (1.0, next(it)) if second else ()
        return torch.ops.tkcc.gemv(x, w, b, nw, kw.get("eps", 1e-6), r, act, kw["config"], kw["pdl"], *tail, *scale)

    def example(dt):
        n = 2 * N_EX if gated else N_EX
        ts = [torch.empty(1, 1, K_EX, dtype=dt), torch.empty(n, K_EX, dtype=dt)]
        if bias:
            ts.append(torch.empty(n, dtype=dt))
        if norm:
            ts.append(torch.empty(K_EX, dtype=dt))
        if residual:
            ts.append(torch.empty(1, 1, N_EX, dtype=dt))
        if second:
            ts.append(torch.empty(1, 1, N_EX, dtype=dt))
        return tuple(ts), {**({"eps": EPS} if norm else {}), **({"alpha": ALPHA} if scaled else {})}

    def check(m):
        x, w = m.val(0), m.val(1)
        if w.dim() != 2:
            return f"weight of {w.dim()} dims"
        if w.stride(-1) != 1:
            return (f"weight {tuple(w.shape)} is stored with strides {tuple(w.stride())}, not as rows (the GEMV "
                    "streams each output's row)")
        if x.numel() != x.shape[-1]:
            return f"x {tuple(x.shape)} is more than one token (a GEMV is batch-1 decode)"
        i = 2
        if bias:
            if m.val(i).dim() != 1:
                return "bias is not a vector"
            i += 1
        if norm:
            if tuple(m.val(i).shape) != (x.shape[-1],):
                return f"norm weight {tuple(m.val(i).shape)} for width {x.shape[-1]}"
            i += 1
        out = m.outputs[0].meta["val"]
        for k in range(i, i + residual + bool(second)):
            r = m.val(k)
            if tuple(r.shape) != tuple(out.shape) or r.dtype != out.dtype:
                return f"residual {tuple(r.shape)} {r.dtype} broadcasts into {tuple(out.shape)} {out.dtype}"
        return None

    def params(m, ctx):
        w = m.val(1)
        key = gemv_key(w.shape[0], w.shape[1], norm, act, residual, bias, w.dtype, up_act,
                       scaled_residual=bool(scaled), residual2=bool(second))
        return {"config": ctx.options.get("gemv_configs", {}).get(key), "pdl": bool(ctx.options.get("pdl"))}

    pattern.__qualname__ = f"gemv[{_tag(norm, bias, act, residual, up_act, scaled, second)}]"
    return pattern, replacement, example, check, params


def gemv_key(N: int, K: int, norm: bool, act, residual: bool, bias: bool, dtype, up_act: str = "",
             split_heads: bool = False, scaled_residual: bool = False, residual2: bool = False) -> str:
    """How a GEMV's tuned config is named (shape and hooks determine its best config); ``act``: the gated
    activation or ''; ``up_act``: the activation over the plain output or ''; ``split_heads``: its rows stored
    as [q | k | v] (``_per_head_qkv``); ``scaled_residual``: its residual has a scale (a kernel variant of its own);
    ``residual2``: a second residual after the first (another variant; the keys without it are unchanged)."""
    act = ("silu" if act is True else act) or ""
    res = "scaled-residual" if scaled_residual else "residual+residual2" if residual2 else "residual"
    return f"{N}x{K}" + "".join(f"+{k}" for k, v in (("norm", norm), (act and f"gated-{act}", act),
                                                        (up_act, up_act), (res, residual), ("bias", bias),
                                                        ("heads", split_heads))
                                if v) + f":{str(dtype).split('.')[-1]}"


def _tag(norm, bias, act, residual, up_act="", scaled="", second=""):
    act = ("silu" if act is True else act) or ""
    gated = "gated" if act == "silu" else f"gated-{act}"
    res = f"residual[{scaled}]" if scaled else f"residual[{second}]" if second else "residual"
    return "+".join(k for k, v in (("norm", norm), ("bias", bias), (gated, act), (up_act, up_act),
                                   (res, residual)) if v) or "plain"


def _gemvs():
    out = []
    # most fused first: a region matched by a larger pattern is not offered to a smaller one (a scaled residual's
    # product, a second residual's add, count as one part more, so that the plain residual pattern never takes the
    # first add alone)
    combos = sorted(itertools.product((True, False), ("silu", "gelu_tanh", "gelu", ""), (True, False),
                                      (True, False), SCALED, SECOND),
                    key=lambda c: -(c[0] + bool(c[1]) + c[2] + c[3] + bool(c[4]) + bool(c[5])))
    for norm, act, bias, residual, scaled, second in combos:
        if act and residual:
            continue  # a gated output feeds the down projection, never a residual add
        if (scaled or second) and not residual or (scaled and second):
            continue
        if not residual and not act:  # an up projection's activation first: the larger region
            for up_act in UP_ACT_FNS:
                pattern, replacement, example, check, params = _gemv_pattern(norm, bias, False, False, up_act)
                out.append(Rewrite(f"gemv[{_tag(norm, bias, '', False, up_act)}]", pattern, replacement, example,
                                   region="projection", check=check, params=params))
        pattern, replacement, example, check, params = _gemv_pattern(norm, bias, act, residual, "", scaled, second)
        out.append(Rewrite(f"gemv[{_tag(norm, bias, act, residual, '', scaled, second)}]", pattern, replacement,
                           example, region="projection", check=check, params=params))
    return out


def embed_gemv(table, ids, nw, w, *, eps):
    """The step's start: the token's embedding, normed, into the first projection (the embedding is also the
    residual stream, so it is an output of the region too)."""
    e = F.embedding(ids, table)
    return F.linear(rms_norm(e, nw, eps=eps), w), e


def embed_gemv_bias(table, ids, nw, w, b, *, eps):
    e = F.embedding(ids, table)
    return F.linear(rms_norm(e, nw, eps=eps), w, b), e


def _to_gemv_gather(table, ids, nw, w, *b, eps, config, pdl):
    return torch.ops.tkcc.gemv_gather(table, ids, w, nw, eps, config, pdl, b[0] if b else None)


def _check_gather(m) -> str | None:
    table, ids, nw, w = (m.val(i) for i in range(4))
    if ids.numel() != 1:
        return f"ids {tuple(ids.shape)} are more than one token"
    if table.dim() != 2 or table.stride(-1) != 1 or w.dim() != 2 or w.stride(-1) != 1:
        return f"table {tuple(table.shape)} / weight {tuple(w.shape)} are not row-major"
    return None


def _gather_params(m, ctx):
    w = m.val(3)
    key = gemv_key(w.shape[0], w.shape[1], True, False, False, len(m.inputs) > 4, w.dtype) + "+gather"
    return {"config": ctx.options.get("gemv_configs", {}).get(key), "pdl": bool(ctx.options.get("pdl"))}


def _gather_example(bias):
    def example(dt):
        ts = (torch.empty(64, K_EX, dtype=dt), torch.empty(1, 1, dtype=torch.int64), torch.empty(K_EX, dtype=dt),
              torch.empty(N_EX, K_EX, dtype=dt)) + ((torch.empty(N_EX, dtype=dt),) if bias else ())
        return ts, {"eps": EPS}
    return example


GATHER = [Rewrite("gemv[gather+norm+bias]", embed_gemv_bias, _to_gemv_gather, _gather_example(True),
                  region="projection", check=_check_gather, params=_gather_params),
          Rewrite("gemv[gather+norm]", embed_gemv, _to_gemv_gather, _gather_example(False),
                  region="projection", check=_check_gather, params=_gather_params)]
GEMV = GATHER + _gemvs()
