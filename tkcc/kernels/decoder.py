"""A whole batch-1 decode step built from the fused kernels, capturable as one CUDA graph.

Built from a transformers Llama-like or OLMoE-like model, sharing its weights:
projections that read the same input are read as one weight tensor
(q|k|v, gate|up): a view when capture packed them side by side
(``tkcc.frontend.weight_packing``), else one copy owned by the decoder; the
model's parameters are never re-pointed (graphs captured earlier read them).
Per layer (OLMoE): QKV GEMV with the RMSNorm prologue; q/k norm +
rotary + cache write; split-KV attention (+ combine); o-proj GEMV + residual;
router GEMV with the norm prologue; experts gate_up (routing in the
prologue); experts down + residual. Llama: the MLP is two GEMVs (gated, then
down + residual).

Options (each keeps the path above as its reference and is swept side by side
by ``benchmarks/decode.py``): ``fused_attention`` does norm + rotary + cache
write + split-KV + combine in one launch (``attention_rope.py``);
``routed_moe`` computes routing once per layer in the router kernel and streams
expert weights with no per-program prologue (``moe_routed.py``); ``fused_ends``
gathers the token's embedding in layer 0's QKV kernel and takes the argmax
(and advances the position) in the lm_head kernel, so the step is Triton
launches only, all chained by PDL. The attention layout (positions per
split-KV program, the kernels' tile) is a pair of step configs, tuned at the
context served: the best one moves with the context, not with the weights.
The step reads the token and the position from device buffers and writes the
next token and position back, so replays chain with no host synchronisation.
"""
from __future__ import annotations


import torch

from tkcc.errors import TkccError
from tkcc.kernels import gemv as gemv_mod
from tkcc.kernels import moe as moe_mod
from tkcc.kernels.attention import attention
from tkcc.kernels.attention_rope import AttentionRope
from tkcc.kernels.gemv import gemv
from tkcc.kernels.graph_replay import CapturedCall, replay_us
from tkcc.kernels.moe import moe
from tkcc.kernels.moe_routed import RoutedMoE
from tkcc.kernels.packing import packed_view
from tkcc.kernels.rotary import rope


# the attention kernels' (positions per loop step, warps) by default, and the candidates tune_step times
ATTN_TILE_DEFAULT = (64, 4)
ATTN_TILES = [(64, 4), (32, 4), (16, 4), (128, 4), (128, 8), (256, 8), (32, 2)]
# positions per split-KV program tune_step times (below the cache length), and one split over the whole
# cache when the cache is at most ATTN_SINGLE_MAX long
ATTN_CHUNKS = [64, 128, 256, 512, 1024, 2048]
ATTN_SINGLE_MAX = 8192
# the attention layout depends on the context, not on the weights: tuned at the context it will serve
ATTENTION_KINDS = ("attn_chunk", "attn_tile")


