"""Per-layer MoE expert counts of a served request, from the router's own top-k in the captured graph.

The compiled forward does not expose routing (its kernels route inside the
MoE op), and module hooks fire only in eager code. So the counter finds the
routers in the captured prefill graph by their op, not by a framework's module
names: an ``aten.topk`` inside a decoder block whose input's last dimension is
the number of experts and whose ``k`` is the number of experts per token. A
copy of that graph returns each router's selected expert ids beside the
logits, and after a request has been answered the counter replays the tokens
the model processed for it (the prompt, and each generated token that was fed
back: ``in + out - 1`` tokens) through the copy, in chunks of ``CHUNK``, on the same KV
cache. ``bincount`` of the ids gives (num_layers, num_experts) counts: how many
(token, slot) assignments each expert got, the tkcc trace's ``moe`` field.

Cost: one eager prefill of ``in + out - 1`` tokens per counted request, on the
scheduler thread between requests (so never inside a request's latency, but
it delays the next one); the server reports it (``tkcc_moe_count_seconds``).
The ids are the reference graph's routing: equal to the served forward's in
exact mode; a tolerance-mode forward can differ where rounding flips a near tie.
"""
from __future__ import annotations

import torch
import torch.fx

from tkcc.errors import TkccError

CHUNK = 128  # replay tokens per prefill call (bounds the experts' gather memory of long requests)


def _config_moe(model) -> tuple[int, int] | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    return (int(experts), int(top_k)) if experts and top_k else None


def is_moe(program) -> bool:
    return _config_moe(program.model) is not None


def router_nodes(gm: torch.fx.GraphModule, layer_map: dict, num_experts: int, top_k: int) -> list:
    """(block index, topk node) of every router in ``gm``, in block order; one per MoE block."""
    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.topk.default:
            continue
        if n.name not in layer_map:
            continue
        k = n.args[1] if len(n.args) > 1 else n.kwargs.get("k")
        val = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
        if k != top_k or val is None or val.shape[-1] != num_experts:
            continue
        found.append((layer_map[n.name], n))
    blocks = [b for b, _ in found]
    if len(set(blocks)) != len(blocks):
        raise TkccError(f"more than one router-shaped top-k in a block ({blocks}); cannot tell which routes")
    return sorted(found, key=lambda t: t[0])


class ExpertCounter:
    """Counts each served request's expert assignments per MoE layer (see the module docstring)."""

    def __init__(self, program):
        moe = _config_moe(program.model)
        if moe is None:
            raise TkccError("not an MoE model: no num_experts/num_experts_per_tok in its config")
        self.num_experts, self.top_k = moe
        self.program = program
        gm = program.graphs.get("prefill")
        if gm is None:
            raise TkccError("no captured prefill graph to read the routers from (a forward loaded with tkcc.load "
                            "exports no graph)")
        found = router_nodes(gm, program.layer_map.get("prefill", {}), self.num_experts, self.top_k)
        if not found:
            raise TkccError(f"no router top-k (k={self.top_k} over {self.num_experts} experts) in the captured "
                            "prefill graph")
        self.layers = [b for b, _ in found]
        self.graph = _with_router_outputs(gm, [n for _, n in found])

    @property
    def header(self) -> dict:
        """The tkcc trace header's ``moe`` entry."""
        return {"num_layers": len(self.layers), "num_experts": self.num_experts, "top_k": self.top_k}

    def count(self, token_ids: list[int]) -> list[list[int]]:
        """(num_layers, num_experts) assignment counts of ``token_ids`` processed from position 0.

        Writes the program's KV cache (a slots Program's staging row only): call it only where no request is
        decoding on those rows."""
        meta = self.program.meta
        dev = torch.device(meta.get("device", "cpu"))
        n = len(token_ids)
        if n == 0:
            return [[0] * self.num_experts for _ in self.layers]
        if n > int(meta.get("max_cache_len", n)):
            raise TkccError(f"{n} tokens do not fit the KV cache ({meta['max_cache_len']})")
        counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.long, device=dev)
        ids = torch.tensor([token_ids], dtype=torch.long, device=dev)
        self._clear()
        with torch.no_grad():
            for lo in range(0, n, CHUNK):
                hi = min(n, lo + CHUNK)
                outs = self.graph(ids[:, lo:hi], torch.arange(lo, hi, device=dev))
                for i, sel in enumerate(outs[1:]):
                    counts[i] += torch.bincount(sel.reshape(-1), minlength=self.num_experts)
        self._clear()
        return counts.cpu().tolist()

    def _clear(self) -> None:
        """Zero the cache rows the replay writes: all of a batch-1 Program's; only the staging row of a slots
        Program (``tkcc.frontend.slots``), whose slots hold requests still decoding."""
        if self.program.meta.get("slots"):
            with torch.no_grad():
                for buf in self.program.state.buffers(recurse=False):
                    buf.zero_()
        else:
            self.program.reset_state()


def _with_router_outputs(gm: torch.fx.GraphModule, routers: list) -> torch.fx.GraphModule:
    """A copy of ``gm`` that returns (its output, the expert ids of each router in ``routers``)."""
    graph = torch.fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    sel = []
    for n in routers:
        ids = graph.call_function(_getitem, (env[n], 1))
        sel.append(ids)
    graph.output((out, *sel))
    graph.lint()
    return torch.fx.GraphModule(gm, graph, class_name="RouterCounting")


def _getitem(t, i):
    return t[i]
