"""`tkcc report CAMPAIGN`: one HTML page about a campaign, with a page per candidate beside it.

The page: the objective over time with each tier on its own axis (they
measure different models: the fast tier is the first blocks of the slow
one) and the serving line on the slow tier's; the noise threshold and the
A/A pairs it comes from; experiments per hour and the seconds each phase took, on the engine's critical
path and in parallel; every ship decision with its numbers; every
experiment with its plan, the reason for its verdict and a link to its
candidate's page. Each candidate's page (``<report>_files/<candidate>.html``)
shows its plan, its pass logs (matched, replaced, added, removed, time per
pass) and links to its generated source, copied next to the report so the
folder stands on its own after the engine that built them is gone.
"""
from __future__ import annotations

import base64
import html as html_lib
import io
import json
import shutil
import time
from collections import Counter
from pathlib import Path

from tkcc.agents.noise import NoiseModel
from tkcc.agents.store import ExperimentStore


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plan_text(plan: list) -> str:
    """``cse(get_attr=merge) -> dce``; "(empty plan: the captured forward)" for []."""
    if not plan:
        return "(empty plan: the captured forward)"
    return " -> ".join(s["name"] + ("(" + ", ".join(f"{k}={v}" for k, v in sorted((s.get("params") or {}).items()))
                                    + ")" if s.get("params") else "") for s in plan)


def _objective_plot(exps, ships, tiers) -> str:
    """One axis per tier (they measure different models), shared time; the serving line on the slow axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min((e.started for e in exps), default=min((s["time"] for s in ships), default=0.0))
    t_end = max([e.finished for e in exps] + [s["time"] for s in ships] + [t0])
    shown = [t for t in ("fast", "slow") if t in tiers] or ["slow"]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 2.6 * len(shown)), sharex=True, squeeze=False)
    styles = {"aa": ("A/A", "x"), "baseline": ("reference", "D"), "start": ("reference", "D")}
    for ax, tier in zip(axes[:, 0], shown):
        groups: dict[str, list] = {}
        for e in exps:
            if e.tier == tier and e.objective is not None:
                label = styles.get(e.proposer, ("candidates", "o"))[0]
                groups.setdefault(label, []).append((e.finished - t0, e.objective))
        for label, pts in groups.items():
            marker = {"A/A": "x", "reference": "D"}.get(label, "o")
            ax.scatter(*zip(*pts), marker=marker, s=22, label=label, alpha=0.75)
        if tier == "slow":
            _serving_line(ax, ships, t0, t_end)
        ax.set_ylabel(f"{tier} tier\nobjective")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the campaign's first experiment")
    return _png(fig)


def _serving_line(ax, ships, t0, t_end) -> None:
    """What served, over time: a step line from each ship/revert to the next (to the end of the campaign)."""
    pts = [(s["time"] - t0, s["objective"]) for s in ships
           if s["action"] in ("ship", "revert") and s["objective"] is not None]
    if not pts:
        return
    xs = [p[0] for p in pts] + [max(t_end - t0, pts[-1][0])]
    ys = [p[1] for p in pts] + [pts[-1][1]]
    ax.step(xs, ys, where="post", color="k", linewidth=1.6, label="serving")
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="k", marker="^", s=40, zorder=3)


def _plots(exps, ships, buckets, tiers) -> dict[str, str | None]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {"objective": _objective_plot(exps, ships, tiers)}
    fig, ax = plt.subplots(figsize=(6, 2.6))
    counts = Counter((e.tier, e.verdict) for e in exps)
    names = sorted({t for t, _ in counts}) or ["-"]
    bottom = [0] * len(names)
    for v in sorted({v for _, v in counts}):
        vals = [counts.get((t, v), 0) for t in names]
        ax.bar(names, vals, bottom=bottom, label=v)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.set_ylabel("experiments")
    if counts:
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


def _throughput(exps, sessions) -> dict:
    """Experiments per hour per session (start-up included) and seconds per phase per tier, critical path and
    in parallel, from the rows' ``timing`` (``tkcc.agents.throughput``); a plot of the phases."""
    from tkcc.agents.throughput import PHASES

    per = {}
    for e in exps:
        if e.verdict == "reused" or not e.timing:
            continue
        t = per.setdefault(e.tier, {"experiments": 0, "critical": dict.fromkeys(PHASES, 0.0), "parallel": 0.0})
        t["experiments"] += 1
        for k, v in (e.timing.get("critical") or {}).items():
            t["critical"][k] = t["critical"].get(k, 0.0) + float(v or 0.0)
        t["parallel"] += float((e.timing.get("parallel") or {}).get("compile") or 0.0)
    rows = [dict(s.get("throughput") or {}, session=i + 1) for i, s in enumerate(sessions) if s.get("throughput")]
    plot = None
    if per:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tiers = sorted(per)
        fig, ax = plt.subplots(figsize=(9, 0.9 + 0.7 * len(tiers)))
        left = [0.0] * len(tiers)
        for k in PHASES:
            vals = [per[t]["critical"].get(k, 0.0) for t in tiers]
            ax.barh([f"{t}: critical path" for t in tiers], vals, left=left, label=k)
            left = [a + b for a, b in zip(left, vals)]
        ax.barh([f"{t}: in parallel" for t in tiers], [per[t]["parallel"] for t in tiers], color="0.6",
                label="compile (pool, worker-s)")
        ax.set_xlabel("seconds, summed over the experiments")
        ax.legend(fontsize=7, ncol=4, loc="lower right")
        plot = _png(fig)
    return {"tiers": per, "sessions": rows, "phases": PHASES, "plot": plot}


