"""Batch-1 decode on one GPU: HF eager, HF + torch.compile (optional), the graph-lowered step (variant
``lowered``: the lowered_decode pass through tkcc.compile), and the floor.

For each model and context: ms/token (CUDA events, median of several runs of
``--tokens`` steps; the lowered step replays one CUDA graph per step), the floor
(weights read per token + KV bytes at that context, over the device-to-device
copy bandwidth measured in this run) and the peak device memory of each
variant. Each lowered row's first step is judged against the captured graph run
in fp32 (``judge_first_step``), and the lowered step's greedy tokens against
the captured graphs' and HF eager's (``greedy_check``). Then the trace-weighted
objective (P90 per-user decode tokens/s) from the measured curve.

  python benchmarks/decode.py --checks        # full run (kernel checks, 2 models, 4 contexts, every variant)
  python benchmarks/decode.py --quick         # 2 contexts, fewer tokens
  python benchmarks/decode.py --compile       # add HF static cache + torch.compile (slow to compile; per-model
                                              # budget --compile-budget-s, shortest and longest context first)
  python benchmarks/decode.py --variants lowered --kernels   # front-door variants (FRONT_DOOR below), per kernel
  TRITON_INTERPRET=1 python benchmarks/decode.py --smoke   # CPU: llama-tiny through every code path, ~1 min
  python benchmarks/decode.py --compile-only --compile-fresh --contexts 2048 8192
      # torch.compile rows only, each (model, context) compiled in a fresh process (see --compile-fresh)
  python benchmarks/decode.py --objective-from decode.json later.json --compile-rows-from c1.json c2.json
      # no GPU needed: the trace-weighted objective of runs whose torch.compile rows were measured apart
      # (one fresh process per context), written to decode_objective.json beside the first file
Rows go to benchmarks/results/decode.json (and $OUT/decode.json when $OUT is set).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tkcc.frontend.decode_bytes import bytes_per_token, weight_bytes_per_token  # noqa: E402
from tkcc.frontend.hf_cache import probe_layout  # noqa: E402
from tkcc.frontend.models import build_model, get_spec  # noqa: E402
from tkcc.frontend.weight_packing import pack_projections  # noqa: E402

CUDA = torch.cuda.is_available()
T_START = time.time()


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def commit() -> str:
    from provenance import commit as tree

    return tree()


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read + written (median of 20)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    ts = []
    for i in range(25):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        if i >= 5:
            ts.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / float(np.median(ts))


_LAYOUTS: dict = {}


def kv_bytes(model, context: int) -> int:
    """State bytes a decode step at ``context`` reads (tkcc.frontend.decode_bytes, the floor's one mechanism)."""
    if id(model) not in _LAYOUTS:
        _LAYOUTS[id(model)] = probe_layout(model, 1)[0]
    return bytes_per_token(model, context, _LAYOUTS[id(model)])["state"]


def time_steps(fn, n: int, reps: int) -> float:
    """Median over reps of (time of n calls)/n, ms; CUDA events (host clock on CPU)."""
    out = []
    for _ in range(reps):
        if CUDA:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn(n)
            e1.record()
            torch.cuda.synchronize()
            out.append(e0.elapsed_time(e1) / n)
        else:
            t = time.perf_counter()
            fn(n)
            out.append((time.perf_counter() - t) * 1e3 / n)
    return float(np.median(out))


def peak_reset() -> int:
    """Free what earlier rows dropped, then reset the peak-memory counter; returns the bytes still allocated (what
    ``peak`` subtracts). ``tkcc.compile`` freezes what is alive (``gc.freeze``, for the decode loops it serves), a
    row's captured Program and its cache included: collected only once unfrozen."""
    gc.unfreeze()
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    return 0


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def peak(model=None, before: int = 0) -> int:
    """Peak bytes allocated since the reset. With ``model`` and the reset's ``before``: the model's weights
    plus what this row allocated on top of what was alive at the reset, so that anything an earlier row
    left allocated (freed late) is not charged to this one."""
    if not CUDA:
        return 0
    p = int(torch.cuda.max_memory_allocated())
    return p if model is None else model_bytes(model) + p - before


# -- HF baselines --------------------------------------------------------------------------------
def hf_decode_timer(model, context: int, tokens: int, fwd):
    """A decode-step loop on HF's StaticCache at ``context``; the cache holds random K/V (timing only)."""
    from transformers import StaticCache

    dev = next(model.parameters()).device
    cache = StaticCache(config=model.config, max_cache_len=context + tokens + 8)
    tok = torch.tensor([[7]], device=dev)
    with torch.no_grad():
        model(input_ids=tok, past_key_values=cache, cache_position=torch.tensor([0], device=dev), use_cache=True)
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
    positions = [torch.tensor([context + i], device=dev) for i in range(tokens)]
    # transformers 5's cache layers write where their own running count says, not at ``cache_position``: put the
    # count back at the context before each run, or the runs write past the cache (IndexError after
    # max_cache_len calls) and time a context other than the row's. A sliding-window layer's count past its
    # window makes it roll, as it does serving a context that long.
    def at_context():
        for layer in cache.layers:
            if hasattr(layer, "cumulative_length_int"):
                layer.cumulative_length_int = context
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length.fill_(min(context, int(getattr(layer, "max_cache_len", context))))

    def run(n):
        if n > tokens:
            raise ValueError(f"run({n}): the cache holds {tokens} steps past the context")
        at_context()
        with torch.no_grad():
            for i in range(n):
                fwd(input_ids=tok, past_key_values=cache, cache_position=positions[i % tokens], use_cache=True)
    return run, cache


def ends_first(contexts):
    """Shortest and longest context first, then the rest: a time budget that stops early still leaves the
    two points the trace-weighted objective interpolates between."""
    cs = sorted(set(contexts))
    return cs[:1] + cs[-1:] + cs[1:-1] if len(cs) > 2 else cs


def hf_rows(model, name, contexts, tokens, reps, variant, fwd, compile_cap_s=None, budget_s=None):
    rows = []
    t_start = time.time()
    for c in contexts:
        if budget_s and rows and time.time() - t_start > budget_s:
            log(f"{variant}: {time.time() - t_start:.0f}s spent (budget {budget_s:.0f}s); skipping ctx {c}")
            continue
        before = peak_reset()
        run, cache = hf_decode_timer(model, c, tokens, fwd)
        t0 = time.time()
        run(min(3, tokens))  # warm-up (compiles on the first context for torch.compile)
        if CUDA:
            torch.cuda.synchronize()
        warm = time.time() - t0
        ms = time_steps(run, tokens, reps)
        rows.append(dict(model=name, context=c, routing="router", variant=variant, ms_per_token=ms,
                         peak_mem_bytes=peak(model, before), peak_mem_bytes_raw=peak(), warmup_s=round(warm, 2)))
        log(f"{name} {variant} ctx={c}: {ms:.3f} ms/token (warm-up {warm:.1f}s)")
        del run, cache
        if compile_cap_s and warm > compile_cap_s:
            log(f"{variant}: warm-up {warm:.0f}s exceeded the cap {compile_cap_s}s; skipping its other contexts")
            break
    return rows


# -- tkcc ------------------------------------------------------------------------------------------
GREEDY_PLAN = [{"name": "lowered_decode", "params": {"tune": False}}]  # the greedy check's build (untuned)


def greedy_check(model, prompts, new_tokens, fp32_reference=True):
    """Greedy tokens of the lowered step (``GREEDY_PLAN`` built by ``tkcc.compile``, decoded by the one greedy
    loop ``compiled.generate`` runs) against the captured graphs' and HF eager's, and HF eager and the lowered
    step each against HF eager in fp32 on the same (upcast) weights: bf16 noise alone flips near-tied argmaxes
    of a random-weight model, so 'identical to HF bf16' is judged next to how far HF bf16 itself is from the
    fp32 model. ``logits_rel_err``: the worst over the decode steps (the first token is the prefill's) whose
    inputs are still the same in both, i.e. up to the first divergence."""
    import copy
    import tempfile

    import tkcc
    from tkcc.frontend.generate import greedy

    dev = next(model.parameters()).device
    ref32 = copy.deepcopy(model).float() if fp32_reference else None

    def gen(m, p):
        with torch.no_grad():
            out = m.generate(torch.tensor([p], device=dev), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        return out.sequences[0, len(p):].tolist(), torch.stack([lg[0].float() for lg in out.logits])

    def cmp(a_toks, a_logits, b_toks, b_logits):
        first = next((i for i, (x, y) in enumerate(zip(a_toks, b_toks)) if x != y), None)
        last = len(a_toks) - 1 if first is None else first
        errs = [float((a_logits[i] - b_logits[i]).norm() / b_logits[i].norm()) for i in range(1, last + 1)]
        return dict(identical=a_toks == b_toks, first_divergence=first, logits_rel_err=max(errs, default=None))

    res = []
    with tempfile.TemporaryDirectory() as tmp:
        compiled = tkcc.compile(model, plan=GREEDY_PLAN, mode="tolerance", measure=False, check=False,
                                progress=False, max_cache_len=max(map(len, prompts)) + new_tokens + 8,
                                out_dir=Path(tmp) / "c")
        for p in prompts:
            ids = torch.tensor([p], device=dev)
            toks = {}
            for who, fwd in (("lowered", compiled.forwards), ("graph", None)):
                t, lg = greedy(compiled.program, ids, new_tokens, forwards=fwd, return_logits=True)
                toks[who] = (t[0].tolist(), lg[0])
            lo_t, lo_l = toks["lowered"]
            hf_t, hf_l = gen(model, p)
            row = dict(prompt_len=len(p), new_tokens=new_tokens, lowered_vs_hf=cmp(lo_t, lo_l, hf_t, hf_l),
                       lowered_vs_captured_graph=cmp(lo_t, lo_l, *toks["graph"]), hf=hf_t[:8], lowered=lo_t[:8])
            if ref32 is not None:
                r_t, r_l = gen(ref32, p)
                row["hf_bf16_vs_fp32"] = cmp(hf_t, hf_l, r_t, r_l)
                row["lowered_bf16_vs_fp32"] = cmp(lo_t, lo_l, r_t, r_l)
            res.append(row)
        del compiled
    del ref32
    peak_reset()
    return res


VARIANT_TOL = 0.1  # first-step logits, rel. err. vs the fp32 captured graph (judge_first_step) dropping a variant
AS_GOOD, UNRELATED = 1.25, 0.8  # judge_first_step where the bf16 reference is itself off fp32
DRAWS = 3  # caches drawn per context for one where the bf16 graph is stable (tkcc.runtime.stability.MAX_DRAWS)


# The front door's decode step (tkcc.compile with a plan, its forward replayed from the decode CUDA graph the
# compiled model wraps it in): the graph-lowered step (``lowered``: the lowered_decode pass, GEMV/MoE configs
# tuned and the attention layout tuned at the row's context), timed by the greedy loop's per-token work, through
# the forward's self-feeding step (``tkcc_greedy``, the CUDA-graph wrapper's ``GreedyStep``) where it has one.
# ``lowered_fused``: then fuse_elementwise over what no rewrite took (Qwen2-MoE's shared-expert gate, MiniMax's
# scaled residuals), as the search composes it (the pass's stage: after the lowering).
def _lowered(c: int) -> list[dict]:
    return [{"name": "lowered_decode", "params": {"tune": True, "tune_context": _tune_at(c)}}]


FRONT_DOOR = {"lowered": _lowered, "lowered_fused": lambda c: _lowered(c) + [{"name": "fuse_elementwise"}]}
DEFAULT_VARIANTS = ("lowered",)  # what runs without --variants


def _tune_at(context: int) -> int:
    from tkcc.passes.lower.decode import LoweredDecode

    allowed = [v for v in LoweredDecode.params["tune_context"] if v]
    return min(allowed, key=lambda v: abs(v - context))


def _written(buf, c):
    """The part of a state buffer a decode step at position ``c`` writes: a KV cache's [B, H, S, D] position, or a
    recurrent state (MiniMax's [2, B, H, D, D] double buffer) whole."""
    return (slice(None), slice(None), c) if buf.dim() == 4 and buf.shape[2] > c else (slice(None),)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def judge_first_step(got, ref, ref32=None, tol=VARIANT_TOL, jump=None) -> tuple[bool, dict, str]:
    """Whether a front-door variant's first-step logits ``got`` are right: (ok, errors, why not).

    With ``ref32`` (the captured graph run in fp32 on the same weights and cache) the variant is judged against
    it: a correct bf16 step is within ~0.02 of fp32 on olmoe-16l's shapes at every context, expert choices
    that a rounding difference flips included (one flip moves the logits by 0.4-1.6%, measured on CPU), so
    ``tol`` separates rounding from a wrong kernel without trusting the bf16 reference, which may itself be
    off. Without it, against the bf16 reference ``ref``. ``errors`` holds both distances (and the bf16
    reference's own from fp32) so a failure says which of the three is off.

    Where the bf16 reference is itself past ``tol`` from fp32 (random-weight MoE models at near router ties:
    qwen3moe-16l's graph was 0.60 from fp32 at 8k, deepseekv3-16l's 0.24 at 128), no step can be held to
    ``tol``: a step at most ``AS_GOOD`` times as far from fp32 as the model's own bf16 graph is, and short of
    ``UNRELATED`` (two unrelated logit vectors are ~1.4 apart), is as accurate as the model at that input, and
    ``errors["judged_by"]`` says so. So is one within ``AS_GOOD`` times ``jump``, how far the bf16 graph itself
    moves under one rounding step of its cache (``reference_jump``), where that is past ``tol``: at such an
    input (minimax-16l at 128 on an H200: 0.18) a rounding difference anywhere flips a router's choice, as the
    engine's validation knows (``tkcc.runtime.stability``); ``frontdoor_rows`` first redraws the cache for a
    stable input."""
    errs = {"vs_captured_graph": _rel(got, ref)}
    if ref32 is not None:
        errs["vs_fp32"] = _rel(got, ref32)
        errs["captured_graph_vs_fp32"] = _rel(ref, ref32)
    judged = errs.get("vs_fp32", errs["vs_captured_graph"])
    if judged < tol:
        return True, errs, ""
    own = errs.get("captured_graph_vs_fp32")
    if own is not None and own >= tol and judged <= AS_GOOD * own and judged < UNRELATED:
        errs["judged_by"] = (f"the bf16 captured graph is itself {own:.3g} from fp32: the step, {judged:.3g} from "
                             f"it, is within {AS_GOOD}x of the model's own")
        return True, errs, ""
    if jump is not None and jump >= tol and judged <= AS_GOOD * jump and judged < UNRELATED:
        errs["judged_by"] = (f"the bf16 captured graph moves by {jump:.3g} under one rounding step of its cache at "
                             f"this input (a router near tie): the step, {judged:.3g} off, is within {AS_GOOD}x of "
                             f"that")
        return True, errs, ""
    what = "the fp32 run of the captured graph" if ref32 is not None else "the captured graph"
    why = f"first-step logits differ from {what} (rel err {judged:.3g} >= {tol})"
    if ref32 is not None:
        why += (f"; vs the bf16 captured graph {errs['vs_captured_graph']:.3g}, which is itself "
                f"{errs['captured_graph_vs_fp32']:.3g} from fp32")
    return False, errs, why


def engine_opinion(prog, tok, pos, ref, got, dtype: torch.dtype, bound: float | None = None
                   ) -> tuple[bool, str] | None:
    """The engine's own second opinion on first-step logits ``got`` that ``judge_first_step`` refused
    (``tkcc.runtime.validation.exact_opinion``, the rule its validation and its sampled checks apply): the
    captured decode graph computing in fp32 on the same weights and cache, and where a router choice is within a
    near tie, the same with that choice (one, a pair, or all of them) taken the other way. (ok, what was found),
    or None where the fp32 graph cannot run. ``bound``: of the logits' scale, by default ``dtype``'s floor (the
    engine's tightest). At olmoe-16l's 8k, the bf16 graph moved by 0.34-1.2 under one
    rounding step of its cache in every draw, and a correct step that routed one near tie otherwise was 0.47
    from the fp32 run: no bound on the distance alone tells it from a wrong one."""
    from tkcc.runtime.determinism import dtype_floor
    from tkcc.runtime.exact_reference import upcast
    from tkcc.runtime.validation import StateGuard, exact_opinion

    up = upcast(prog.graphs["decode"])
    if up is None:
        return None
    return exact_opinion(up, (tok, pos), StateGuard(prog.state), [ref], [got],
                         dtype_floor(dtype) if bound is None else bound)


def _fp32_fits(model, prog) -> bool:
    """Whether an fp32 copy of the model (made through a copy in its own dtype: 6 bytes a bf16 weight at the
    peak) and of the Program's state fit beside what is on the device now."""
    if not CUDA:
        return True
    state = sum(b.numel() for b in prog.state.buffers()) if prog.state is not None else 0
    weights = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()))
    return 1.2 * (6 * weights + 4 * state) < torch.cuda.mem_get_info()[0]