def _regroup(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The weights as one [rows, cols] matrix: a view when they are packed (``tkcc.kernels.packing``; capture
    packs them), else a copy owned by the decoder. The parameters are never re-pointed: graphs captured
    earlier read their storage, and freeing it under them makes them read garbage."""
    view = packed_view([p.data for p in params])
    return view if view is not None else torch.cat([p.data for p in params], 0)


class FusedDecoder:
    """A batch-1 decode step with the fused kernels. ``step()`` is graph-capturable; ``forward`` takes a decode
    graph's inputs, so the one greedy loop (``tkcc.frontend.generate.greedy_loop``) drives it."""

    def __init__(self, model, max_cache_len: int, attn_chunk: int | None = None, forced_routing: bool = False,
                 pdl: bool | None = None, kv: tuple[list, list] | None = None, fused_attention: bool = False,
                 routed_moe: bool = False, configs: dict | None = None, fused_ends: bool = False,
                 attn_tile: tuple[int, int] | None = None, attn_spans: tuple[int, ...] = ()):
        """``kv``: optional per-layer (keys, values) tensors [H_kv, S, D] to use as the cache in place (e.g. a
        captured Program's static cache, so its prefill graph and this decode step share one cache).
        ``configs``: {kind: kernel config} for this decoder only (``tune`` and ``tune_step`` fill it; a kind not
        in it takes the kernel's default). ``attn_chunk`` (positions per split-KV program) and ``attn_tile`` ((positions per
        loop step, warps) of the attention kernels) are the defaults of the ``attn_chunk`` and ``attn_tile``
        configs, which ``tune_step(kinds=ATTENTION_KINDS)`` picks at the context the decoder is at.
        ``attn_spans``: context spans (positions) below the cache length that get their own attention layout
        (a split-KV grid laid out for the span, configs ``attn_chunk@SPAN`` / ``attn_tile@SPAN``) and their own
        CUDA graph; ``use_span(position)`` picks one per step. Fused attention only (its last split attends
        any positions past the grid, so a span chosen too short is slower, never wrong)."""
        cfg = model.config
        self.model = model
        self.cfg = cfg
        inner = model.model
        dev = next(model.parameters()).device
        dt = next(model.parameters()).dtype
        self.device, self.dtype = dev, dt
        # programmatic dependent launch: each kernel starts while the previous one drains (Hopper and later)
        self.pdl = (dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9) if pdl is None else pdl
        self.H = cfg.hidden_size
        self.Hq = cfg.num_attention_heads
        self.Hkv = cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or self.H // self.Hq
        self.eps = cfg.rms_norm_eps
        self.max_cache_len = max_cache_len
        self.is_moe = hasattr(inner.layers[0].mlp, "experts")
        rot = inner.rotary_emb
        if float(getattr(rot, "attention_scaling", 1.0)) != 1.0:
            raise TkccError("FusedDecoder: rotary attention_scaling != 1 is not supported")
        self.inv_freq = rot.inv_freq.detach().float().to(dev).contiguous()
        self.layers = []
        for layer in inner.layers:
            a = layer.self_attn
            if getattr(a, "q_proj").bias is not None or getattr(cfg, "clip_qkv", None):
                raise TkccError("FusedDecoder: attention biases / clip_qkv are not supported")
            L = dict(ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                     qkv=_regroup([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), o=a.o_proj.weight,
                     q_norm=getattr(getattr(a, "q_norm", None), "weight", None),
                     k_norm=getattr(getattr(a, "k_norm", None), "weight", None))
            if self.is_moe:
                m = layer.mlp
                L.update(router=m.gate.weight, gate_up=m.experts.gate_up_proj, down=m.experts.down_proj,
                         top_k=m.gate.top_k, norm_topk=bool(getattr(m.gate, "norm_topk_prob", False)))
            else:
                m = layer.mlp
                L.update(gate_up=_regroup([m.gate_proj.weight, m.up_proj.weight]), down=m.down_proj.weight)
            self.layers.append(L)
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        nl = len(self.layers)
        if kv is None:
            self.k_cache = torch.zeros(nl, self.Hkv, max_cache_len, self.D, device=dev, dtype=dt)
            self.v_cache = torch.zeros_like(self.k_cache)
            self.k_layers, self.v_layers = list(self.k_cache), list(self.v_cache)
        else:
            self.k_layers, self.v_layers = list(kv[0]), list(kv[1])
            want = (self.Hkv, max_cache_len, self.D)
            for t in self.k_layers + self.v_layers:
                if tuple(t.shape) != want or t.stride(-1) != 1 or t.dtype != dt:
                    raise TkccError(f"FusedDecoder: cache tensor {tuple(t.shape)} {t.dtype} stride {t.stride()} "
                                    f"does not match [H_kv, S, D] = {want} {dt}")
            self.k_cache = self.v_cache = None
        self.attn_chunk = attn_chunk or (256 if self.Hkv >= 16 else 128)
        self.attn_tile = tuple(attn_tile or ATTN_TILE_DEFAULT)
        self._layouts: dict[tuple[int, int], AttentionRope] = {}
        self.spans = sorted({int(v) for v in attn_spans if 0 < int(v) < max_cache_len}) if fused_attention else []
        self.spans.append(max_cache_len)
        self._span = max_cache_len
        self._graphs: dict[int, object] = {}  # span -> its captured step
        # device-side state: the step reads these and writes the next values back
        self.token = torch.zeros(1, device=dev, dtype=torch.long)
        self.pos = torch.zeros(1, device=dev, dtype=torch.int32)
        self.seqlen = torch.ones(1, device=dev, dtype=torch.int32)
        H, D = self.H, self.D
        self.h = torch.empty(H, device=dev, dtype=dt)
        self.qkv = torch.empty((self.Hq + 2 * self.Hkv) * D, device=dev, dtype=dt)
        self.q = torch.empty(self.Hq, D, device=dev, dtype=dt)
        self.attn = torch.empty(self.Hq, D, device=dev, dtype=dt)
        self.logits = torch.empty(model.lm_head.weight.shape[0], device=dev, dtype=dt)
        if self.is_moe:
            E = self.layers[0]["router"].shape[0]
            k = self.layers[0]["top_k"]
            I = self.layers[0]["down"].shape[2]
            self.router_logits = torch.empty(E, device=dev, dtype=dt)
            self.act = torch.empty(k, I, device=dev, dtype=dt)
            self.forced = torch.zeros(nl, k, device=dev, dtype=torch.int32) if forced_routing else None
            self.forced_all = None
            self.forced_step = torch.zeros(1, device=dev, dtype=torch.long)
        else:
            self.act = torch.empty(self.layers[0]["down"].shape[1], device=dev, dtype=dt)
            self.forced = None
        self.fused_attention = fused_attention
        self.fused_ends = fused_ends
        self.argmax_state = gemv_mod.ArgmaxState(dev) if fused_ends else None
        self.routed_moe = routed_moe and self.is_moe
        self.configs = dict(configs or {})
        if self.routed_moe:
            L0 = self.layers[0]
            self.routed = RoutedMoE(L0["router"].shape[0], H, L0["down"].shape[2], L0["top_k"], dev, dt)
        else:
            self.routed = None

    # -- routing replay (benchmark) -------------------------------------------------------------
    def set_forced_routing(self, ids: torch.Tensor) -> None:
        """ids [T, layers, k]: the expert choices of T tokens, replayed cyclically, one token per step."""
        if self.forced is None:
            raise TkccError("FusedDecoder was built without forced_routing=True")
        self.forced_all = ids.to(self.device, torch.int32).contiguous()
        self.forced_step.zero_()

    # -- attention layout ---------------------------------------------------------------------------
    def _layout(self) -> AttentionRope:
        """The split-KV layout of the current span and ``attn_chunk`` config: chunk, splits and their scratch
        (partials, the fused kernel's counters), made once per (span, chunk); the separate attention path uses
        the same (with the one span, the whole cache)."""
        chunk = self._attn_config("attn_chunk")[0]
        lay = self._layouts.get((self._span, chunk))
        if lay is None:
            lay = self._layouts[(self._span, chunk)] = AttentionRope(self.Hq, self.Hkv, self.D, self.max_cache_len,
                                                                     chunk, self.device, span=self._span)
        return lay

    def _cfg_key(self, kind: str) -> str:
        """The configs key of an attention kind at the current span (the whole cache's has no suffix)."""
        return kind if self._span == self.max_cache_len else f"{kind}@{self._span}"

    def _attn_config(self, kind: str) -> tuple:
        got = self.configs.get(self._cfg_key(kind))
        if got is None and self._span == self.max_cache_len:
            got = self.configs.get(kind)
        return got or ((self.attn_chunk,) if kind == "attn_chunk" else self.attn_tile)

    def span_for(self, position: int | None) -> int:
        """The shortest span holding a step at ``position`` (the whole cache when the position is unknown)."""
        if position is None:
            return self.max_cache_len
        return next((s for s in self.spans if position < s), self.max_cache_len)

    def use_span(self, position: int | None) -> None:
        """Run the next steps with the layout (and graph) of the span that holds ``position``."""
        self._span = self.span_for(position)

    @property
    def graph(self):
        """The current span's captured step (None before ``capture()``)."""
        return self._graphs.get(self._span)

    @graph.setter
    def graph(self, g) -> None:
        if g is None:
            self._graphs.pop(self._span, None)
        else:
            self._graphs[self._span] = g

    @property
    def chunk(self) -> int:
        return self._layout().chunk

    @property
    def splits(self) -> int:
        return self._layout().splits

    def _attend(self, li, qkv, out, q_norm, k_norm) -> None:
        """This token's attention in layer ``li`` (cache written at pos): the fused launch, or rotary then
        split-KV (+ combine), at the current ``attn_chunk`` / ``attn_tile`` configs."""
        lay = self._layout()
        bs, nw = self._attn_config("attn_tile")
        if self.fused_attention:
            lay(qkv, self.k_layers[li], self.v_layers[li], self.pos, self.inv_freq, q_norm, k_norm, self.eps,
                out=out, pdl=self.pdl, seqlen=self.seqlen, block_s=bs, num_warps=nw)
        else:
            rope(qkv, self.k_layers[li], self.v_layers[li], self.pos, self.inv_freq, self.Hq, self.Hkv, q_norm,
                 k_norm, self.eps, q_out=self.q, pdl=self.pdl)
            attention(self.q, self.k_layers[li], self.v_layers[li], self.seqlen, splits=lay.splits, chunk=lay.chunk,
                      out=out, partials=(lay.po, lay.plse), pdl=self.pdl, block_s=bs, num_warps=nw)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> None:
        eps, H = self.eps, self.H
        if self.forced is not None and self.forced_all is not None:
            torch.index_select(self.forced_all, 0, self.forced_step, out=self.forced.view(1, *self.forced.shape))
            self.forced_step.add_(1).remainder_(self.forced_all.shape[0])
        if not self.fused_ends:
            torch.index_select(self.embed, 0, self.token, out=self.h.view(1, H))
        c = self.configs.get
        for li, L in enumerate(self.layers):
            gather = (self.token, self.h) if li == 0 and self.fused_ends else None  # x = embed[token], also to h
            gemv(self.embed if gather else self.h, L["qkv"], norm_w=L["ln1"], eps=eps, out=self.qkv, config=c("qkv"),
                 pdl=self.pdl, gather=gather)
            self._attend(li, self.qkv, self.attn, L["q_norm"], L["k_norm"])
            gemv(self.attn.view(-1), L["o"], residual=self.h, out=self.h, config=c("o_proj"), pdl=self.pdl)
            forced = None if self.forced is None else self.forced[li]
            if self.routed is not None:
                self.routed(self.h, L["router"], L["gate_up"], L["down"], L["norm_topk"], residual=self.h,
                            norm_w=L["ln2"], eps=eps, forced_ids=forced, out=self.h, router_config=c("routed_router"),
                            gate_up_config=c("routed_gate_up"), down_config=c("routed_down"), pdl=self.pdl)
            elif self.is_moe:
                gemv(self.h, L["router"], norm_w=L["ln2"], eps=eps, out=self.router_logits, config=c("router"),
                     pdl=self.pdl)
                moe(self.h, self.router_logits, L["gate_up"], L["down"], L["top_k"], L["norm_topk"], residual=self.h,
                    norm_w=L["ln2"], eps=eps, forced_ids=forced, act_buf=self.act, out=self.h,
                    gate_up_config=c("moe_gate_up"), down_config=c("moe_down"), pdl=self.pdl)
            else:
                gemv(self.h, L["gate_up"], norm_w=L["ln2"], eps=eps, gated=True, out=self.act, config=c("mlp_gate_up"),
                     pdl=self.pdl)
                gemv(self.act, L["down"], residual=self.h, out=self.h, config=c("mlp_down"), pdl=self.pdl)
        ends = (self.token, self.argmax_state, self.pos, self.seqlen) if self.fused_ends else None
        gemv(self.h, self.lm_head, norm_w=self.final_norm, eps=eps, out=self.logits, config=c("lm_head"), pdl=self.pdl,
             argmax=ends)
        if ends is None:
            torch.argmax(self.logits, dim=0, keepdim=True, out=self.token)
            self.pos.add_(1)
            self.seqlen.add_(1)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """One decode step as a captured Program's decode graph takes it: (input_ids [1, 1], cache_position [1])
        -> logits [1, 1, vocab]. Inputs are copied on the device (no host sync); the step is replayed from a
        CUDA graph once ``capture()`` has run."""
        self.set_inputs(input_ids, cache_position)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()
        return self.logits.view(1, 1, -1).clone()

    def set_inputs(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> None:
        """The next step's token and position, copied on the device."""
        self.token.copy_(input_ids.reshape(-1)[:1])
        self.pos.copy_(cache_position.reshape(-1)[-1:])
        torch.add(self.pos, 1, out=self.seqlen)

    # -- driving ----------------------------------------------------------------------------------
    def reset(self, token: int, pos: int) -> None:
        if pos >= self.max_cache_len:
            raise TkccError(f"context {pos} is longer than the cache ({self.max_cache_len} positions)")
        self.token.fill_(token)
        self.pos.fill_(pos)
        self.seqlen.fill_(pos + 1)

    def capture(self) -> None:
        """Record one step as a CUDA graph (after a warm-up step on a side stream compiles every kernel).

        Both steps run for real: each writes the current token's K/V into the cache at the current position.
        Set the inputs of the step about to run first (``set_inputs``), so those writes are the ones that step
        makes anyway; captured with stale inputs they would overwrite a cache position that a caller with
        its own positions (a validation, a golden check) still reads."""
        saved = self._save()
        self.graph = None  # a failed capture leaves none
        self.graph = CapturedCall(self.step, warmup=1, pdl=self.pdl, after_warmup=lambda: self._restore(saved),
                                  device=self.device)
        self._restore(saved)

    def _save(self):
        """The step's device state (token, position, sequence length, forced-routing step), for _restore."""
        return self.token.clone(), self.pos.clone(), self.seqlen.clone(), self.forced_step_clone()

    def _step_from(self, saved):
        """A step that first restores ``saved``: timed many times over, it does the same work every time and
        never advances the cache."""
        def whole():
            self._restore(saved)
            self.step()
        return whole

    def forced_step_clone(self):
        return self.forced_step.clone() if self.is_moe else None

    def _restore(self, saved):
        self.token.copy_(saved[0])
        self.pos.copy_(saved[1])
        self.seqlen.copy_(saved[2])
        if saved[3] is not None:
            self.forced_step.copy_(saved[3])

    def run(self, n: int) -> None:
        for _ in range(n):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()

    # -- measuring --------------------------------------------------------------------------------
    def _graph_time(self, fn, reps: int = 7) -> float:
        """Median µs of ``fn`` replayed from a CUDA graph (launch gaps as in the real step, no host overhead)."""
        return replay_us(fn, reps, warmup=1, pdl=self.pdl, device=self.device)

    def profile(self) -> dict:
        """GPU µs per token of each kernel kind over all layers, each replayed alone from a CUDA graph, with
        the bytes it must read and the bandwidth that implies; plus the whole step. Scratch outputs keep the
        residual stream and the cache unchanged."""
        eps, Ls = self.eps, self.layers
        x = torch.randn(self.H, device=self.device, dtype=self.dtype) * 0.1
        h2 = torch.empty_like(self.h)
        qkv = torch.randn_like(self.qkv) * 0.1
        kinds = {}

        def nbytes(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        c = self.configs.get
        kinds["qkv_gemv+norm"] = (lambda: [gemv(x, L["qkv"], norm_w=L["ln1"], eps=eps, out=self.qkv, config=c("qkv"),
                                                pdl=self.pdl) for L in Ls],
                                  sum(nbytes(L["qkv"]) for L in Ls))
        ctx = int(self.seqlen)
        kv_bytes = 2 * len(Ls) * self.Hkv * ctx * self.D * self.k_layers[0].element_size()
        # writes the cache at pos (as every step does); pos is past the context, so nothing read changes
        kinds["attention+rope+cache" + ("(fused)" if self.fused_attention else "")] = (
            lambda: [self._attend(i, qkv, self.attn, L["q_norm"], L["k_norm"]) for i, L in enumerate(Ls)], kv_bytes)
        kinds["o_proj+residual"] = (lambda: [gemv(self.attn.view(-1), L["o"], residual=x, out=h2, config=c("o_proj"),
                                                  pdl=self.pdl) for L in Ls],
                                    sum(nbytes(L["o"]) for L in Ls))
        if self.routed is not None:
            k = Ls[0]["top_k"]
            E = Ls[0]["router"].shape[0]
            kinds["router+topk+moe(routed)"] = (
                lambda: [self.routed(x, L["router"], L["gate_up"], L["down"], L["norm_topk"], residual=x,
                                     norm_w=L["ln2"], eps=eps, out=h2, router_config=c("routed_router"),
                                     gate_up_config=c("routed_gate_up"), down_config=c("routed_down"), pdl=self.pdl)
                         for L in Ls],
                sum(nbytes(L["router"]) + nbytes(L["gate_up"], L["down"]) * k // E for L in Ls))
        elif self.is_moe:
            k = Ls[0]["top_k"]
            E = Ls[0]["router"].shape[0]
            kinds["router_gemv+norm"] = (lambda: [gemv(x, L["router"], norm_w=L["ln2"], eps=eps,
                                                       out=self.router_logits, config=c("router"), pdl=self.pdl)
                                                  for L in Ls],
                                         sum(nbytes(L["router"]) for L in Ls))
            lg = torch.randn(E, device=self.device, dtype=self.dtype)
            kinds["moe_gate_up+down"] = (
                lambda: [moe(x, lg, L["gate_up"], L["down"], L["top_k"], L["norm_topk"], residual=x, norm_w=L["ln2"],
                             eps=eps, act_buf=self.act, out=h2, gate_up_config=c("moe_gate_up"),
                             down_config=c("moe_down"), pdl=self.pdl) for L in Ls],
                sum(nbytes(L["gate_up"], L["down"]) for L in Ls) * k // E)
        else:
            kinds["mlp_gate_up(gated)+norm"] = (lambda: [gemv(x, L["gate_up"], norm_w=L["ln2"], eps=eps, gated=True,
                                                             out=self.act, config=c("mlp_gate_up"), pdl=self.pdl)
                                                        for L in Ls],
                                                sum(nbytes(L["gate_up"]) for L in Ls))
            kinds["mlp_down+residual"] = (lambda: [gemv(self.act, L["down"], residual=x, out=h2, config=c("mlp_down"),
                                                        pdl=self.pdl) for L in Ls],
                                          sum(nbytes(L["down"]) for L in Ls))
        # with fused_ends, the argmax epilogue on a scratch token/position
        ends = ((self.token.clone(), self.argmax_state, self.pos.clone(), self.seqlen.clone()) if self.fused_ends
                else None)

        def lm_head():
            gemv(x, self.lm_head, norm_w=self.final_norm, eps=eps, out=self.logits, config=c("lm_head"), pdl=self.pdl,
                 argmax=ends)
            if ends is None:
                torch.argmax(self.logits, dim=0, keepdim=True)
        kinds["lm_head+norm+argmax" + ("(fused)" if ends else "")] = (lm_head, nbytes(self.lm_head))
        out = {}
        for name, (fn, b) in kinds.items():
            us = self._graph_time(fn)
            out[name] = dict(us=round(us, 1), bytes=int(b), GBps=round(b / us / 1e3, 1) if b else None)
        saved = self._save()
        out["whole_step"] = dict(us=round(self._graph_time(self._step_from(saved)), 1))
        self._restore(saved)
        out["sum_of_kinds_us"] = round(sum(v["us"] for k, v in out.items() if k != "whole_step"), 1)
        return out

    # -- tuning -----------------------------------------------------------------------------------
    def tune_routed(self, reps: int = 5, log=None) -> dict:
        """``tune`` for the routed-MoE kernels (router+top-k, gate_up, down): each kind's config picked by
        timing the three launches over all layers from a CUDA graph, the others at their current configs."""
        from tkcc.kernels import moe_routed as mr

        eps, Ls, out = self.eps, self.layers, {}
        x = torch.randn(self.H, device=self.device, dtype=self.dtype)
        h = torch.empty(self.H, device=self.device, dtype=self.dtype)
        E, I2, Hh = Ls[0]["gate_up"].shape
        for kind, cl, arg in (("routed_router", mr.ROUTER_CONFIGS, "router_config"),
                              ("routed_gate_up", mr.GATE_UP_CONFIGS, "gate_up_config"),
                              ("routed_down", mr.DOWN_CONFIGS, "down_config")):
            best = None
            for c in cl:
                def fn(c=c, arg=arg):
                    for L in Ls:
                        self.routed(x, L["router"], L["gate_up"], L["down"], L["norm_topk"], residual=x,
                                    norm_w=L["ln2"], eps=eps, out=h, pdl=self.pdl, **{arg: c})
                try:
                    t = self._graph_time(fn, reps) / len(Ls)
                except Exception as e:  # a config that does not compile for this shape is skipped
                    if log:
                        log(f"tune {kind} {c}: {type(e).__name__}: {e}")
                    continue
                if best is None or t < best[1]:
                    best = (c, t)
            if best is None:
                continue
            self.configs[kind] = best[0]  # this decoder's own: no process-global table
            out[kind] = best
            if log:
                log(f"tune {kind}: {best[0]} {best[1]:.2f} us/layer (router + gate_up + down)")
        return out

    def attention_kinds(self) -> dict:
        """{kind: candidate configs} of the attention layout at the current span: positions per split-KV
        program (``attn_chunk``, 1-tuples) and the kernels' tile (``attn_tile``: positions per loop step,
        warps)."""
        S = self._span
        chunks = [c for c in ATTN_CHUNKS if c < S] + ([S] if S <= ATTN_SINGLE_MAX else [])
        return {"attn_chunk": [(c,) for c in chunks], "attn_tile": self._tiles_that_fit()}

    def _tiles_that_fit(self) -> list[tuple[int, int]]:
        """``ATTN_TILES`` less those this device cannot run at these heads (found by compiling once per
        machine: ``attention_rope.shared_memory``), so that tuning never tries them."""
        from tkcc.kernels.attention_rope import device_limits, shared_memory_many

        limits = device_limits(self.device) if self.fused_attention else None
        if limits is None:
            return list(ATTN_TILES)
        qk = self.layers[0]["q_norm"] is not None
        G = self.Hq // self.Hkv
        needs = shared_memory_many([(limits[0], G, self.D, qk, bs, nw, True) for bs, nw in ATTN_TILES])
        return [t for t, need in zip(ATTN_TILES, needs) if need <= limits[1]]

    def step_kinds(self) -> dict:
        """{kind: candidate configs} of the kernels this decoder's step launches with a tunable config."""
        from tkcc.kernels import moe_routed as mr

        kinds = {"qkv": gemv_mod.CONFIGS, "o_proj": gemv_mod.CONFIGS}
        if self.routed is not None:
            kinds.update(routed_router=mr.ROUTER_CONFIGS, routed_gate_up=mr.GATE_UP_CONFIGS,
                         routed_down=mr.DOWN_CONFIGS)
        elif self.is_moe:
            kinds.update(router=gemv_mod.CONFIGS, moe_gate_up=moe_mod.GATE_UP_CONFIGS, moe_down=moe_mod.DOWN_CONFIGS)
        else:
            kinds.update(mlp_gate_up=gemv_mod.CONFIGS, mlp_down=gemv_mod.CONFIGS)
        kinds["lm_head"] = gemv_mod.CONFIGS
        return kinds

    def tune_step(self, reps: int = 9, rounds: int = 1, log=None, kinds=None) -> dict:
        """Pick each kernel's config by timing the WHOLE step replayed from a CUDA graph (PDL overlap with
        its neighbours, L2 state and launch gaps as in decode), one kind at a time (coordinate descent from
        the current configs). Results go to this decoder's ``configs`` only; returns {kind: (config, µs per
        step)}. The state (token, position) is restored inside each replay, so the cache is not advanced.
        ``kinds``: which to tune (default: every ``step_kinds``; ``ATTENTION_KINDS`` are tuned only when
        named, at the context the decoder is at, since their best value moves with it). A graph captured
        before is dropped (it ran the old configs, on scratch tuning may free): ``capture()`` again."""
        every = {**self.step_kinds(), **self.attention_kinds()}
        unknown = set(kinds or ()) - set(every)
        if unknown:
            raise TkccError(f"tune_step: unknown kinds {sorted(unknown)}; known: {sorted(every)}")
        todo = {k: every[k] for k in kinds} if kinds is not None else self.step_kinds()
        self.graph = None
        saved = self._save()
        whole = self._step_from(saved)
        out = {}
        for _ in range(rounds):
            for kind, cands in todo.items():
                key = self._cfg_key(kind) if kind in ATTENTION_KINDS else kind
                cur = self._attn_config(kind) if kind in ATTENTION_KINDS else self.configs.get(kind)
                best = None
                for cand in ([cur] if cur is not None else []) + [c for c in cands if c != cur]:
                    self.configs[key] = cand
                    try:
                        t = self._graph_time(whole, reps)
                    except Exception as e:  # a config that does not compile/launch here is skipped
                        if log:
                            log(f"tune_step {kind} {cand}: {type(e).__name__}: {e}")
                        continue
                    if best is None or t < best[1]:
                        best = (cand, t)
                if best is None:
                    self.configs.pop(key, None) if cur is None else self.configs.__setitem__(key, cur)
                    continue
                self.configs[key] = best[0]
                out[key] = (best[0], round(best[1], 1))
                if log:
                    log(f"tune_step {kind}: {best[0]} -> step {best[1]:.1f} us")
        self._restore(saved)
        self._layout()
        keep = set()
        span = self._span
        for s in self.spans:  # each span's chosen layout; the other chunks' scratch is not used again
            self._span = s
            keep.add((s, self._attn_config("attn_chunk")[0]))
        self._span = span
        self._layouts = {k: v for k, v in self._layouts.items() if k in keep}
        return out

    def tune(self, reps: int = 5, log=None) -> dict:
        """Pick each GEMV/MoE kernel's block shape by timing it over all layers' weights (so the L2 does
        not serve them), replayed from a CUDA graph as in the real step. Results go to this
        decoder's ``configs`` (never a process-global table: they travel with the artifact); returns
        {kind: (config, µs per layer, or per call for lm_head)}. Only the kernels the step launches are
        timed (each config is a compile): not the unrouted MoE kernels when the routed ones serve, nor the
        plain lm_head when ``fused_ends`` gives the step its argmax variant (``tune_step`` times that one)."""
        eps = self.eps
        x = torch.randn(self.H, device=self.device, dtype=self.dtype)
        out = {}

        def bench(fn, per=len(self.layers)):
            return self._graph_time(fn, reps) / per

        def pick(kind, configs, make, per=len(self.layers)):
            best = None
            for c in configs:
                try:
                    t = bench(make(c), per)
                except Exception as e:  # a config that does not compile for this shape is skipped
                    if log:
                        log(f"tune {kind} {c}: {type(e).__name__}: {e}")
                    continue
                if best is None or t < best[1]:
                    best = (c, t)
            if best is None:  # nothing compiled: keep the default, say so
                if log:
                    log(f"tune {kind}: no config ran; keeping the default")
                return
            self.configs[kind] = best[0]  # this decoder's own configs: they travel with its artifact
            out[kind] = best
            if log:
                log(f"tune {kind}: {best[0]} {best[1]:.2f} us/{'layer' if per > 1 else 'call'}")

        Ls = self.layers
        qkv_out = torch.empty_like(self.qkv)
        N, K = Ls[0]["qkv"].shape
        pick("qkv", gemv_mod.CONFIGS,
             lambda c: lambda: [gemv(x, L["qkv"], norm_w=L["ln1"], eps=eps, out=qkv_out, config=c, pdl=self.pdl) for L in Ls])
        a = torch.randn(self.Hq * self.D, device=self.device, dtype=self.dtype)
        h = torch.empty(self.H, device=self.device, dtype=self.dtype)
        N, K = Ls[0]["o"].shape
        pick("o_proj", gemv_mod.CONFIGS,
             lambda c: lambda: [gemv(a, L["o"], residual=x, out=h, config=c, pdl=self.pdl) for L in Ls])
        if self.is_moe and self.routed is None:  # the routed kernels' configs are tune_routed's, below
            lg = torch.empty_like(self.router_logits)
            N, K = Ls[0]["router"].shape
            pick("router", gemv_mod.CONFIGS,
                 lambda c: lambda: [gemv(x, L["router"], norm_w=L["ln2"], eps=eps, out=lg, config=c, pdl=self.pdl) for L in Ls])
            E, I2, Hh = Ls[0]["gate_up"].shape
            k = Ls[0]["top_k"]
            lgs = [torch.randn(E, device=self.device, dtype=self.dtype) for _ in Ls]
            act = torch.empty_like(self.act)
            pick("moe_gate_up", moe_mod.GATE_UP_CONFIGS,
                 lambda c: lambda: [moe(x, lgs[i], L["gate_up"], L["down"], k, L["norm_topk"], residual=x,
                                        norm_w=L["ln2"], act_buf=act, out=h, gate_up_config=c, pdl=self.pdl)
                                    for i, L in enumerate(Ls)])
            pick("moe_down", moe_mod.DOWN_CONFIGS,
                 lambda c: lambda: [moe(x, lgs[i], L["gate_up"], L["down"], k, L["norm_topk"], residual=x,
                                        norm_w=L["ln2"], act_buf=act, out=h, down_config=c, pdl=self.pdl)
                                    for i, L in enumerate(Ls)])
        elif not self.is_moe:
            N2, K = Ls[0]["gate_up"].shape
            act = torch.empty_like(self.act)
            pick("mlp_gate_up", gemv_mod.CONFIGS,
                 lambda c: lambda: [gemv(x, L["gate_up"], norm_w=L["ln2"], eps=eps, gated=True, out=act, config=c, pdl=self.pdl)
                                    for L in Ls])
            N, K = Ls[0]["down"].shape
            ai = torch.randn(K, device=self.device, dtype=self.dtype)
            pick("mlp_down", gemv_mod.CONFIGS,
                 lambda c: lambda: [gemv(ai, L["down"], residual=x, out=h, config=c, pdl=self.pdl) for L in Ls])
        # reference points: cuBLAS for the same batch-1 products (no norm/residual fused)
        import torch.nn.functional as F

        for kind, key, xin in (("cublas_qkv", "qkv", x), ("cublas_o_proj", "o", a)):
            out[kind] = (None, bench(lambda: [F.linear(xin, L[key]) for L in Ls]))
            if log:
                log(f"tune {kind}: {out[kind][1]:.2f} us/layer")
        if not self.is_moe:
            out["cublas_mlp_gate_up"] = (None, bench(lambda: [F.linear(x, L["gate_up"]) for L in Ls]))
            out["cublas_mlp_down"] = (None, bench(lambda: [F.linear(ai, L["down"]) for L in Ls]))
        if self.routed is not None:
            out.update(self.tune_routed(reps, log))
        if self.fused_ends:  # the step's lm_head is the argmax variant, which only tune_step times in place
            return out
        N, K = self.lm_head.shape
        pick("lm_head", gemv_mod.CONFIGS,
             lambda c: lambda: [gemv(x, self.lm_head, norm_w=self.final_norm, eps=eps, out=self.logits, config=c,
                                     pdl=self.pdl)], per=1)
        return out
