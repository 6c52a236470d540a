"""What a campaign did, for the terminal and ``--json``: whether it could try a candidate, why it stopped,
the noise threshold, every ship decision with its numbers, and the gain of what serves over the baseline with
its interval from the A/A spread."""
from __future__ import annotations

from tkcc.agents.campaign import CampaignState
from tkcc.agents.store import ExperimentStore


def summary_of(store: ExperimentStore, state: CampaignState) -> dict:
    """What a campaign did, for the terminal and ``--json``: tried or not, why it stopped, every decision,
    the noise threshold and the gain over the baseline with its interval."""
    from tkcc.traffic.ratios import gain_interval

    c = store.campaign(state.campaign_id)
    noise = state.noise
    base = state.baseline
    serving_key, serving_obj = state.shipped or (None, None)
    gain = None
    if base and serving_obj:
        r = gain_interval(serving_obj, base, noise.sd, len(noise.aa_diffs))
        gain = r.to_json()
    sessions = c["config"].get("sessions", [])
    return {"campaign": c["name"], "tried": state.tried, "could_try": state.could_try, "stopped": state.stopped,
            "evaluated": state.evaluated, "reused": state.reused,
            "noise": {"aa_pairs": len(noise.aa_diffs), "aa_sd": noise.sd if len(noise.aa_diffs) >= 2 else None,
                      "threshold": noise.threshold() if noise.calibrated else None, "z": noise.z,
                      "floor": noise.floor, "calibrated": noise.calibrated, "min_pairs": noise.min_pairs},
            "decisions": state.decisions, "baseline_objective": base,
            "shipped": {"candidate": serving_key, "objective": serving_obj}, "gain": gain,
            "budget": state.budget, "total_budget_s": sum(float(s.get("budget_s") or 0) for s in sessions),
            "sessions": len(sessions), "throughput": state.throughput}


def summary_text(s: dict, device: str | None = None) -> str:
    """The terminal summary of ``summary_of``."""
    b = s.get("budget") or {}
    on = f" on {device}" if device else ""
    lines = [f"campaign {s['campaign']}: {b.get('spent_s', 0):.0f} s of a {b.get('total_s', 0):.0f} s budget{on} "
             f"(start-up {b.get('startup_s', 0):.1f} s); experiments run: "
             + ", ".join(f"{t} {n}" for t, n in s["evaluated"].items())
             + (f"; {len(s['reused'])} result(s) reused (same artifact, workload, tier and conditions)"
                if s["reused"] else "")]
    if s["could_try"]:
        lines.append(f"tried {s['tried']} candidate(s)")
    else:
        lines.append("could not try any candidate" + (f": {s['stopped']}" if s["stopped"] else ""))
    if s["could_try"] and s["stopped"]:
        lines.append(f"stopped: {s['stopped']}")
    n = s["noise"]
    if n["calibrated"]:
        lines.append(f"noise: threshold {n['threshold'] * 100:.2f}% = max({n['floor'] * 100:.0f}%, "
                     f"{n['z']:g} x A/A sd {n['aa_sd'] * 100:.2f}%) over {n['aa_pairs']} A/A pairs")
    else:
        lines.append(f"noise: {n['aa_pairs']} of the {n['min_pairs']} A/A pairs needed to ship were measured; "
                     "nothing can ship before they are")
    for d in s["decisions"]:
        lines.append(f"  {d['action']:<8} {d['candidate']}: {d['why']}")
    sh = s["shipped"]
    obj = f"{sh['objective']:.4g}" if sh["objective"] is not None else "not measured on the slow tier this session"
    g = s.get("gain")
    gtxt = ""
    if g:
        from tkcc.traffic.ratios import Ratio

        r = Ratio(g["value"], g["low"] if g["low"] is not None else -float("inf"),
                  g["high"] if g["high"] is not None else float("inf"), g["confidence"], g["source"])
        gtxt = f" ({r.text('%')} over the baseline {s['baseline_objective']:.4g}; {r.source})"
    lines.append(f"serving {sh['candidate']} at objective {obj}{gtxt}")
    if s["sessions"] > 1:
        lines.append(f"{s['sessions']} sessions, total budget {s['total_budget_s']:.0f} s")
    if s.get("throughput"):
        from tkcc.agents.throughput import describe

        lines += describe(s["throughput"])
    return "\n".join(lines)
