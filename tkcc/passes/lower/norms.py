"""Normalisations: RMSNorm (Llama's ``w * norm(x)``, Gemma's ``norm(x) * (1 + w)``, gpt-oss's ``(w * norm(x))`` rounded
once, Qwen3-Next's gated ``w * norm(x) * silu(z)``, MiniMax's ``sigmoid(g) * (w * norm(x))``) and LayerNorm
(``F.layer_norm``, or Cohere's written out in fp32).

Each pattern is the module's forward as Hugging Face writes it; each replacement one ``tkcc.rms_norm`` /
``tkcc.layer_norm``. Most norms do not survive as ops: the projection rewrites (``projections.py``) match a
norm feeding a GEMV and fold it into the GEMV's prologue, and the attention rewrite folds q/k norms into the
fused attention. These rewrites lower the norms nothing else absorbed (the final norm of a model whose
head is not a GEMV, a norm whose output has several kinds of users).

Last, a norm whose every reader is a GEMV or routed MoE without a norm prologue (DeepSeek's and Qwen2-MoE's
post-attention norm, read by the routed experts and the shared ones) goes into each reader's prologue
(``INTO_READERS``): one launch fewer per layer, each reader normalising its own copy of the row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tkcc.passes.lower.pattern import Rewrite, _all_args, _val, set_arg

EPS = 1.2345e-07     # sentinels: no other literal of these patterns has these values
OFFSET = 1.375


def rms_norm(x, weight, *, eps):
    """``LlamaRMSNorm.forward`` (also OLMoE's, Mixtral's, Qwen's): fp32 statistic, rounded, times the weight."""
    dt = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dt)


