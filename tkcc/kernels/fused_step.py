"""The fused decode step as a graph node, and how an artifact rebuilds it from its recorded configs.

``FusedDecodeStep`` is what ``decode_fused_step`` puts in a decode graph:
(input_ids [1, 1], cache_position [1]) -> logits [1, 1, vocab] through a
``FusedDecoder``, with the original graph beside it for any call the fused
step does not take. Codegen cannot write the decoder as aten lines, so the
node describes itself (``tkcc_source``): the kernel-library function that
rebuilds it (``bind_step``), the JSON config that determines it (options,
attention layout and every tuned kernel config) and the fallback graph. An
artifact's generated forward calls ``bind_step`` on the resident model and
state; nothing is tuned again at load, and no process-global table is read.
"""
from __future__ import annotations

import logging

import torch

from tkcc.errors import TkccError

log = logging.getLogger("tkcc.kernels.fused_step")

OPTIONS = ("attn_chunk", "pdl", "fused_attention", "routed_moe", "fused_ends", "attn_tile", "attn_spans")


class FusedDecodeStep(torch.nn.Module):
    """(input_ids [1, 1], cache_position [1]) -> logits [1, 1, vocab] through the fused decoder."""

    def __init__(self, decoder, original, cuda_graph: bool, unsupported: str | None, options: dict | None = None):
        super().__init__()
        self.decoder = decoder
        self.original = original
        self.cuda_graph = cuda_graph
        self.unsupported = unsupported
        self.options = dict(options or {})
        self.calls = 0
        self.fallback_calls = 0

    def forward(self, input_ids, cache_position):
        reason = self.unsupported
        if reason is None and (input_ids.numel() != 1 or cache_position.numel() != 1):
            reason = f"input_ids {tuple(input_ids.shape)} is not one token of one sequence"
        if reason is not None:
            if self.fallback_calls == 0:
                log.info("decode_fused_step: running the original graph (%s)", reason)
            self.fallback_calls += 1
            return self.original(input_ids, cache_position)
        self.calls += 1
        dec = self.decoder
        dec.use_span(None)  # the position is on the device only: the layout of the whole cache
        if self._capture_due(input_ids):
            dec.set_inputs(input_ids, cache_position)  # capture's steps then write what this step writes anyway
            dec.capture()
        return dec.forward(input_ids, cache_position)

    def _capture_due(self, input_ids) -> bool:
        """The current span's step is captured on its second call (the first compiles every kernel)."""
        return self.cuda_graph and self.decoder.graph is None and input_ids.is_cuda and self.calls >= 2

    def greedy_next(self, input_ids, cache_position, position: int, continued: bool):
        """One greedy step for ``tkcc.frontend.generate``'s loop: (token [1], logits [1, vocab], valid until the
        next step). ``position`` is the step's position as the host knows it: it picks the layout of the span
        that holds it. ``continued``: the inputs are the token and position this step's previous call produced,
        which the decoder keeps on the device (its step writes them back), so nothing is copied in (and
        ``cache_position`` may be None) and the token is the decoder's own argmax: one graph replay per token."""
        fed = continued and self.decoder is not None and self.unsupported is None and input_ids.numel() == 1
        if cache_position is None and not fed:
            cache_position = torch.tensor([position], dtype=torch.long, device=input_ids.device)
        if self.decoder is None or self.unsupported is not None or input_ids.numel() != 1:
            last = self.forward(input_ids, cache_position)[:, -1]
            return last.argmax(-1), last
        self.calls += 1
        dec = self.decoder
        dec.use_span(position)
        if not fed:
            dec.set_inputs(input_ids, cache_position)
        if self._capture_due(input_ids):
            dec.capture()  # from the state just set: its steps write what this step writes anyway
        if dec.graph is not None:
            dec.graph.replay()
        else:
            dec.step()
        return dec.token.clone(), dec.logits.view(1, -1)

    @property
    def captures_itself(self) -> bool:
        """It replays its own CUDA graph: a caller must not capture it inside another."""
        return bool(self.cuda_graph and self.decoder is not None)

    def config(self) -> dict:
        """Everything that determines the step, JSON-able: what ``bind_step`` rebuilds it from."""
        dec = self.decoder
        out = {"cuda_graph": bool(self.cuda_graph), "unsupported": self.unsupported, **self.options}
        if dec is not None:
            out["max_cache_len"] = int(dec.max_cache_len)
            out["configs"] = {k: list(v) for k, v in sorted(dec.configs.items())}
        return out

    def tkcc_source(self) -> dict:
        """How codegen writes this node: ``bind_step(model, state, config, fallback)`` from this module."""
        return {"module": __name__, "factory": "bind_step", "config": self.config(), "fallback": self.original,
                "greedy": "greedy_next"}