def _noise(exps, sessions, min_pairs: int) -> dict:
    """The noise model of the last session (its A/A pairs, under its conditions) and every session's pairs."""
    last = (sessions[-1].get("conditions") if sessions else None)
    nm = NoiseModel(min_pairs=min_pairs)
    pairs = []
    for e in exps:
        m = e.measurement or {}
        if e.proposer == "aa" and "aa_pair" in m:
            same = last is None or m.get("conditions", {}) == last
            pairs.append({"id": e.id, "tier": e.tier, "a": m.get("a"), "b": m.get("b"), "diff": m["aa_pair"],
                          "this_session": same})
            if same:
                nm.aa_diffs.append(m["aa_pair"])
    return {"pairs": pairs, "n": len(nm.aa_diffs), "sd": nm.sd if len(nm.aa_diffs) >= 2 else None,
            "threshold": nm.threshold() if nm.calibrated else None, "z": nm.z, "floor": nm.floor,
            "calibrated": nm.calibrated, "min_pairs": nm.min_pairs}


def _candidate_pages(c, exps, ships, files: Path, rel: str) -> dict[str, str]:
    """Write one page per candidate under ``files``; returns candidate -> link relative to the report."""
    files.mkdir(parents=True, exist_ok=True)
    by_cand: dict[str, list] = {}
    for e in exps:
        by_cand.setdefault(e.candidate, []).append(e)
    links = {}
    for cand, rows in by_cand.items():
        plan = rows[0].plan
        logs_dir = next(((e.measurement or {}).get("logs_dir") for e in rows if (e.measurement or {}).get("logs_dir")),
                        None)
        passes = next(((e.measurement or {}).get("passes") for e in rows if (e.measurement or {}).get("passes")), None)
        sources = []
        if logs_dir and Path(logs_dir).is_dir():
            dest = files / cand
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(logs_dir, dest)
            info = json.loads((dest / "passes.json").read_text()) if (dest / "passes.json").exists() else {}
            passes = info.get("passes") or passes
            sources = sorted(str(p.relative_to(files)) for p in dest.rglob("*") if p.is_file())
        page = _candidate_html(c, cand, plan, passes, sources, rows,
                               [s for s in ships if s["candidate"] == cand])
        (files / f"{cand}.html").write_text(page)
        links[cand] = f"{rel}/{cand}.html"
    return links