def rms_norm_offset(x, weight, *, eps, offset):
    """``GemmaRMSNorm.forward``: ``norm(x.float()) * (1 + w.float())``, rounded once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * (offset + weight.float())
    return h.type_as(x)


def rms_norm_weight_fp32(x, weight, *, eps):
    """``GptOssRMSNorm.forward`` (T5's): the weight times the fp32 normalised x, rounded once. In fp32 the same
    program as ``rms_norm``; in bf16 the product is fp32."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (weight * h).to(input_dtype)


def rms_norm_gated(x, weight, z, *, eps):
    """Qwen3-Next's ``RMSNormGated`` (after its gated delta rule): Llama's RMSNorm of each head's output, times
    ``silu(z)`` in fp32, rounded once; z given as x's rows."""
    h = rms_norm(x, weight, eps=eps)
    return (h * F.silu(z.to(torch.float32))).to(x.dtype)


def rms_norm_sigmoid_gated(x, weight, g, *, eps):
    """MiniMax's lightning attention output: Llama's RMSNorm of it, times ``sigmoid(g)`` (its output gate's projection);
    each op rounded to the dtype."""
    return torch.sigmoid(g) * rms_norm(x, weight, eps=eps)


def rms_norm_gated_grouped(x, weight, z, *, eps):
    """The same with z as Qwen3-Next's code makes it: its projection's per-key-head slice [B, T, Hk, r * Dv] reshaped
    to value heads, then to rows. The slice is strided, so that reshape is a copy; the op reads the slice in place."""
    D = x.shape[-1]
    return rms_norm_gated(x, weight, z.reshape(z.shape[0], z.shape[1], -1, D).reshape(-1, D), eps=eps)


def layer_norm(x, weight, bias, *, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm_nobias(x, weight, *, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, None, eps)


def layer_norm_two_pass(x, weight, *, eps):
    """``CohereLayerNorm.forward`` (Cohere 2's): the mean, then the mean of the squared deviations, in fp32; the fp32
    weight times the normalised x, rounded once; no bias. Not ``F.layer_norm``'s arithmetic (its statistic is its
    own), so its replacement is the op's ``two_pass`` form: this arithmetic off a kernel, not exact on one."""
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32)
    mean = hidden_states.mean(-1, keepdim=True)
    variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
    hidden_states = (hidden_states - mean) * torch.rsqrt(variance + eps)
    hidden_states = weight.to(torch.float32) * hidden_states
    return hidden_states.to(input_dtype)


def _to_rms_norm(x, weight, *, eps):
    return torch.ops.tkcc.rms_norm(x, weight, eps)


def _to_rms_norm_offset(x, weight, *, eps, offset):
    return torch.ops.tkcc.rms_norm(x, weight, eps, offset, False)


def _to_rms_norm_weight_fp32(x, weight, *, eps):
    # -0.0 + w is w bit for bit (0.0 + w would turn a -0.0 weight into +0.0)
    return torch.ops.tkcc.rms_norm(x, weight, eps, -0.0, False)


def _to_rms_norm_gated(x, weight, z, *, eps):
    return torch.ops.tkcc.rms_norm(x, weight, eps, 0.0, True, z)


def _to_rms_norm_sigmoid_gated(x, weight, g, *, eps):
    return torch.ops.tkcc.rms_norm(x, weight, eps, 0.0, True, g, "sigmoid")


def _to_layer_norm(x, weight, bias, *, eps):
    return torch.ops.tkcc.layer_norm(x, weight, bias, eps)


def _to_layer_norm_nobias(x, weight, *, eps):
    return torch.ops.tkcc.layer_norm(x, weight, None, eps)


def _to_layer_norm_two_pass(x, weight, *, eps):
    return torch.ops.tkcc.layer_norm(x, weight, None, eps, True)


def _x_w(dtype, H=48):
    return (torch.empty(1, 1, H, dtype=dtype), torch.empty(H, dtype=dtype))


def _same_width(m) -> str | None:
    x, w = m.val(0), m.val(1)
    if w.dim() != 1 or w.shape[0] != x.shape[-1]:
        return f"norm weight {tuple(w.shape)} for rows of {x.shape[-1]}"
    return None


def _rows(m) -> str | None:
    """The RMSNorm row kernel reads contiguous rows: a strided view (Qwen3-Next's per-head q/k norms on a chunk of
    the projection) stays in aten with its reason, rather than reaching the op and falling back there."""
    why = _same_width(m)
    if why is None and not m.val(0).is_contiguous():
        why = f"x {tuple(m.val(0).shape)} is a strided view (the row kernel reads contiguous rows)"
    return why


def _gated_example(grouped: bool):
    """x: 8 rows of 16; z as rows, or as 2 key heads' slices of 4 value heads each out of a wider projection."""
    def example(dt):
        z = torch.empty(1, 1, 2, 96, dtype=dt)[..., 32:] if grouped else torch.empty(8, 16, dtype=dt)
        return (torch.empty(8, 16, dtype=dt), torch.empty(16, dtype=dt), z), {"eps": EPS}
    return example


def _gated_rows(m) -> str | None:
    """``_rows``, and the gate holds x's rows in order (the op reads it in place, or copies it where the kernel
    cannot: ``tkcc.kernels.rmsnorm.gate_rows``)."""
    why = _rows(m)
    if why is None and m.val(2).numel() != m.val(0).numel():
        why = f"gate {tuple(m.val(2).shape)} for x {tuple(m.val(0).shape)}"
    return why


def _sigmoid_gated_rows(m) -> str | None:
    """``_gated_rows``, and the product is x's shape and dtype (no broadcast, no promotion)."""
    why = _gated_rows(m)
    out, x, g = m.outputs[0].meta["val"], m.val(0), m.val(2)
    if why is None and (tuple(out.shape) != tuple(x.shape) or not out.dtype == x.dtype == g.dtype):
        why = f"gate {tuple(g.shape)} {g.dtype} times the norm of x {tuple(x.shape)} {x.dtype} is {tuple(out.shape)}"
    return why


REWRITES = [
    Rewrite("rms_norm_gated[sigmoid]", rms_norm_sigmoid_gated, _to_rms_norm_sigmoid_gated, _gated_example(False),
            region="norm", check=_sigmoid_gated_rows),
    Rewrite("rms_norm_gated[grouped z]", rms_norm_gated_grouped, _to_rms_norm_gated, _gated_example(True),
            region="norm", check=_gated_rows),
    Rewrite("rms_norm_gated", rms_norm_gated, _to_rms_norm_gated, _gated_example(False), region="norm",
            check=_gated_rows),
    Rewrite("rms_norm", rms_norm, _to_rms_norm, lambda dt: (_x_w(dt), {"eps": EPS}), region="norm", check=_rows),
    Rewrite("rms_norm_offset", rms_norm_offset, _to_rms_norm_offset,
            lambda dt: (_x_w(dt), {"eps": EPS, "offset": OFFSET}), region="norm", check=_rows),
    Rewrite("rms_norm_weight_fp32", rms_norm_weight_fp32, _to_rms_norm_weight_fp32, lambda dt: (_x_w(dt), {"eps": EPS}),
            region="norm", check=_rows),
    Rewrite("layer_norm", layer_norm, _to_layer_norm,
            lambda dt: ((*_x_w(dt), torch.empty(48, dtype=dt)), {"eps": EPS}), region="norm", exact=True),
    Rewrite("layer_norm_nobias", layer_norm_nobias, _to_layer_norm_nobias, lambda dt: (_x_w(dt), {"eps": EPS}),
            region="norm", exact=True),
    Rewrite("layer_norm_two_pass", layer_norm_two_pass, _to_layer_norm_two_pass, lambda dt: (_x_w(dt), {"eps": EPS}),
            region="norm", check=_same_width),
]


# ---- a norm read by several projections: into each one's prologue --------------------------------------------

# views that keep the rows whole: the norm of a view is the view of the norm
_ROW_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}


