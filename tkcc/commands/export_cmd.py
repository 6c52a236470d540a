"""CLI: ``tkcc export CAMPAIGN --store S --out DIR``: a campaign's shipped candidate, saved for ``tkcc.load``.

What ships is written the way ``compiled.save`` writes it (``tkcc.json`` beside the artifact), so the same
``tkcc.load(DIR, model)`` loads a compile's winner and a campaign's. The artifact the campaign's engine
measured is used when the store kept it whole (``<store>.artifacts/<hash>/artifact``, checked file by file
against its manifest); otherwise the shipped plan is built again through the one build pipeline, and the
report says which.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tkcc.errors import TkccError


def register(sub) -> None:
    from tkcc.cli import add_json_flag

    p = sub.add_parser("export", help="save a campaign's shipped candidate for tkcc.load",
                       description="Write the candidate a campaign ships (its last ship or revert) as a saved "
                                   "model: tkcc.json and the artifact, loadable with tkcc.load(DIR, model).")
    p.add_argument("campaign", help="campaign name or id")
    p.add_argument("--store", default="tkcc-campaigns.db", help="experiment store (default tkcc-campaigns.db)")
    p.add_argument("--out", required=True, help="directory to write (new or empty)")
    p.add_argument("--model", default=None, help="the campaign's model (default: the one it recorded): a "
                                                 "built-in name, a local Hugging Face directory or module:factory")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: the campaign's)")
    p.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: float32 on CPU, "
                                                 "bfloat16 on a GPU)")
    add_json_flag(p)
    p.set_defaults(func=cmd_export)


def shipped(store, campaign: dict) -> tuple[str, list]:
    """(candidate key, plan) of what the campaign serves: its last ship or revert."""
    rows = [s for s in store.ships(campaign["id"]) if s["action"] in ("ship", "revert")]
    if not rows:
        raise TkccError(f"campaign {campaign['name']!r} in {store.path} has shipped nothing yet")
    return rows[-1]["candidate"], rows[-1]["plan"]


def cmd_export(args) -> dict:
    import os

    import torch

    from tkcc.agents.store import ExperimentStore
    from tkcc.compiled import CompileReport, CompiledModel, load_settings, output_type_of
    from tkcc.frontend import capture
    from tkcc.frontend.user_models import build_user_model
    from tkcc.passes.plan import PassPlan

    if not os.path.isfile(args.store):
        raise TkccError(f"no experiment store at {args.store}")
    store = ExperimentStore(args.store)
    camp = store.campaign(int(args.campaign) if str(args.campaign).isdigit() else args.campaign)
    key, plan_json = shipped(store, camp)
    if key == "eager":
        raise TkccError(f"campaign {camp['name']!r} serves the model's own eager forward: there is no artifact "
                        "to export (tkcc.compile's result saves it as such)")
    cfg = camp["config"]
    device = args.device or cfg.get("device") or "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if str(device).startswith("cuda") else "float32"))
    model = build_user_model(args.model or camp["model"], dtype=dtype, device=device)
    program = capture(model)
    plan = PassPlan.from_json(plan_json)
    tmp = Path(tempfile.mkdtemp(prefix="tkcc-export-"))
    try:
        artifact, how = _kept(store, camp, key, program, args.store), "the artifact the campaign measured"
        if artifact is None:
            from tkcc.pipeline import build

            artifact = build(program, plan, tmp / "artifact", check_numerics=False).artifact
            how = "rebuilt from the shipped plan (the store kept no whole artifact of it)"
        forwards = dict(artifact.load(program))
        info = {k: program.meta.get(k) for k in ("name", "family", "dtype", "device", "max_cache_len", "batch")}
        report = CompileReport(model=str(program.meta.get("name")), plan=plan.to_json(), plan_hash=plan.hash(),
                               mode=str(cfg.get("mode", "")), logs=[], golden=None, speed=None,
                               artifact=str(artifact.path), timings={}, program=info,
                               loop={"campaign": camp["name"], "store": str(store.path), "serving": key, "why": how})
        settings = load_settings(program)
        compiled = CompiledModel(program, forwards, report, artifact, settings=settings,
                                 output_type=output_type_of(program))
        out = compiled.save(args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = f"exported {key} of campaign {camp['name']} ({how}) to {out}; load it with tkcc.load('{out}', model)"
    return {"campaign": camp["name"], "candidate": key, "plan": plan.to_json(), "out": str(out), "source": how,
            "text": text}


def _kept(store, camp: dict, key: str, program, store_path: str):
    """The slow-tier artifact a campaign's evaluator kept for ``key``, if it is whole and for this model."""
    from tkcc.codegen.artifact import Artifact

    keep = Path(store_path).with_name(Path(store_path).name + ".artifacts")
    for e in reversed(store.experiments(camp["id"], tier="slow")):
        if e.candidate != key or not e.artifact_hash:
            continue
        d = keep / e.artifact_hash / "artifact"
        try:
            art = Artifact.open(d)
        except TkccError:
            continue
        if art.manifest.get("fingerprint") == program.fingerprint:
            return art
    return None