def fp32_reference(model32, prog, c, tok, pos, tokens):
    """The first-step logits of the captured decode graph run in fp32 (``model32``: an fp32 copy of the model) on
    ``prog``'s cache contents, upcast: what the bf16 reference and every variant are judged against."""
    from tkcc.frontend.capture import capture

    p32 = capture(model32, phases=["decode"], max_cache_len=c + tokens + 8)
    mine = dict(prog.state.named_buffers())
    with torch.no_grad():
        for n, b in p32.state.named_buffers():
            b.copy_(mine[n])
        out = p32.graphs["decode"](tok, pos).float()
    del p32
    return out


def reference_jump(prog, tok, pos, ref, seed: int) -> float:
    """How far the bf16 reference's own logits move when its cache is perturbed by one bf16 rounding step
    (random signs, then the opposite ones): the engine's stability probe (``tkcc.runtime.stability``). Near
    expert ties that rounding flips show here; the cache is put back."""
    from tkcc.runtime.stability import perturb_state

    bufs = [b for b in prog.state.buffers() if b.is_floating_point()]
    saved = [b.clone() for b in bufs]
    worst = 0.0
    with torch.no_grad():
        for flip in (False, True):
            try:
                perturb_state(bufs, seed, flip=flip)
                worst = max(worst, _rel(prog.graphs["decode"](tok, pos), ref))
            finally:
                for b, v in zip(bufs, saved):
                    b.copy_(v)
    return worst