def tkcc_rms_norm(x, weight, *, eps):
    """A ``tkcc.rms_norm`` in Llama's form (``offset`` 0, rounded before the weight, no gate: the literals are
    compared, so Gemma's ``1 + w`` and the fp32-weight forms do not match), which the GEMV and MoE norm prologues
    compute (``rms_norm_ref`` is the reference of all three)."""
    return torch.ops.tkcc.rms_norm(x, weight, eps)


def _its_input(x, weight, *, eps):
    return x


def _prologue_readers(node, H: int):
    """(reader, norm weight's index, its name, eps's index, its name) for each op that reads ``node`` (through
    views that keep rows of H) as its input and can take the norm as its prologue, or why one cannot."""
    out = []
    for u in node.users:
        args = _all_args(u) if u.op == "call_function" else []
        if u.op == "call_function" and u.target in _ROW_VIEWS and args[0] is node and _val(u).shape[-1] == H:
            got = _prologue_readers(u, H)
            if isinstance(got, str):
                return got
            out += got
            continue
        if u.target is torch.ops.tkcc.gemv.default:
            where = (3, "norm_weight", 4, "eps")
        elif u.target is torch.ops.tkcc.moe.default:
            where = (1, "norm_weight", 2, "eps")
            if args[8]:
                return f"{u.name} adds its (normed) input as the residual"
        else:
            return f"{u.name} ({u.target}) reads it"
        if args[0] is not node or any(a is node for a in args[1:]):
            return f"{u.name} reads it other than as its input (a residual, a weight)"
        if args[where[0]] is not None:
            return f"{u.name} has a norm prologue already"
        out.append((u, *where))
    return out or "nothing reads it"


def _readers_check(m) -> str | None:
    x, w, out = m.val(0), m.val(1), m.outputs[0].meta["val"]
    H = x.shape[-1]
    if w.dim() != 1 or w.shape[0] != H or not (x.dtype == w.dtype == out.dtype) or not x.is_contiguous():
        return f"x {tuple(x.shape)} {x.dtype} (contiguous: {x.is_contiguous()}), weight {tuple(w.shape)} {w.dtype}"
    if x.numel() != H:
        return f"x {tuple(x.shape)} is more than one token (the prologues are batch-1)"
    got = _prologue_readers(m.outputs[0], H)
    return got if isinstance(got, str) else None


def _into_readers(m) -> None:
    """Each reader takes the norm's weight and eps; the replacement (the norm's input) is then what they read."""
    eps = float(m.scalars["eps"])
    for u, wi, wname, ei, ename in _prologue_readers(m.outputs[0], m.val(0).shape[-1]):
        set_arg(u, wi, wname, m.inputs[1])
        set_arg(u, ei, ename, eps)


# Not exact: each prologue reduces the row in its own order (the references agree bit for bit: rms_norm_ref)
INTO_READERS = [Rewrite("rms_norm[into every reader's prologue]", tkcc_rms_norm, _its_input,
                        lambda dt: (_x_w(dt), {"eps": EPS}), region="norm", check=_readers_check,
                        into_readers=_into_readers)]
