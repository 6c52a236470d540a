"""CLI: ``tkcc compile``, ``tkcc golden record|check``, ``tkcc passes list|show``.

Each handler returns a JSON-able dict (printed whole with ``--json``) with a
``text`` field for people. Outputs are written to a temporary sibling
directory and renamed into place when everything succeeded, so a failed run
never leaves a directory that looks like a valid result.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from tkcc.atomic import replace_dir
from tkcc.errors import PlanError, TkccError


def _add_json(p: argparse.ArgumentParser) -> None:
    from tkcc.cli import add_json_flag

    add_json_flag(p)


def _add_pass_module(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pass-module", action="append", default=[], metavar="PATH",
                   help="a Python file (or module) defining @register-ed passes; repeatable")


def _load_pass_modules(paths) -> list[str]:
    from tkcc.passes.manager import load_pass_module

    names = []
    for p in paths or []:
        names += load_pass_module(p)
    return names


def _dtype(name: str):
    import torch

    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise TkccError(f"--dtype {name!r}: not a torch dtype (use float32, float16 or bfloat16)")
    return d


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TkccError(f"--device {device}: no CUDA device is available here")


# ---- compile -----------------------------------------------------------------------------------

def cmd_compile(args) -> dict:
    import torch

    import tkcc
    from tkcc.compiler import parse_budget
    from tkcc.frontend.models import DEFAULT_MODEL
    from tkcc.frontend.user_models import build_user_model, kind_of

    model_name = args.model or DEFAULT_MODEL
    kind_of(model_name)  # a model argument that names nothing fails before any work
    _check_device(args.device)
    _load_pass_modules(args.pass_module)
    from tkcc.compiler import resolve_plan, resolve_trace
    from tkcc.passes.manager import resolve_plan as check_plan

    plan = None
    if args.plan is not None:
        plan = resolve_plan(args.plan, args.mode)
        check_plan(plan)  # fail on a bad plan before any output or capture
    budget = parse_budget(args.budget) if args.budget is not None else None
    trace = resolve_trace(args.trace)  # fail on a bad trace before any output
    dest = Path(args.out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    os.chmod(tmp, 0o755)
    try:
        model = build_user_model(model_name, dtype=_dtype(args.dtype), device=args.device)
        with torch.no_grad():
            compiled = tkcc.compile(model, trace, plan=plan, mode=args.mode, measure=not args.no_measure,
                                    out_dir=tmp / "work", max_buckets=args.max_buckets, budget=budget,
                                    progress=not args.json)
        compiled.save(tmp / "model")
        work = tmp / "work"
        for keep in ("logs", "experiments.db"):
            if (work / keep).exists():
                os.rename(work / keep, tmp / keep)
        shutil.rmtree(work, ignore_errors=True)  # the engine's candidate builds; the winner is in model/
        report = compiled.report(print_report=False)
        report.artifact = str(tmp / "model" / "artifact") if compiled.artifact is not None else None
        data = report.to_json()
        data["trace"] = args.trace or "azure-conv"
        art = Path(report.artifact) if report.artifact else None
        (tmp / "plan.json").write_text(json.dumps(report.plan, indent=2) + "\n")
        if art is not None:
            data["artifact"] = str(dest / art.relative_to(tmp))
        data["logs"] = str(dest / "logs")
        data["out"] = str(dest)
        (tmp / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    text = report.text().replace(str(tmp), str(dest))
    text += (f"\nwrote {dest}/ (report.json, plan.json, logs/, model/); load the winner with "
             f"tkcc.load('{dest}/model', model); see the pass logs with: tkcc passes show {dest}/logs")
    g = report.golden
    data["ok"] = bool(g.get("ok") if isinstance(g, dict) else g.ok) if g is not None else True
    data["text"] = text
    return data


# ---- golden ------------------------------------------------------------------------------------

def _check_model(name: str) -> None:
    """A built-in model name, before anything is loaded or suggested (golden records exist only for those)."""
    from tkcc.cli import builtin_models

    names, _ = builtin_models()
    if name not in names:
        raise TkccError(f"--model {name!r}: not a built-in model; built-in models: {', '.join(sorted(names))}")


def cmd_golden_record(args) -> dict:
    from tkcc.runtime import golden

    _check_model(args.model)
    _check_device(args.device)
    before = _recorded_at(golden.golden_path(args.model, args.dtype, args.device, args.root))
    path = golden.record(args.model, args.dtype, args.device, steps=args.steps, root=args.root)
    meta = json.loads((path / "meta.json").read_text())
    unchanged = before is not None and before == meta.get("recorded_at")
    cve = meta.get("capture_vs_eager", {})
    size = sum(f.stat().st_size for f in path.iterdir())
    text = (("unchanged: the record already holds these outputs (files left as they were)\n" if unchanged else "")
            + f"recorded golden outputs of {args.model} ({args.device}, {args.dtype}): {len(meta['seeds'])} prompts, "
            f"{meta['steps']} decode steps, {size / 1024:.1f} KiB at {path}\n"
            f"  reference: {meta['reference']}\n"
            f"  captured graph vs the model's own eager forward: "
            + ("bit-exact" if cve.get("exact") else f"max abs err {cve.get('max_abs_err')} "
               f"(first difference {cve.get('first_diff')})"))
    return {"ok": True, "path": str(path), "meta": meta, "bytes": size, "unchanged": unchanged, "text": text}


def _recorded_at(path: Path) -> str | None:
    try:
        return json.loads((path / "meta.json").read_text()).get("recorded_at")
    except (OSError, ValueError):
        return None


def cmd_golden_check(args) -> dict:
    from tkcc.runtime import golden

    _check_model(args.model)
    _check_device(args.device)
    _load_pass_modules(args.pass_module)
    from tkcc.compiler import capture
    from tkcc.frontend.models import build_model
    from tkcc.passes.manager import PassManager, resolve_plan
    from tkcc.passes.plan import PassPlan

    g = golden.load(args.model, args.dtype, args.device, root=args.root)  # fail early if missing
    program = capture(build_model(args.model, dtype=_dtype(args.dtype), device=args.device))
    plan = None
    if args.plan:
        from tkcc.compiler import resolve_plan as parse_plan

        plan = parse_plan(args.plan, args.mode)
        resolve_plan(plan)
        from tkcc.pipeline import pass_context

        program, _ = PassManager(check_numerics=False, context=pass_context()).run(program, plan)
    rep = golden.check(program, mode=args.mode, rtol=args.rtol, atol=args.atol, golden=g)
    out = {"ok": rep.ok, "report": rep.to_json(), "plan": plan.to_json() if plan else None}
    text = rep.summary()
    if plan is not None and not rep.ok and len(plan):
        fresh = capture(build_model(args.model, dtype=_dtype(args.dtype), device=args.device))
        b = golden.bisect(fresh, plan, g, mode=args.mode, rtol=args.rtol, atol=args.atol)
        out["bisect"] = b.to_json()
        text += "\n" + b.summary().splitlines()[0]
    elif plan is not None:
        text += f"\nplan {PassPlan.hash(plan)} ({len(plan)} passes) keeps the golden verdict"
    out["text"] = text
    return out


# ---- passes ------------------------------------------------------------------------------------

def cmd_passes_list(args) -> dict:
    from tkcc.passes.base import all_passes

    user = set(_load_pass_modules(args.pass_module))
    rows = []
    for name, cls in all_passes().items():
        rows.append({"name": name, "version": cls.version, "exact": cls.exact, "params": cls.params,
                     "description": cls.description or (cls.__doc__ or "").strip().splitlines()[0]
                     if (cls.description or cls.__doc__) else "", "module": cls.__module__,
                     "user": name in user})
    lines = [f"{len(rows)} registered passes:"]
    for r in rows:
        params = "; ".join(f"{k} in {v}" for k, v in r["params"].items()) or "no params"
        lines.append(f"  {r['name']:<24} v{r['version']:<3} {'exact' if r['exact'] else 'tolerance':<9} "
                     f"{r['description']}")
        lines.append(f"  {'':<24} params: {params}")
    return {"ok": True, "passes": rows, "text": "\n".join(lines)}


def cmd_passes_show(args) -> dict:
    from tkcc.passes.base import all_passes
    from tkcc.passes.log import format_logs, read_logs

    target = Path(args.target)
    if target.is_dir() and not any(target.glob("[0-9][0-9]-*.json")) and (target / "logs").is_dir():
        target = target / "logs"  # a compile output directory
    if target.is_dir():
        logs = read_logs(target)
        if args.pass_name:
            logs = [lg for lg in logs if lg.name == args.pass_name or lg.stem == args.pass_name]
            if not logs:
                raise TkccError(f"{target}: no log of a pass named {args.pass_name!r}")
        lines = [f"pass logs in {target}:", format_logs(logs)]
        for lg in logs:
            for ph, p in lg.phases.items():
                prov = [f"{k} <- {', '.join(v) or '?'}" for k, v in list(p.provenance.items())[:args.max_nodes]]
                lines.append(f"{lg.stem} [{ph}] nodes {p.nodes_before} -> {p.nodes_after}, "
                             f"+{len(p.added)} -{len(p.removed)}, numerics {p.check}")
                if p.removed:
                    lines.append("    removed: " + ", ".join(p.removed[:args.max_nodes])
                                 + (" ..." if len(p.removed) > args.max_nodes else ""))
                if prov:
                    lines.append("    added: " + "; ".join(prov) + (" ..." if len(p.added) > args.max_nodes else ""))
            for n in lg.notes:
                lines.append(f"    note: {n}")
        if args.code:
            for lg in logs:
                for ph, p in lg.phases.items():
                    lines += [f"--- {lg.stem} [{ph}] after ---", p.code_after]
        return {"ok": True, "dir": str(target), "logs": [lg.to_json(with_code=args.code) for lg in logs],
                "text": "\n".join(lines)}
    passes = all_passes()
    if args.target in passes:
        cls = passes[args.target]
        doc = (cls.__doc__ or "").strip()
        info = {"name": cls.name, "version": cls.version, "exact": cls.exact, "params": cls.params,
                "defaults": cls.defaults(), "description": cls.description, "doc": doc, "module": cls.__module__}
        text = (f"{cls.name} v{cls.version} ({'exact' if cls.exact else 'tolerance'}) from {cls.__module__}\n"
                f"params: {json.dumps(cls.params)}\ndefaults: {json.dumps(cls.defaults())}\n\n{doc}")
        return {"ok": True, "pass": info, "text": text}
    raise TkccError(f"{args.target!r} is neither a pass-log directory nor a registered pass; "
                    f"registered: {', '.join(passes)}")


# ---- registration ------------------------------------------------------------------------------

_MODE_HELP = ("exact (default): every pass bit-exact, outputs checked bitwise; tolerance: passes may change "
              "rounding, outputs checked within the dtype's tolerance with identical greedy tokens")
_DEVICE_HELP = "cpu (default), cuda or cuda:N"
_DTYPE_HELP = "float32 (default), float16 or bfloat16"

def register(subparsers) -> None:
    from tkcc.cli import builtin_models

    names, DEFAULT_MODEL = builtin_models()  # noqa: N806 - the registry's constant, read without torch
    models = ", ".join(sorted(names))
    p = subparsers.add_parser("compile", help="capture, rewrite, generate and check a model; measure it on a trace",
                              description="Compile a built-in model for the traffic in a trace: capture, apply the "
                                          "plan (checked after every pass), generate the artifact, check it against "
                                          "eager on fresh inputs, measure the speedup on shapes from the trace. "
                                          f"Writes report.json, plan.json, logs/ and artifact/ under --out. "
                                          f"Models: {models}.")
    p.add_argument("--model", default=None, help=f"a built-in model, a local Hugging Face directory "
                                                 f"(config + weights) or module:factory (default: {DEFAULT_MODEL})")
    p.add_argument("--trace", default=None, help="trace file or bundled trace name (default: azure-conv)")
    p.add_argument("--plan", default=None, help="measure this pass plan (JSON text or file) beside the references "
                                                "instead of searching")
    from tkcc.defaults import DEFAULT_BUDGET_S

    p.add_argument("--budget", default=None, help=f"wall-clock bound on the whole compile, e.g. 90s or 3m (default: "
                                                  f"{DEFAULT_BUDGET_S['cuda']:.0f}s on a GPU, "
                                                  f"{DEFAULT_BUDGET_S['cpu']:.0f}s on CPU; 0: measure the references "
                                                  "only)")
    p.add_argument("--mode", default="exact", choices=["exact", "tolerance"], help=_MODE_HELP)
    p.add_argument("--out", default="tkcc-out", help="output directory (default: tkcc-out)")
    p.add_argument("--device", default="cpu", help=_DEVICE_HELP)
    p.add_argument("--dtype", default="float32", help=_DTYPE_HELP)
    p.add_argument("--no-measure", action="store_true", help="build the plan (or the default plan) without the loop")
    p.add_argument("--max-buckets", type=int, default=None,
                   help="heaviest workload buckets to measure (default: 4 on CPU, 6 on GPU)")
    _add_pass_module(p)
    _add_json(p)
    p.set_defaults(func=cmd_compile)

    g = subparsers.add_parser("golden", help="record or check golden outputs of a built-in model",
                              description="Golden outputs: logits of deterministic prompts (prefill and greedy "
                                          "decode steps) and greedy tokens, under golden/<model>/<device>-<dtype>/.")
    gs = g.add_subparsers(dest="golden_command", metavar="{record,check}")
    for name, fn, help_ in (("record", cmd_golden_record, "record golden outputs"),
                            ("check", cmd_golden_check, "check the captured graphs (after --plan) against golden")):
        q = gs.add_parser(name, help=help_, description=help_)
        q.add_argument("--model", default=DEFAULT_MODEL, help=f"built-in model (default: {DEFAULT_MODEL})")
        q.add_argument("--device", default="cpu", help=_DEVICE_HELP)
        q.add_argument("--dtype", default="float32", help=_DTYPE_HELP)
        q.add_argument("--root", default=None, help="golden directory (default: the repository's golden/)")
        if name == "record":
            q.add_argument("--steps", type=int, default=6, help="greedy decode steps (default: 6)")
        else:
            q.add_argument("--mode", default="exact", choices=["exact", "tolerance"], help=_MODE_HELP)
            q.add_argument("--rtol", type=float, default=None, help="tolerance mode: relative tolerance "
                           "(default: the dtype's)")
            q.add_argument("--atol", type=float, default=None, help="tolerance mode: absolute tolerance "
                           "(default: the dtype's)")
            q.add_argument("--plan", default=None, help="apply this plan first; on failure, bisect it")
            _add_pass_module(q)
        _add_json(q)
        q.set_defaults(func=fn)
    g.set_defaults(func=lambda a: _missing(g, "golden"))

    ps = subparsers.add_parser("passes", help="list registered passes; show a pass or the pass logs of a compile",
                               description="List registered passes, or show one pass, or the logs of a compile.")
    pss = ps.add_subparsers(dest="passes_command", metavar="{list,show}")
    q = pss.add_parser("list", help="list registered passes (name, version, exactness, params)")
    _add_pass_module(q)
    _add_json(q)
    q.set_defaults(func=cmd_passes_list)
    q = pss.add_parser("show", help="show a pass-log directory (e.g. tkcc-out/logs) or a registered pass")
    q.add_argument("target", help="log directory (or compile --out directory) or pass name")
    q.add_argument("--pass", dest="pass_name", default=None, help="only this pass's log (name or NN-name)")
    q.add_argument("--code", action="store_true", help="print each phase's code after the pass")
    q.add_argument("--max-nodes", type=int, default=8, help="nodes listed per pass and phase (default: 8)")
    _add_pass_module(q)
    _add_json(q)
    q.set_defaults(func=_show_with_modules)
    ps.set_defaults(func=lambda a: _missing(ps, "passes"))


def _show_with_modules(args) -> dict:
    _load_pass_modules(args.pass_module)
    return cmd_passes_show(args)


def _missing(parser, name) -> int:
    parser.print_help()
    return 1


__all__ = ["register", "PlanError"]