def greedy_timer(fwd, start_tok, start_pos, c):
    """``run(n)``: n greedy tokens from (start_tok, start_pos), as the greedy loop drives ``fwd``: through its
    self-feeding step (``tkcc_greedy``) where it has one. Called twice before it is returned (compiles, capture)."""
    step = getattr(fwd, "tkcc_greedy", None)

    def run(n):
        with torch.no_grad():
            tok, pos = start_tok, start_pos
            for i in range(n):
                if step is not None:
                    tok = step(tok, pos if i == 0 else None, position=c + i, continued=i > 0)[0][:, None]
                    continue
                logits = fwd(tok, pos)
                tok = logits[:, -1].argmax(-1)[:, None]
                pos = pos + 1
    run(2)
    return run


REAL_TOKENS = 256  # steps of sampled real routing a forced step cycles through


def _moe_arg(n, name: str, index: int, default=None):
    """Argument ``name`` (schema position ``index``) of a MoE op's node, given by position or keyword."""
    return n.kwargs.get(name, n.args[index] if len(n.args) > index else default)


def _moe_ops() -> dict:
    """The routed-MoE kernel ops that take ``forced_ids``: op -> schema positions of (gate_up [E, ...], top_k)."""
    return {torch.ops.tkcc.moe.default: (4, 6), torch.ops.tkcc.moe_gptoss.default: (3, 7)}