def _candidate_html(c, cand, plan, passes, sources, rows, ships) -> str:
    esc = html_lib.escape
    out = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>candidate {esc(cand)}</title>",
           "<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1000px}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:3px 7px;font-size:13px;text-align:left}th{background:#f3f3f3}</style>"
           "</head><body>",
           f"<p><a href='../{esc(c['_report_name'])}'>&larr; campaign {esc(c['name'])}</a></p>",
           f"<h1>Candidate <code>{esc(cand)}</code></h1>",
           f"<p>Plan: <code>{esc(plan_text(plan))}</code></p><pre>{esc(json.dumps(plan, indent=1))}</pre>",
           "<h2>Pass logs</h2>"]
    if passes:
        out.append("<table class='passlog'><tr><th>#</th><th>pass</th><th>matched</th><th>replaced</th><th>added</th>"
                   "<th>removed</th><th>time</th></tr>")
        for i, p in enumerate(passes, 1):
            t = p.get("seconds", p.get("time_s"))
            out.append(f"<tr><td>{i}</td><td>{esc(str(p.get('name')))}</td><td>{p.get('matched', '')}</td>"
                       f"<td>{p.get('replaced', '')}</td><td>{p.get('added', '')}</td><td>{p.get('removed', '')}</td>"
                       f"<td>{'' if t is None else f'{float(t) * 1e3:.1f} ms'}</td></tr>")
        out.append("</table>")
    elif not plan:
        out.append("<p>The empty plan runs no pass: the captured forward as is.</p>")
    else:
        out.append("<p>No pass log was kept for this candidate (it did not build, or it was measured without "
                   "<code>keep_artifacts</code>).</p>")
    if sources:
        out.append("<h2>Files</h2><ul class='files'>")
        out += [f"<li><a class='file' href='{esc(s)}'>{esc(s)}</a></li>" for s in sources]
        out.append("</ul>")
    out.append("<h2>Experiments</h2><table><tr><th>#</th><th>tier</th><th>verdict</th><th>objective</th>"
               "<th>reason</th></tr>")
    for e in rows:
        obj = "" if e.objective is None else f"{e.objective:.4g}"
        out.append(f"<tr><td>{e.id}</td><td>{e.tier}</td><td>{esc(e.verdict)}</td><td>{obj}</td>"
                   f"<td>{esc(e.reason or '')}</td></tr>")
    out.append("</table>")
    if ships:
        out.append("<h2>Ship decisions</h2><ul>")
        out += [f"<li>{esc(s['action'])}: {esc(s['reason'])}</li>" for s in ships]
        out.append("</ul>")
    out.append("</body></html>\n")
    return "\n".join(out)


def write_report(store_path: str | Path, campaign: str | int, out: str | Path) -> Path:
    store = ExperimentStore(store_path)
    try:
        c = store.campaign(int(campaign) if str(campaign).isdigit() else campaign)
        exps = store.experiments(c["id"])
        ships = store.ships(c["id"])
    finally:
        store.close()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    files = out.with_name(out.stem + "_files")
    c["_report_name"] = out.name
    links = _candidate_pages(c, exps, ships, files, files.name)
    sessions = c["config"].get("sessions") or [{"budget_s": c["config"].get("budget_s")}]
    rows = [{**e.__dict__, "plan_text": plan_text(e.plan), "page": links.get(e.candidate),
             "logs": links.get(e.candidate) if (e.measurement or {}).get("logs_dir") else None,
             "when": time.strftime("%H:%M:%S", time.localtime(e.finished))} for e in exps]
    ship_rows = [{**s, "when": time.strftime("%H:%M:%S", time.localtime(s["time"])), "plan_text": plan_text(s["plan"]),
                  "page": links.get(s["candidate"]), "d": s.get("detail") or {}} for s in ships]
    measured_on = next(((e.measurement or {}).get("device") for e in exps if (e.measurement or {}).get("device")),
                       "see each measurement")
    tiers = list(c["config"].get("tiers") or ["fast", "slow"])
    from jinja2 import Environment, PackageLoader, select_autoescape

    env = Environment(loader=PackageLoader("tkcc.agents", "templates"), autoescape=select_autoescape(["html"]))
    html = env.get_template("report.html.jinja").render(
        c=c, exps=rows, ships=ship_rows, n_exp=len(exps), per_tier=dict(Counter(e.tier for e in exps)),
        plots=_plots(exps, ships, c["config"].get("buckets"), tiers),
        objective_name=c["config"].get("objective", "objective"), measured_on=measured_on, noise=_noise(exps, sessions, int(c["config"].get("aa_pairs") or 3)),
        sessions=sessions, total_budget=sum(float(s.get("budget_s") or 0) for s in sessions), tiers=tiers,
        throughput=_throughput(exps, sessions))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(html)
    tmp.replace(out)
    return out
