"""How far each causal LM family of transformers lowers: issue 18's check runs families it does not name.

    python benchmarks/families.py                          # every family in transformers' causal-LM auto mapping
    python benchmarks/families.py --types llama gpt2 falcon

Each family is built from its own config made tiny (2 layers, or one of each kind of a hybrid's layers; 64 wide,
vocab 256; random weights, fp32, CPU), in a
fresh process with a memory cap and a time limit, then:
- its decode step is captured (``tkcc.frontend.capture``); a refusal is tkcc's ``CaptureError``, which names tkcc's
  frame and the reason;
- ``lowered_decode`` runs on it; the row holds the kernel ops by kind and the aten ops left (views aside);
- the lowered step is compared with the captured one off the kernels (the ops' references), bit for bit, at three
  positions from random caches (``tests/decode/lowered_families.same_decode``).

Outcome per row: ``config`` / ``build`` (transformers rejects the tiny config or cannot build the model: not a tkcc
result), ``refused`` (a CaptureError), ``lowered`` (with ``ops``, ``left`` and ``inexact``: None, or how the lowered
step differs), ``crash`` (any other exception in capture or lowering: a tkcc defect), ``timeout``/``died``.
On a CPU transformers keeps its own MoE experts implementation (a per-expert loop), so MoE blocks stay in aten here;
on a GPU in bf16 capture takes ``batched_mm``, which the MoE rewrites match (``tkcc.frontend.hf.experts_for_phase``).
Raw rows go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "decode"))  # lowered_families: op_counts, same_decode

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=256, head_dim=16, moe_intermediate_size=32, num_experts=4,
            num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def layer_kinds(model_type: str) -> dict:
    """A hybrid family (its default ``layer_types`` name several kinds: linear attention and attention, sliding and
    full) gets one tiny layer of each kind, in the order they first appear; the first two layers of its default
    pattern could all be of one kind (Qwen3-Next's first attention layer is its fourth)."""
    from transformers import AutoConfig

    try:
        kinds = list(dict.fromkeys(getattr(AutoConfig.for_model(model_type), "layer_types", None) or []))
    except Exception:  # noqa: BLE001 - a config that cannot be built at its defaults: the plain tiny one
        return {}
    if len(kinds) < 2 or not all(isinstance(k, str) for k in kinds):
        return {}
    return dict(num_hidden_layers=len(kinds), layer_types=kinds)


def one(model_type: str) -> dict:
    """The row of one family (run in its own process)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from lowered_families import op_counts, same_decode
    from tkcc.errors import CaptureError
    from tkcc.frontend.capture import capture
    from tkcc.passes.manager import apply_plan

    row = {"type": model_type, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}
    stage = "config"
    try:
        cfg = None
        for tiny in (dict(TINY, **layer_kinds(model_type)), TINY):  # (a config that derives its layer kinds itself)
            for kw in (tiny, {k: v for k, v in tiny.items() if k != "head_dim"}):  # (... or head_dim: Falcon)
                try:
                    cfg = AutoConfig.for_model(model_type, **kw)
                    break
                except (AttributeError, TypeError, ValueError):
                    continue
            if cfg is not None:
                break
        if cfg is None:
            cfg = AutoConfig.for_model(model_type, **TINY)  # its own error, as the row's
        if getattr(cfg, "qk_rope_head_dim", None):  # MLA: its head_dim is the rotary part's, a kv head per head
            cfg.head_dim, cfg.num_key_value_heads = cfg.qk_rope_head_dim, cfg.num_attention_heads
        if getattr(cfg, "rotary_dim", None):  # GPT-J, CodeGen: rotate a part of the tiny head
            cfg.rotary_dim = 8
        if getattr(cfg, "n_group", None):  # grouped routing (DeepSeek): groups of the tiny expert count
            cfg.n_group, cfg.topk_group = 2, 1
        stage = "build"
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        try:
            model = AutoModelForCausalLM.from_config(cfg).eval()
        except ValueError:  # no sdpa for this family: its eager attention
            cfg._attn_implementation = "eager"
            model = AutoModelForCausalLM.from_config(cfg).eval()
            row["attention"] = "eager"
        with torch.no_grad():  # a weight matrix transformers leaves all zeros would make the comparison vacuous
            for p in model.parameters():
                if p.dim() >= 2 and not p.any():
                    p.normal_(0.0, p.shape[-1] ** -0.5)
        stage = "capture"
        prog = capture(model, phases=["decode"], max_cache_len=32)
        stage = "lower"
        new, logs = apply_plan(prog, [{"name": "lowered_decode"}], mode="tolerance")
        ops, left = op_counts(new.graphs["decode"])
        stage = "compare"
        row.update(outcome="lowered", ops=ops, left=sorted(left), inexact=same_decode(prog, new.graphs["decode"]))
    except CaptureError as e:
        row.update(outcome="refused", why=str(e)[:600])
    except Exception as e:  # noqa: BLE001 - every failure is a row
        row.update(outcome=stage if stage in ("config", "build") else "crash", stage=stage,
                   why=f"{type(e).__name__}: {str(e)[:400]}",
                   where=[f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__)[-4:]])
    return row


def _cap(gib: float):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (int(gib * 2 ** 30),) * 2)
    return limit


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", nargs="*", help="model types (default: every causal LM transformers maps)")
    ap.add_argument("--timeout-s", type=float, default=150.0)
    ap.add_argument("--mem-gib", type=float, default=8.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "families_cpu.json"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.one:
        print(json.dumps(one(args.one), default=str), flush=True)
        return
    rows = []
    for t in args.types or all_types():
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--one", t], capture_output=True, text=True,
                               timeout=args.timeout_s, preexec_fn=_cap(args.mem_gib))
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"type": t, "outcome": "died", "why": p.stderr[-400:]}
        except subprocess.TimeoutExpired:
            row = {"type": t, "outcome": "timeout"}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"{t:28s} {row['outcome']:8s} {json.dumps(row.get('ops', row.get('why', '')))[:150]}", flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))
    counts = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    inexact = [r["type"] for r in rows if r.get("inexact")]
    print(f"{len(rows)} families: {counts}; inexact off the kernels: {inexact or 'none'}; raw rows: {args.out}")


if __name__ == "__main__":
    main()