def forced_routing(gm, seed: int = 0):
    """(graph, note): a copy of the lowered decode graph ``gm`` whose MoE ops (``tkcc.moe``, ``tkcc.moe_gptoss``)
    take their experts from
    real routing (``tkcc.traffic.routing.Routing.for_model``: OLMoE's or Mixtral's measured skew fitted to the
    model's experts, sampled for REAL_TOKENS steps), one step's row per call: a device counter the graph
    advances, so it replays from a CUDA graph like the step it copies. (None, why) where it has no
    softmax-routed MoE op (the forced hook is the softmax router's)."""
    import copy
    import operator

    from tkcc.traffic.routing import Routing

    g = copy.deepcopy(gm.graph)  # node for node: its get_attr targets are gm's
    ops = _moe_ops()
    moes = [n for n in g.nodes if n.op == "call_function" and n.target in ops]
    if not moes:
        return None, "no routed MoE op (tkcc.moe, tkcc.moe_gptoss) in the lowered step"
    if any(n.target is torch.ops.tkcc.moe.default and _moe_arg(n, "router", 12, "softmax") == "sigmoid_grouped"
           for n in moes):
        return None, "a grouped (sigmoid) router: the kernels force a softmax router's choice only"
    at_w, at_k = ops[moes[0].target]
    w = _moe_arg(moes[0], "gate_up", at_w)
    w = operator.attrgetter(w.target)(gm) if w.op == "get_attr" else w.meta["val"]
    E, k, L, dev = int(w.shape[0]), int(_moe_arg(moes[0], "top_k", at_k)), len(moes), w.device
    routing = Routing.for_model(L, E, k, seed=seed)
    table = torch.stack([routing.sample_topk(layer, REAL_TOKENS, generator=torch.Generator().manual_seed(seed + layer))
                         for layer in range(L)], 1).to(device=dev, dtype=torch.int32).contiguous()  # [T, L, k]
    new = torch.fx.GraphModule(gm, g)
    new.register_buffer("tkcc_forced_ids", table)
    new.register_buffer("tkcc_forced_step", torch.zeros(1, dtype=torch.long, device=dev))
    first = next(n for n in g.nodes if n.op != "placeholder")
    with g.inserting_before(first):
        step = g.get_attr("tkcc_forced_step")
        row = g.call_function(torch.ops.aten.select.int, (g.call_function(
            torch.ops.aten.index_select.default, (g.get_attr("tkcc_forced_ids"), 0, step)), 0, 0))  # [L, k]
    for layer, n in enumerate(moes):
        with g.inserting_before(n):
            n.kwargs = {**n.kwargs, "forced_ids": g.call_function(torch.ops.aten.select.int, (row, 0, layer))}
    with g.inserting_before(next(n for n in g.nodes if n.op == "output")):
        nxt = g.call_function(torch.ops.aten.remainder.Scalar, (
            g.call_function(torch.ops.aten.add.Tensor, (step, 1)), REAL_TOKENS))
        g.call_function(torch.ops.aten.copy_.default, (step, nxt))
    new.recompile()
    return new, (f"{L} MoE layers, {E} experts, top-{k}: sampled real routing, max/mean expert load "
                 f"{routing.imbalance():.2f}")


def real_routing_row(compiled, start_tok, start_pos, c, tokens, reps, seed=0):
    """(ms/token, note) of ``compiled``'s lowered decode step with the experts real traffic picks
    (``forced_routing``), timed as its own step is (from a CUDA graph on the GPU, as ``tkcc.compile`` wraps its
    decode forward); (None, why) where the step cannot be forced."""
    gm = getattr(compiled, "compiled_program", None)
    if gm is None:
        return None, "the compiled model keeps no lowered graph"
    forced, why = forced_routing(gm.graphs["decode"], seed=seed)
    if forced is None:
        return None, why
    from tkcc.compiled import _graphed  # the wrapper tkcc.compile gives its decode forward (a CUDA graph on a GPU)

    run = greedy_timer(_graphed(compiled.program, {"decode": forced})["decode"], start_tok, start_pos, c)
    return time_steps(run, tokens, reps), why


