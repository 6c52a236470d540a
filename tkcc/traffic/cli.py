"""`tkcc trace stats FILE` and `tkcc trace drift FILE --window 10m|6h|1d`."""
from __future__ import annotations

import os
import re
from pathlib import Path

from tkcc.traffic.drift import detect_drift, parse_window
from tkcc.traffic.loaders import FORMATS, load_trace
from tkcc.traffic.names import trace_path
from tkcc.traffic.stats import trace_stats


def register(subparsers) -> None:
    p = subparsers.add_parser("trace", help="inspect traffic traces: stats, drift")
    sub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    sub.required = True

    def common(sp):
        sp.add_argument("file", help="trace file or bundled trace name (azure-conv, azure-code, sharegpt, ...); "
                                     "ServeGen: chunk-N-trace.csv with its dataset.json beside it")
        sp.add_argument("--format", default=None, choices=sorted(FORMATS) + ["auto"], help="default: detect")
        sp.add_argument("--skip-bad", action="store_true", help="skip malformed rows and report how many")
        sp.add_argument("--sort", action="store_true", help="accept rows out of arrival order and sort them")
        sp.add_argument("--seed", type=int, default=0, help="ServeGen sampling seed")
        sp.add_argument("--max-requests", type=int, default=1_000_000, help="ServeGen: thin larger clients to this")
        sp.add_argument("--png", default=None, help="figure path (default: ./<file stem>-<command>.png)")
        sp.add_argument("--no-png", action="store_true", help="write no figure")
        sp.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    s = sub.add_parser("stats", help="counts, length percentiles, rate; PNG of length histograms and arrivals")
    common(s)
    s.set_defaults(func=cmd_stats)
    d = sub.add_parser("drift", help="windowed length percentiles and the drift detector's verdict per window")
    common(d)
    d.add_argument("--window", default="10m", help="window length: 10m, 6h, 1d, or seconds (default 10m)")
    d.add_argument("--alpha", type=float, default=1e-3, help="KS significance level (default 1e-3)")
    d.add_argument("--ratio", type=float, default=1.5, help="P50/P90 ratio that counts as drift (default 1.5)")
    d.add_argument("--min-requests", type=int, default=100, help="windows with fewer requests are not tested")
    d.set_defaults(func=cmd_drift)


def _load(args):
    opts = {}
    if (args.format or "") == "servegen" or str(args.file).endswith(("-trace.csv", "-dataset.json")):
        opts = {"seed": args.seed, "max_requests": args.max_requests}
    fmt = None if args.format in (None, "auto") else args.format
    return load_trace(trace_path(args.file), format=fmt, skip_bad=args.skip_bad, sort=args.sort, **opts)


def _png_path(args, suffix: str) -> str | None:
    if args.no_png:
        return None
    if args.png:
        return args.png
    stem = Path(args.file).name
    stem = re.sub(r"\.(csv|jsonl|json|log|gz)$", "", stem)
    stem = re.sub(r"\.(csv|jsonl|json)$", "", stem)
    return os.path.join(os.getcwd(), f"{stem}-{suffix}.png")


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.3g}"


def cmd_stats(args) -> dict:
    from tkcc.traffic.plots import stats_png

    tr = _load(args)
    st = trace_stats(tr)
    png = _png_path(args, "stats")
    if png:
        st["png"] = stats_png(tr, st, png)
    lines = [f"{tr.source}  format={tr.format}  requests={len(tr):,}  skipped={tr.skipped}"]
    if st["span_s"] is None:
        lines.append("no timestamps (length-only dataset)")
    elif st["req_per_s"] is None:
        lines.append(f"span 0 s: {'one request' if len(tr) == 1 else f'all {len(tr)} requests arrive at once'}, so "
                     f"no arrival rate  start {tr.start_time or '-'}")
    else:
        lines.append(f"span {st['span_s']:,.0f} s  ({st['req_per_s']:.3f} req/s)  start {tr.start_time or '-'}")
    if tr.meta.get("rate_scale") not in (None, 1.0):
        lines.append(f"ServeGen: thinned to {tr.meta['rate_scale']:.4g} of the published rate "
                     f"({tr.meta['expected_requests']:,.0f} requests expected), seed {tr.meta.get('seed')}")
    lines.append(f"{'':8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for name in ("input", "output"):
        s = st[name]
        lines.append(f"{name:8}" + "".join(f"{_fmt(s[k]):>10}" for k in ("mean", "p50", "p90", "p99", "max")))
    if tr.skipped:
        lines.append(f"skipped {tr.skipped} bad row(s); first: " +
                     "; ".join(f"line {x['line']} {x['field'] or ''}: {x['reason']}" for x in st["skipped_lines"][:3]))
    if png:
        lines.append(f"figure: {png}")
    st["text"] = "\n".join(lines)
    return st


def cmd_drift(args) -> dict:
    from tkcc.traffic.plots import drift_png

    window_s = parse_window(args.window)  # a bad window fails before a long load
    tr = _load(args)
    rep = detect_drift(tr, window_s, alpha=args.alpha, ratio=args.ratio, min_requests=args.min_requests)
    out = rep.to_dict()
    out["format"] = tr.format
    out["requests"] = len(tr)
    out["skipped"] = tr.skipped
    png = _png_path(args, f"drift-{args.window}")
    if png:
        out["png"] = drift_png(rep, png)
    lines = [f"{tr.source}  format={tr.format}  requests={len(tr):,}  skipped={tr.skipped}  window={args.window}",
             f"{'window':>16}{'requests':>10}{'in p50':>9}{'in p90':>9}{'out p50':>9}{'out p90':>9}  verdict"]
    for w in rep.windows:
        if w.drift:
            verdict = f"DRIFT {w.direction} {w.magnitude:.2f}x ({w.field} vs window {w.reference})" + \
                      ("  -> re-optimise" if w.reoptimize else f"  {w.note}")
        else:
            verdict = w.note or (f"stable vs window {w.reference}" if w.reference is not None else "")
        lines.append(f"{w.label:>16}{w.requests:>10,}{_fmt(w.input['p50']):>9}{_fmt(w.input['p90']):>9}"
                     f"{_fmt(w.output['p50']):>9}{_fmt(w.output['p90']):>9}  {verdict}")
    n = len(rep.drifted)
    tested = [w for w in rep.windows if w.requests >= args.min_requests]
    if len(tested) < 2:
        out["note"] = (f"nothing to compare: {len(tested)} of {len(rep.windows)} window(s) of {args.window} hold at "
                       f"least --min-requests {args.min_requests} requests (the trace has {len(tr):,}); drift needs "
                       "two such windows: use a longer trace, a larger --window or a smaller --min-requests")
        lines.append(out["note"])
    else:
        lines.append(f"{n} drifted window(s); re-optimisation warranted at: "
                     f"{[w.label for w in rep.windows if w.reoptimize] or 'none'}")
    if tr.skipped:
        lines.append(f"skipped {tr.skipped} bad row(s)")
    if png:
        lines.append(f"figure: {png}")
    out["text"] = "\n".join(lines)
    return out
