"""`tkcc report CAMPAIGN`: one HTML page with the campaign's plots, ship history and experiments."""
from __future__ import annotations

import base64
import io
import json
import time
from collections import Counter
from pathlib import Path

from tkcc.agents.store import ExperimentStore


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _plots(exps, ships, buckets) -> dict[str, str | None]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min((e.started for e in exps), default=0.0)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for tier, marker in (("fast", "o"), ("slow", "s")):
        pts = [(e.finished - t0, e.objective) for e in exps if e.tier == tier and e.objective is not None]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, s=18, label=f"{tier} tier", alpha=0.7)
    ship_pts = [(s["time"] - t0, s["objective"]) for s in ships if s["objective"] is not None]
    if ship_pts:
        ax.step(*zip(*ship_pts), where="post", color="k", label="serving")
    ax.set_xlabel("seconds since campaign start")
    ax.set_ylabel("objective")
    ax.legend(loc="lower right", fontsize=8)
    out = {"objective": _png(fig)}

    fig, ax = plt.subplots(figsize=(6, 2.6))
    counts = Counter((e.tier, e.verdict) for e in exps)
    tiers = sorted({t for t, _ in counts})
    verdicts = sorted({v for _, v in counts})
    bottom = [0] * len(tiers)
    for v in verdicts:
        vals = [counts.get((t, v), 0) for t in tiers]
        ax.bar(tiers, vals, bottom=bottom, label=v)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.set_ylabel("experiments")
    ax.legend(fontsize=8)
    out["tiers"] = _png(fig)

    out["traffic"] = None
    if buckets:
        fig, ax = plt.subplots(figsize=(9, 2.6))
        labels = [f"{b.get('phase', '?')[0]} b{b.get('batch')} c{b.get('context')}" for b in buckets]
        ax.bar(range(len(buckets)), [b.get("weight", 0) for b in buckets])
        ax.set_xticks(range(len(buckets)), labels, rotation=60, fontsize=7, ha="right")
        ax.set_ylabel("weight")
        out["traffic"] = _png(fig)
    return out


def write_report(store_path: str | Path, campaign: str | int, out: str | Path) -> Path:
    store = ExperimentStore(store_path)
    c = store.campaign(int(campaign) if str(campaign).isdigit() else campaign)
    exps = store.experiments(c["id"])
    ships = store.ships(c["id"])
    rows = []
    for e in exps:
        logs = (e.measurement or {}).get("logs_dir")
        rows.append({**e.__dict__, "logs": Path(logs).as_uri() if logs else None})
    ship_rows = [{**s, "when": time.strftime("%H:%M:%S", time.localtime(s["time"])),
                  "plan_text": json.dumps(s["plan"])[:200]} for s in ships]
    measured_on = next(((e.measurement or {}).get("device") for e in exps if (e.measurement or {}).get("device")),
                       "see each measurement")
    from jinja2 import Environment, PackageLoader, select_autoescape

    env = Environment(loader=PackageLoader("tkcc.agents", "templates"), autoescape=select_autoescape(["html"]))
    html = env.get_template("report.html.jinja").render(
        c=c, exps=rows, ships=ship_rows, n_exp=len(exps), per_tier=dict(Counter(e.tier for e in exps)),
        plots=_plots(exps, ships, c["config"].get("buckets")), objective_name=c["config"].get("objective", "objective"),
        measured_on=measured_on)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(html)
    tmp.replace(out)
    store.close()
    return out