def frontdoor_rows(model, name, contexts, tokens, reps, variants=None, family=None, on_rows=None, fp32=True,
                   kernels=False, real_routing=True):
    """Rows of the front-door variants (``FRONT_DOOR``) at every context: the model's decode phase captured with
    a cache of that context (``context + tokens + 8`` positions), each plan built by ``tkcc.compile``
    (``measure=False``: this script does the timing), the cache filled with random K/V up to the context. A
    variant whose first step's logits fail ``judge_first_step`` (against the captured graph run in fp32 on the
    same weights and cache where ``fp32`` and an fp32 copy fits; else against the bf16 captured graph), or
    that fails, is dropped with its reason in notes["variant_fallbacks"]; the rows taken stand. Per context the
    notes also hold the bf16 captured graph's own distance from fp32 and how far it moves under a one-rounding-
    step perturbation of its cache (``reference_jump``)."""
    import copy
    import tempfile

    import tkcc
    from tkcc.frontend.capture import capture

    want = [v for v in FRONT_DOOR if v in (variants or DEFAULT_VARIANTS)]
    rows, notes, failed = [], {}, {}
    if not want:
        return rows, notes
    dev = next(model.parameters()).device
    model32 = None
    for c in contexts:
        prog = capture(model, phases=["decode"], max_cache_len=c + tokens + 8)
        start_tok = torch.tensor([[11]], device=dev)
        start_pos = torch.tensor([c], device=dev)
        for draw in range(DRAWS):  # a cache at which the bf16 graph is stable under one rounding step, if one comes
            prog.state.fill_random(c, torch.Generator(device=dev).manual_seed(c + 1000 * draw))
            with torch.no_grad():
                saved = [b[_written(b, c)].clone() for b in prog.state.buffers()]
                ref = prog.graphs["decode"](start_tok, start_pos).float()
                for b, v in zip(prog.state.buffers(), saved):
                    b[_written(b, c)].copy_(v)
            jump = reference_jump(prog, start_tok, start_pos, ref, seed=c)
            notes.setdefault("captured_graph_jump_under_one_rounding_step", {}).setdefault(f"ctx {c}", []).append(jump)
            if jump < VARIANT_TOL:
                break
        ref32 = None
        if fp32 and next(model.parameters()).dtype != torch.float32:
            if model32 is None and _fp32_fits(model, prog):
                model32 = copy.deepcopy(model).float()
            why = None if model32 is not None else "an fp32 copy does not fit on the device"
            if model32 is not None:
                try:
                    ref32 = fp32_reference(model32, prog, c, start_tok, start_pos, tokens)
                    notes.setdefault("captured_graph_vs_fp32", {})[f"ctx {c}"] = _rel(ref, ref32)
                except Exception as e:  # noqa: BLE001 - the variants are judged against the bf16 graph then
                    why = f"{type(e).__name__}: {e}"[:300]
            if why is not None:
                notes.setdefault("fp32_reference_skipped", {})[f"ctx {c}"] = why
                log(f"{name} ctx={c}: no fp32 reference ({why}); judging against the bf16 captured graph")
        for variant in want:
            if variant in failed:
                continue
            before = peak_reset()
            t0 = time.time()
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    compiled = tkcc.compile(model, program=prog, plan=FRONT_DOOR[variant](c), mode="tolerance",
                                            measure=False, check=False, progress=False, out_dir=Path(tmp) / "c")
                    build_s = time.time() - t0
                    fwd = compiled.forwards["decode"]
                    with torch.no_grad():
                        got = fwd(start_tok, start_pos).float()
                    for b, v in zip(prog.state.buffers(), saved):
                        b[_written(b, c)].copy_(v)
                    ok, errs, why = judge_first_step(got, ref, ref32, jump=jump)
                    key = f"{variant} ctx {c}"
                    notes.setdefault("first_step_logits_rel_err_vs_captured_graph", {})[key] = errs["vs_captured_graph"]
                    if "vs_fp32" in errs:
                        notes.setdefault("first_step_logits_rel_err_vs_fp32", {})[key] = errs["vs_fp32"]
                    if not ok:  # the engine's rule decides where the distance alone cannot
                        said = engine_opinion(prog, start_tok, start_pos, ref, got, next(model.parameters()).dtype)
                        if said is None or not said[0]:
                            raise RuntimeError(why + (f"; the engine's rule: {said[1]}" if said else ""))
                        errs["judged_by"] = f"the engine's rule (the fp32 graph, near ties either way): {said[1]}"
                    if errs.get("judged_by"):
                        notes.setdefault("first_step_judged_by", {})[key] = errs["judged_by"]

                    run = greedy_timer(fwd, start_tok, start_pos, c)
                    ms = time_steps(run, tokens, reps)
                    split = device_split(fwd, start_tok, start_pos) if CUDA else {}  # positions c .. c + ~25: in the cache
                    if kernels and CUDA:
                        notes.setdefault("front_door_kernels", {})[f"{variant} ctx {c}"] = kernel_times(run, tokens)
                    logs = [log.summary() for log in compiled.logs] if compiled.logs else []
                    plan_notes = [n for log in compiled.logs for n in getattr(log, "notes", [])]
            except Exception as e:
                failed[variant] = f"ctx {c}: {type(e).__name__}: {e}"
                log(f"{name} {variant}: FAILED ({type(e).__name__}: {e}); dropped from this run")
                compiled = fwd = run = None  # nothing of the failed build outlives it into the next row
                peak_reset()
                continue
            rows.append(dict(model=name, context=c, routing="router", variant=variant, ms_per_token=ms,
                             peak_mem_bytes=peak(model, before), peak_mem_bytes_raw=peak(), family=family,
                             build_s=round(build_s, 1), plan=FRONT_DOOR[variant](c), **split))
            notes.setdefault("front_door_pass_notes", {})[f"{variant} ctx {c}"] = plan_notes[-12:]
            notes.setdefault("front_door_pass_logs", {})[f"{variant} ctx {c}"] = logs
            log(f"{name} {variant} ctx={c}: {ms:.3f} ms/token (build {build_s:.0f}s)")
            if real_routing:
                try:
                    real = real_routing_row(compiled, start_tok, start_pos, c, tokens, reps, seed=c)
                except Exception as e:  # noqa: BLE001 - the router's row stands; say why the real one is missing
                    real = None
                    notes.setdefault("real_routing_errors", {})[f"{variant} ctx {c}"] = f"{type(e).__name__}: {e}"[:400]
                    log(f"{name} {variant} ctx={c}: no real-routing row ({type(e).__name__}: {e})")
                if real is not None:
                    ms_real, why = real
                    if ms_real is None:
                        notes.setdefault("real_routing_skipped", {})[variant] = why
                    else:
                        rows.append(dict(rows[-1], routing="real", ms_per_token=ms_real, peak_mem_bytes=None,
                                         peak_mem_bytes_raw=None, real_routing=why))
                        log(f"{name} {variant} ctx={c} routing=real: {ms_real:.3f} ms/token ({why})")
            del compiled, fwd, run  # the step (a GreedyStep on the GPU) holds the forward and its cache
            if on_rows is not None:
                on_rows(rows, notes)
        del prog
        peak_reset()
    del model32
    if failed:
        notes["variant_fallbacks"] = failed
    return rows, notes