def bind_step(model, state, config: dict, fallback) -> FusedDecodeStep:
    """Rebuild the step an artifact recorded, on the resident model and KV cache (no tuning, no search)."""
    from tkcc.kernels.common import fallback_reason

    unknown = set(config) - {"cuda_graph", "unsupported", "max_cache_len", "configs", *OPTIONS}
    if unknown:
        raise TkccError(f"fused decode step: unknown config keys {sorted(unknown)} (an artifact of another "
                        f"tkcc version?)")
    opts = {k: config[k] for k in OPTIONS if k in config}
    reason = config.get("unsupported")
    dec = None
    if reason is None:
        if state is None or not hasattr(state, "key"):
            raise TkccError("fused decode step: the artifact needs the Program's static KV cache as its state")
        if int(config["max_cache_len"]) != int(state.max_cache_len):
            raise TkccError(f"fused decode step: built for a cache of {config['max_cache_len']} positions, "
                            f"this state has {state.max_cache_len}")
        keys = [state.key(i)[0] for i in range(state.num_layers)]
        vals = [state.value(i)[0] for i in range(state.num_layers)]
        reason = fallback_reason(keys[0])  # this process may not run the kernels (CPU without the interpreter)
        if reason is None:
            dec = decoder_for(model, state.max_cache_len, (keys, vals), opts,
                              {k: tuple(v) for k, v in (config.get("configs") or {}).items()})
    return FusedDecodeStep(dec, fallback, bool(config.get("cuda_graph", True)), reason, opts)


def decoder_for(model, max_cache_len: int, kv, opts: dict, configs: dict | None = None):
    """A FusedDecoder with the pass's options (``attn_tile`` as 'POSITIONSxWARPS', ``pdl`` False to turn off)."""
    from tkcc.kernels.decoder import FusedDecoder

    tile = parse_tile(opts.get("attn_tile", "64x4"))
    spans = parse_spans(opts.get("attn_spans", ""))
    return FusedDecoder(model, max_cache_len=max_cache_len, attn_chunk=opts.get("attn_chunk") or None,
                        pdl=None if opts.get("pdl", True) else False, kv=kv,
                        fused_attention=bool(opts.get("fused_attention")), routed_moe=bool(opts.get("routed_moe")),
                        fused_ends=bool(opts.get("fused_ends")), attn_tile=tile, configs=configs, attn_spans=spans)


def parse_spans(attn_spans) -> tuple[int, ...]:
    """'1024,4096' -> (1024, 4096): context spans with their own attention layout ('' for none)."""
    text = str(attn_spans or "").strip()
    try:
        spans = tuple(int(v) for v in text.split(",")) if text else ()
        if any(v < 1 for v in spans):
            raise ValueError
    except ValueError:
        raise TkccError(f"decode_fused_step: attn_spans {attn_spans!r} is not a comma-separated list of context "
                        f"lengths, e.g. '1024,4096'") from None
    return spans


def parse_tile(attn_tile) -> tuple[int, int]:
    try:
        tile = tuple(int(v) for v in str(attn_tile).split("x"))
        if len(tile) != 2 or tile[0] < 16 or tile[0] & (tile[0] - 1) or tile[1] not in (1, 2, 4, 8, 16):
            raise ValueError
    except ValueError:
        raise TkccError(f"decode_fused_step: attn_tile {attn_tile!r} is not 'POSITIONSxWARPS' (positions a "
                        f"power of two >= 16, warps 1-16), e.g. '64x4'") from None
    return tile
