"""PNG figures for `tkcc trace stats` and `tkcc trace drift` (matplotlib, Agg: no display needed)."""
from __future__ import annotations

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _log_bins(x: np.ndarray, n: int = 60) -> np.ndarray:
    hi = max(float(x.max()) if x.size else 1.0, 2.0)
    return np.unique(np.concatenate([[0], np.geomspace(1, hi + 1, n)]))


def stats_png(trace, stats: dict, path) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, col, name in ((axes[0], trace.input_tokens, "input"), (axes[1], trace.output_tokens, "output")):
        ax.hist(col, bins=_log_bins(col), color="C0" if name == "input" else "C1")
        ax.set_xscale("symlog", linthresh=1)
        for q in ("p50", "p90", "p99"):
            v = stats[name][q]
            if v is not None:
                ax.axvline(v, ls="--", color="k", lw=0.8)
                ax.text(v, ax.get_ylim()[1] * 0.95, q, rotation=90, va="top", ha="right", fontsize=8)
        ax.set_xlabel(f"{name} tokens")
        ax.set_ylabel("requests")
        ax.set_title(f"{name} length (n={len(trace):,})")
    ax = axes[2]
    if trace.has_timestamps and len(trace) > 1:
        span = max(trace.duration_s(), 1e-9)
        unit, div = ("h", 3600.0) if span > 3 * 3600 else ("min", 60.0)
        if span > 3 * 86400:
            unit, div = "day", 86400.0
        nb = min(200, max(10, int(len(trace) ** 0.5)))
        counts, edges = np.histogram(trace.arrival_s / div, bins=nb)
        width = (edges[1] - edges[0]) * div
        ax.plot(edges[:-1], counts / width, color="C2")
        ax.set_xlabel(f"time since origin ({unit})")
        ax.set_ylabel("requests / s")
        ax.set_title("arrivals over time")
    else:
        ax.hist2d(np.log10(np.maximum(trace.input_tokens, 1)), np.log10(np.maximum(trace.output_tokens, 1)), bins=50,
                  cmap="viridis")
        ax.set_xlabel("log10 input tokens")
        ax.set_ylabel("log10 output tokens")
        ax.set_title("input vs output (no timestamps)")
    fig.suptitle(f"{trace.source} ({trace.format})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def drift_png(report, path) -> str:
    plt = _plt()
    ws = report.windows
    div = 86400.0 if report.window_s >= 86400 else 3600.0 if report.window_s >= 3600 else 60.0
    x = np.array([w.start_s for w in ws]) / div              # window starts (shading)
    mid = np.array([(w.start_s + w.end_s) / 2 for w in ws]) / div  # points at window centres
    unit = "day" if report.window_s >= 86400 else "h" if report.window_s >= 3600 else "min"
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for ax, name in zip(axes, ("input", "output")):
        for q, style in (("p50", "-o"), ("p90", "-s")):
            y = np.array([np.nan if getattr(w, name)[q] is None else getattr(w, name)[q] for w in ws], dtype=float)
            ax.plot(mid, y, style, label=f"{name} {q.upper()}", ms=4)
        for w, xi in zip(ws, x):
            if w.drift:
                ax.axvspan(xi, xi + max(w.end_s - w.start_s, 1e-9) / div,
                           color="red" if w.reoptimize else "orange", alpha=0.2)
                if name == "input":
                    ax.annotate(f"{w.direction} {w.magnitude:.1f}x\n{w.field}", (xi, 0),
                                xycoords=("data", "axes fraction"), xytext=(2, 4), textcoords="offset points",
                                fontsize=7, color="red")
        ax.set_yscale("log")
        ax.set_ylabel(f"{name} tokens")
        ax.legend(loc="upper left", fontsize=8)
    axes[1].set_xlabel(f"time since origin ({unit}); points: window P50/P90; shaded: drift (red: re-optimise)")
    fig.suptitle(f"drift, {report.source}, window {report.window_s:g} s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)