def kernel_times(run, n: int, top: int = 30) -> dict:
    """Device microseconds per token of each kernel the timed loop ``run(n)`` launches, by kernel name, from
    torch.profiler (CUPTI records the kernels a CUDA graph replays too), largest first, with their sum: where
    a variant's ms/token goes (or where two variants' differ), kernel by kernel. ``{"error": ...}`` where the profiler recorded nothing."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    try:
        run(2)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(n)
            torch.cuda.synchronize()
        per = defaultdict(float)
        count = defaultdict(int)
        for e in prof.events():
            dev_us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
            if str(getattr(e, "device_type", "")).endswith("CUDA") and dev_us:
                per[e.name] += dev_us
                count[e.name] += 1
    except Exception as ex:  # noqa: BLE001 - the row's own timing stands; say why the breakdown is missing
        return {"error": f"{type(ex).__name__}: {ex}"[:300]}
    if not per:
        return {"error": "the profiler recorded no device kernels"}
    ranked = sorted(per.items(), key=lambda kv: -kv[1])
    return {"us_per_token_total": round(sum(per.values()) / n, 2),
            "kernels_per_token": round(sum(count.values()) / n, 1),
            "by_kernel": {k[:120]: {"us_per_token": round(v / n, 2), "launches_per_token": round(count[k] / n, 2)}
                          for k, v in ranked[:top]}}


def device_split(fwd, tok, pos) -> dict:
    """Where a CUDA-graphed forward's ms/token goes, for a forward without a self-feeding step of its own (the
    lowered one): device ms of the forward alone, and of the greedy body (forward, argmax, token and position
    written back), each replayed from one CUDA graph as the tuners time them. Their difference is the greedy
    loop's own kernels; the row's ms/token over the greedy body is what the loop adds on the host."""
    from tkcc.kernels.graph_replay import greedy_body, replay_us

    inner = getattr(fwd, "fn", None)
    if inner is None or getattr(inner, "tkcc_greedy", None) is not None:
        return {}
    pdl = bool(getattr(fwd, "pdl", False))
    try:
        with torch.no_grad():
            ids, p = tok.clone(), pos.clone()
            f_us = replay_us(lambda: inner(ids, p), pdl=pdl)
            g_us = replay_us(lambda: greedy_body(inner, ids, p), pdl=pdl)
    except Exception as e:  # noqa: BLE001 - the row's own timing stands; say why the split is missing
        return {"device_split_error": f"{type(e).__name__}: {e}"[:300]}
    return {"forward_replay_ms": round(f_us / 1e3, 4), "greedy_body_replay_ms": round(g_us / 1e3, 4)}


def objective_rows(rows, model_names):
    """P90 per-user decode tokens/s on two real traces from each variant's measured ms/token curve."""
    from tkcc.traffic.loaders import bundled_trace, load_trace
    from tkcc.traffic.metrics import FunctionTimingModel, serving_metrics

    out = []
    traces = {"azure-conv": "azure-conv", "servegen-m-mid-81 (long context)": "servegen-m-mid-81"}
    for tname, key in traces.items():
        try:
            trace = load_trace(bundled_trace(key))
        except Exception as e:
            log(f"objective: cannot load {key}: {e}")
            continue
        for m in model_names:
            by = {}
            for r in rows:
                if r["model"] == m and r["variant"] != "floor" and r["routing"] in ("router", "real"):
                    by.setdefault((r["variant"], r["routing"]), []).append((r["context"], r["ms_per_token"]))
            for (variant, routing), pts in by.items():
                pts.sort()
                if len(pts) < 2:
                    continue
                xs = np.log([p[0] for p in pts])
                ys = [p[1] / 1e3 for p in pts]
                dec = lambda b, ctx, xs=xs, ys=ys: np.interp(np.log(np.maximum(ctx, 1)), xs, ys)
                tm = FunctionTimingModel(lambda b, ctx: np.zeros_like(ctx, dtype=np.float64), dec)
                met = serving_metrics(trace, tm, max_context=int(max(p[0] for p in pts)))
                out.append(dict(model=m, trace=tname, variant=variant, routing=routing,
                                p90_decode_tokens_per_s=met["p90_decode_tokens_per_s"],
                                contexts_measured=[p[0] for p in pts]))
    return out


def print_table(rows):
    print("\nmodel         ctx    routing  variant          ms/token   floor    %floor  peak GiB")
    for r in rows:
        fl = r.get("floor_ms_per_token") or float("nan")
        pk = "-" if r.get("peak_mem_bytes") is None else f"{r['peak_mem_bytes'] / 2**30:.2f}"  # real routing: not taken
        print(f"{r['model']:<13} {r['context']:>6} {r['routing']:<8} {r['variant']:<15} {r['ms_per_token']:>9.3f} "
              f"{fl:>8.3f} {100 * fl / r['ms_per_token']:>7.1f} {pk:>8}")


def floor_rows(model, name, contexts, floors, weight_bytes):
    return [dict(model=name, context=c, routing="-", variant="floor", ms_per_token=floors[c] or float("nan"),
                 peak_mem_bytes=0, weight_bytes=weight_bytes, kv_bytes=kv_bytes(model, c)) for c in contexts]


def fresh_compile_rows(a, name, contexts, tokens, budget_s, result):
    """The torch.compile rows of ``name``, each context compiled and timed by this script in a fresh process
    (``--compile-only``), within ``budget_s`` (no new process once it is spent); why a context is missing
    goes to notes["compile_errors"]."""
    import tempfile

    rows, t_start = [], time.time()
    for c in contexts:
        left = budget_s - (time.time() - t_start) if budget_s else None
        if rows and left is not None and left <= 0:
            log(f"{name}: compile budget spent; ctx {c} not compiled")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "compile.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-only", "--models", name, "--contexts",
                   str(c), "--compile-mode", a.compile_mode, "--tokens", str(tokens), "--reps", str(a.reps),
                   "--compile-cap-s", str(a.compile_cap_s), "--compile-budget-s", str(a.compile_budget_s),
                   "--out", str(out)]
            env = {k: v for k, v in os.environ.items() if k != "OUT"}  # the child's file is collected here
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                   timeout=max(120.0, left) if left is not None else None)
                got = json.loads(out.read_text())["rows"] if out.exists() else []
            except subprocess.TimeoutExpired:
                p, got = None, []
            new = [dict(r, fresh_process=True) for r in got if r["variant"].startswith("hf_compile")]
            if not new:
                why = "timed out" if p is None else f"rc {p.returncode}: {p.stderr[-400:]}"
                result["notes"].setdefault("compile_errors", {})[f"{name} ctx {c}"] = why
                log(f"{name} ctx {c}: no torch.compile row from the fresh process ({why[:200]})")
            for r in new:
                log(f"{name} hf_compile (fresh process) ctx={c}: {r['ms_per_token']:.3f} ms/token "
                    f"(warm-up {r.get('warmup_s')}s)")
            rows += new
    return rows


def merged_objective(main_files: list[str], compile_files: list[str]) -> dict:
    """The objective rows of the runs in ``main_files`` (a later file's row replaces an earlier one's of the
    same model, variant, routing and context) with their torch.compile rows replaced by those of
    ``compile_files`` (runs that compiled one context each in a fresh process). Replaced rows are kept under
    ``replaced_rows`` so nothing measured disappears; ``ratios`` gives, per model and trace, the best tkcc
    variant's P90 over torch.compile's (``lowered``, or an older run's ``tkcc*`` rows), per routing."""
    is_compile = lambda r: r["variant"].startswith("hf_compile")  # noqa: E731
    key = lambda r: (r["model"], r["variant"], r.get("routing"), r["context"])  # noqa: E731
    rows, replaced = {}, []
    for f in main_files:
        for r in json.loads(Path(f).read_text())["rows"]:
            r = dict(r, source=Path(f).name)
            if key(r) in rows:
                replaced.append(rows[key(r)])
            rows[key(r)] = r
    extra = []
    for f in compile_files:
        d = json.loads(Path(f).read_text())
        extra += [dict(r, source=Path(f).name) for r in d["rows"] if is_compile(r)]
    ckeys = {(r["model"], r["variant"], r["context"]) for r in extra}
    for k in [k for k, r in rows.items() if is_compile(r) and (k[0], k[1], k[3]) in ckeys]:
        replaced.append(rows.pop(k))
    rows = list(rows.values()) + extra
    models = sorted({r["model"] for r in rows})
    obj = objective_rows(rows, models)
    ratios = []
    for m in models:
        for trace in sorted({o["trace"] for o in obj}):
            mine = [o for o in obj if o["model"] == m and o["trace"] == trace and o["p90_decode_tokens_per_s"]]
            comp = [o for o in mine if o["variant"].startswith("hf_compile")]
            for routing in ("router", "real"):
                tk = [o for o in mine if o["variant"].startswith(("tkcc", "lowered")) and o["routing"] == routing]
                if comp and tk:
                    best = max(tk, key=lambda o: o["p90_decode_tokens_per_s"])
                    c = comp[0]["p90_decode_tokens_per_s"]
                    ratios.append(dict(model=m, trace=trace, routing=routing, best_variant=best["variant"],
                                       tkcc_p90=best["p90_decode_tokens_per_s"], compile_p90=c,
                                       ratio=best["p90_decode_tokens_per_s"] / c))
    return dict(main=[Path(f).name for f in main_files], compile_rows_from=[Path(f).name for f in compile_files],
                compile_rows=extra, replaced_rows=replaced, objective=obj, ratios=ratios)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["olmoe-16l", "llama-1b-16l"])
    ap.add_argument("--contexts", nargs="+", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="decode steps per timed run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", action="store_true", help="add HF static cache + torch.compile")
    ap.add_argument("--compile-mode", default="max-autotune")
    ap.add_argument("--compile-cap-s", type=float, default=150.0,
                    help="stop compiling further contexts once one context's warm-up took longer than this")
    ap.add_argument("--compile-contexts", nargs="+", type=int, default=None,
                    help="contexts for the torch.compile variant (each cache size compiles anew); measured "
                         "shortest and longest first")
    ap.add_argument("--compile-budget-s", type=float, default=200.0,
                    help="per model: start no further torch.compile context after this many seconds")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="whole run: torch.compile (run last) shares what is left of this many seconds between "
                         "the models, and is skipped past it (0: no deadline)")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="front-door variants to run: " + ", ".join(FRONT_DOOR) + " (default: "
                         + ", ".join(DEFAULT_VARIANTS) + ")")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--no-greedy", action="store_true",
                    help="skip the greedy check (the lowered step's 32 greedy tokens against the captured graphs' "
                         "and HF eager's, two prompts)")
    ap.add_argument("--kernels", action="store_true",
                    help="front-door variants: device time per token of each kernel their timed loop launches "
                         "(torch.profiler), in the notes (front_door_kernels)")
    ap.add_argument("--checks", action="store_true", help="also run every kernel's bf16 correctness check first")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny models, 2 short contexts, no HF timing")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode.json"))
    ap.add_argument("--compile-only", action="store_true",
                    help="only the torch.compile rows (and the floors): no HF eager, greedy check or front-door rows")
    ap.add_argument("--compile-fresh", action="store_true",
                    help="compile each (model, context) in its own fresh process (this script, --compile-only): "
                         "in one process a later context's recompile need not match a fresh compile")
    ap.add_argument("--objective-from", nargs="+", default=None,
                    help="recompute the objective of these result files (no GPU; a later file's row replaces an "
                         "earlier one's for the same model, variant, routing and context)")
    ap.add_argument("--compile-rows-from", nargs="*", default=[],
                    help="with --objective-from: result files whose torch.compile rows replace the first file's")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.variants or ()) - set(FRONT_DOOR))
    if unknown:
        ap.error(f"--variants: unknown {unknown} (the variants are {list(FRONT_DOOR)})")
    if a.objective_from:
        res = merged_objective(a.objective_from, a.compile_rows_from)
        out = Path(a.objective_from[0]).with_name("decode_objective.json")
        out.write_text(json.dumps(res, indent=1))
        for o in res["objective"]:
            p90 = o["p90_decode_tokens_per_s"]
            print(f"{o['model']:<13} {o['trace']:<34} {o['variant']}/{o['routing']}: "
                  + (f"{p90:.0f} tok/s" if p90 is not None else "-"))
        for r in res["ratios"]:
            print(f"{r['model']:<13} {r['trace']:<34} best {r['best_variant']}/{r['routing']}: "
                  f"{r['tkcc_p90']:.0f} / compile {r['compile_p90']:.0f} tok/s = {r['ratio']:.2f}x")
        return res
    if a.compile_only or a.compile_fresh:
        a.compile = True
    if a.smoke:
        a.models = [m for m in a.models if m.endswith("tiny")] or ["llama-tiny"]
        a.contexts = a.contexts or [4, 12]
        a.tokens = a.tokens or 1
        a.reps = 1
        a.no_eager = True
    contexts = a.contexts or ([128, 8192] if a.quick else [128, 2048, 8192, 32768])
    tokens = a.tokens or (16 if a.quick else 32)
    dtype = torch.bfloat16 if CUDA else torch.float32
    dev = "cuda" if CUDA else "cpu"
    import transformers
    import triton

    meta = dict(device=torch.cuda.get_device_name() if CUDA else platform.processor() or "cpu",
                torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                commit=commit(), command=" ".join([os.path.basename(sys.executable), *sys.argv]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                dtype=str(dtype).replace("torch.", ""), batch=1, phase="decode", tokens_per_run=tokens, reps=a.reps)
    result = dict(meta=meta, rows=[], objective=[], checks=None, greedy={}, notes={})
    out_paths = [Path(a.out)] + ([Path(os.environ["OUT"]) / "decode.json"] if os.environ.get("OUT") else [])

    def save():
        for p in out_paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(result, indent=1, default=str))

    if CUDA:
        meta["copy_bandwidth_GBps"] = copy_bandwidth() / 1e9
        log(f"copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s")
    if a.checks:
        from tkcc.kernels.checks import run_checks

        t0 = time.time()
        chk = run_checks(dev, dtype if CUDA else torch.float32)
        if CUDA and torch.cuda.get_device_capability()[0] >= 9:
            chk += run_checks(dev, dtype, pdl=True)
        result["checks"] = dict(n=len(chk), failed=[r for r in chk if not r["ok"]],
                                worst={r["kernel"]: max(x["rel_err"] for x in chk if x["kernel"] == r["kernel"])
                                       for r in chk}, seconds=round(time.time() - t0, 1))
        log(f"kernel checks: {len(chk)} cases, {len(result['checks']['failed'])} failed")
        save()
    models, floors = {}, {}

    def finish(rows, name):
        for r in rows:
            r["floor_ms_per_token"] = floors[name].get(r["context"])
            r.update(device=meta["device"], dtype=meta["dtype"], batch=1, phase="decode", family=get_spec(name).family)

    def objective():
        try:
            result["objective"] = objective_rows(result["rows"], a.models)
        except Exception as e:  # the timing rows stand on their own; say why the objective is missing
            result["notes"]["objective_error"] = f"{type(e).__name__}: {e}"
        save()

    # phase 1, every model: HF eager, greedy check, every front-door variant, floors (saved after each model)
    for name in a.models:
        spec = get_spec(name)
        mpe = max(spec.config.get("max_position_embeddings", 4096), max(contexts) + tokens + 64)
        t0 = time.time()
        model = build_model(name, dtype, dev, max_position_embeddings=mpe)
        pack_projections(model)  # as tkcc's capture does, before any graph holds a weight pointer
        log(f"built {name} in {time.time() - t0:.1f}s")
        wb = weight_bytes_per_token(model)
        bw = meta.get("copy_bandwidth_GBps", 0) * 1e9
        floors[name] = {c: (wb + kv_bytes(model, c)) / bw * 1e3 if bw else None for c in contexts}
        rows = []
        if a.compile_only:
            rows = floor_rows(model, name, contexts, floors[name], wb)
            finish(rows, name)
            result["rows"] += rows
            models[name] = model
            continue
        if not a.no_eager:
            try:
                rows += hf_rows(model, name, contexts, tokens if CUDA else 2, a.reps, "hf_eager", model.forward)
            except Exception as e:  # noqa: BLE001 - a family whose own cache is no StaticCache (MiniMax)
                result["notes"].setdefault("hf_eager_failed", {})[name] = f"{type(e).__name__}: {e}"[:400]
                log(f"{name}: hf_eager not timed: {type(e).__name__}: {e}")
        prompts = [[int(x) for x in torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator()
                                                   .manual_seed(n))] for n in ((3,) if a.smoke else (16, 40))]
        if "lowered" in (a.variants or DEFAULT_VARIANTS) and not a.no_greedy:
            try:
                result["greedy"][name] = greedy_check(model, prompts, 2 if a.smoke else 32, fp32_reference=CUDA)
            except Exception as e:  # noqa: BLE001 - the timing rows stand; say why the check is missing
                result["notes"].setdefault("greedy_errors", {})[name] = f"{type(e).__name__}: {e}"[:400]
                log(f"{name}: greedy check failed: {type(e).__name__}: {e}")
        for g in result["greedy"].get(name, []):
            err = lambda e: "-" if e is None else f"{e:.4f}"  # noqa: E731 - no decode step before a divergence
            log(f"{name} greedy, prompt {g['prompt_len']}: " + "; ".join(
                f"{k}: same={v['identical']} first_diff={v['first_divergence']} logits_err={err(v['logits_rel_err'])}"
                for k, v in g.items() if isinstance(v, dict)))

        def partial(r2, fd_notes, rows=rows, name=name):
            """Save what is measured so far (a device fault in a later variant cannot lose it)."""
            result["notes"][name] = {"front_door": fd_notes}
            result["partial_rows"] = rows + r2
            save()

        r2, fd_notes = frontdoor_rows(model, name, contexts, tokens, a.reps, a.variants, spec.family,
                                      on_rows=partial, kernels=a.kernels)
        result.pop("partial_rows", None)
        rows += r2
        result["notes"][name] = {"front_door": fd_notes}
        rows.sort(key=lambda r: (r["variant"], r["routing"], r["context"]))
        rows += floor_rows(model, name, contexts, floors[name], wb)
        finish(rows, name)
        result["rows"] += rows
        save()
        models[name] = model
        peak_reset()
    objective()
    # phase 2: HF static cache + torch.compile, last (minutes of compiling), within the deadline if one is set
    if a.compile:
        for i, name in enumerate(a.models):
            budget = a.compile_budget_s
            if a.deadline_s:
                left = a.deadline_s - (time.time() - T_START)
                budget = min(budget, left / (len(a.models) - i))
                if left <= 0:
                    result["notes"].setdefault("compile_skipped", {})[name] = "past --deadline-s"
                    log(f"{name}: past --deadline-s; torch.compile not run")
                    continue
            model = models[name]
            t0 = time.time()
            rows = []
            if a.compile_fresh:
                rows = fresh_compile_rows(a, name, ends_first(a.compile_contexts or contexts), tokens, budget, result)
                result["notes"].setdefault("compile_s", {})[name] = round(time.time() - t0, 1)
                rows.sort(key=lambda r: r["context"])
                result["rows"] += rows
                save()
                continue
            try:
                cf = torch.compile(model.forward, mode=a.compile_mode, fullgraph=True)
                rows = hf_rows(model, name, ends_first(a.compile_contexts or contexts), tokens if CUDA else 2, a.reps,
                               f"hf_compile[{a.compile_mode}]", cf, compile_cap_s=a.compile_cap_s, budget_s=budget)
            except Exception as e:  # the other variants stand; say why this one is missing
                result["notes"].setdefault("compile_errors", {})[name] = f"{type(e).__name__}: {e}"
                log(f"{name} torch.compile failed: {type(e).__name__}: {e}")
            result["notes"].setdefault("compile_s", {})[name] = round(time.time() - t0, 1)
            cf = None
            torch._dynamo.reset()
            rows.sort(key=lambda r: r["context"])
            finish(rows, name)
            result["rows"] += rows
            save()
            peak_reset()
        objective()
    del models
    print_table(result["rows"])
    for o in result["objective"]:
        p90 = o["p90_decode_tokens_per_s"]
        print(f"objective {o['model']} {o['trace']} {o['variant']}/{o['routing']}: "
              + (f"P90 decode {p90:.0f} tok/s" if p90 is not None else "no requests fit the contexts measured"))
    return result


if __name__ == "__main__":
    main()
