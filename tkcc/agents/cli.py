"""`tkcc campaign`, `tkcc watch`, `tkcc report`: the continual loop from the shell."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tkcc.errors import TkccError


def register(sub) -> None:
    from tkcc.cli import add_json_flag

    c = sub.add_parser("campaign", help="propose, screen (fast tier), confirm (slow tier) and ship candidates")
    _engine_args(c)
    c.add_argument("--trace", default="azure-conv", help="trace file or bundled name (default azure-conv)")
    c.add_argument("--format", default=None, help="trace format (default: detected)")
    c.add_argument("--budget", default="10m", help="wall-clock budget, e.g. 90s, 30m, 2h (default 10m)")
    c.add_argument("--name", default=None, help="campaign name in the store (default: model-timestamp)")
    c.add_argument("--resume", action="store_true", help="continue the named campaign; reuse what it measured")
    c.add_argument("--tiers", default="fast,slow", choices=["fast,slow", "slow"],
                   help="two tiers (default) or the slow tier only")
    c.add_argument("--aa-pairs", type=int, default=3, help="A/A pairs measured before anything ships (default 3)")
    c.add_argument("--batch", type=int, default=4, help="candidates proposed per round (default 4)")
    _proposer_args(c)
    add_json_flag(c)
    c.set_defaults(func=cmd_campaign)

    w = sub.add_parser("watch", help="follow a growing request log; on drift, re-check and re-optimise")
    _engine_args(w)
    w.add_argument("--trace-stream", required=True, help="request log FILE (or DIR: its newest file) to follow")
    w.add_argument("--format", default=None)
    w.add_argument("--horizon", default="10m", help="rolling window of traffic (default 10m)")
    w.add_argument("--budget", default="5m", help="budget of each re-optimisation campaign (default 5m)")
    w.add_argument("--poll", type=float, default=5.0, help="seconds between reads of the log (default 5)")
    w.add_argument("--polls", type=int, default=None, help="stop after this many polls (default: run until killed)")
    w.add_argument("--min-requests", type=int, default=200, help="requests needed before deciding anything")
    w.add_argument("--name", default=None)
    _proposer_args(w)
    add_json_flag(w)
    w.set_defaults(func=cmd_watch)

    r = sub.add_parser("report", help="write one HTML page about a campaign")
    r.add_argument("campaign", help="campaign name or id")
    r.add_argument("--store", default="tkcc-campaigns.db")
    r.add_argument("--out", default=None, help="HTML file (default: <campaign>.html)")
    add_json_flag(r)
    r.set_defaults(func=cmd_report)


def _engine_args(p) -> None:
    p.add_argument("--model", default=None, help="built-in model (default olmoe-tiny); ignored with --engine-socket")
    p.add_argument("--device", default="cpu", help="device of the engine this command starts (default cpu)")
    p.add_argument("--engine-socket", default=None, help="use a running engine (tkcc serve) instead of starting one")
    p.add_argument("--engine-arg", action="append", default=[], help="extra argument for the engine it starts")
    p.add_argument("--store", default="tkcc-campaigns.db", help="experiment store (SQLite; default tkcc-campaigns.db)")
    p.add_argument("--pass-module", action="append", default=[], help="Python file with user passes (repeatable)")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per bucket (default 30)")
    p.add_argument("--tolerance", action="store_true", help="search tolerance-mode passes too (default exact only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--seed", type=int, default=0)


def _proposer_args(p) -> None:
    p.add_argument("--proposer", default="search", choices=["search", "agent"])
    p.add_argument("--agent-cmd", default=None, help="command an external coding agent runs in its workspace")
    p.add_argument("--agent-notes", default=None, help="optional notes file appended to the one-sentence goal")
    p.add_argument("--agent-time-limit", default="30m", help="time limit of one agent run (default 30m)")


def _seconds(text: str, what: str) -> float:
    from tkcc.traffic.drift import parse_window

    try:
        s = parse_window(text)
    except Exception as e:  # noqa: BLE001 - re-raised with the flag's name
        raise TkccError(f"{what} {text!r}: {e}") from None
    if s <= 0:
        raise TkccError(f"{what} must be positive, got {text!r}")
    return s


class _Engine:
    """Connect to --engine-socket, or start an engine for the command's lifetime."""

    def __init__(self, args):
        self.args, self.ctx = args, None

    def __enter__(self):
        from tkcc.runtime import EngineClient

        if self.args.engine_socket:
            self.client = EngineClient(socket_path=self.args.engine_socket)
            return self.client
        from tkcc.agents.engine_eval import spawned_engine
        from tkcc.frontend.models import DEFAULT_MODEL

        self.ctx = spawned_engine(self.args.model or DEFAULT_MODEL, self.args.device,
                                  extra=tuple(self.args.engine_arg))
        self.client = self.ctx.__enter__()
        return self.client

    def __exit__(self, *exc):
        if self.ctx is not None:
            return self.ctx.__exit__(*exc)
        self.client.close()
        return False


def _workload_for(client, trace):
    from tkcc.traffic.buckets import workload_from_trace

    worker = client.status().get("worker") or {}
    cap = worker.get("max_cache_len")
    if not cap:
        raise TkccError("the engine's model has no KV cache length; campaigns need an LLM engine")
    return workload_from_trace(trace, max_context=int(cap), batch_sizes=(int(worker.get("batch") or 1),))


def _proposer(args, client, evaluator):
    from tkcc.agents.search import BayesianSearch, SearchSpace

    if args.proposer == "search":
        return BayesianSearch(SearchSpace.from_registry(exact_only=not args.tolerance, device=evaluator.device_type),
                              seed=args.seed)
    from tkcc.agents.external import agent_for_engine

    if not args.agent_cmd:
        raise TkccError("--proposer agent needs --agent-cmd")

    return agent_for_engine(client, args.agent_cmd, Path(args.store).with_suffix(".agent"), notes=args.agent_notes,
                            time_limit_s=_seconds(args.agent_time_limit, "--agent-time-limit"))


def cmd_campaign(args):
    from tkcc.agents.campaign import CampaignConfig, run_campaign
    from tkcc.agents.engine_eval import EngineEvaluator
    from tkcc.agents.noise import check_aa_pairs
    from tkcc.agents.store import ExperimentStore
    from tkcc.compiler import resolve_trace

    budget = _seconds(args.budget, "--budget")
    check_aa_pairs(args.aa_pairs)
    store = ExperimentStore(args.store)  # a bad store is refused before an engine starts
    trace = resolve_trace(args.trace, format=args.format)
    t0 = time.time()
    with _Engine(args) as client:
        workload = _workload_for(client, trace)
        ev = EngineEvaluator(client, workload, pass_modules=args.pass_module, reps=args.reps)
        model = ev.model or args.model
        name = args.name or f"{model}-{time.strftime('%Y%m%d-%H%M%S')}"
        cfg = CampaignConfig(name=name, model=str(model), budget_s=budget, tiers=tuple(args.tiers.split(",")),
                             batch=args.batch, aa_pairs=args.aa_pairs, resume=args.resume,
                             extra={"trace": str(args.trace), "objective": workload.objective,
                                    "buckets": [b.__dict__ for b in workload.buckets]})
        state = run_campaign(cfg, store, _proposer(args, client, ev), ev, progress=not args.no_progress)
    return _summary(store, state, name, time.time() - t0, ev.device)


def _summary(store, state, name, wall_s, device) -> dict:
    exps = store.experiments(state.campaign_id)
    ships = store.ships(state.campaign_id)
    base = next((s["objective"] for s in ships if s["reason"] == "baseline"), None)
    out = {"campaign": name, "store": str(store.path), "wall_s": round(wall_s, 1), "device": device,
           "experiments": len(exps), "evaluated": state.evaluated,
           "noise_threshold": state.noise.threshold() if state.noise.calibrated else None,
           "baseline_objective": base, "shipped": {"candidate": state.shipped[0], "objective": state.shipped[1]},
           "gain": (state.shipped[1] / base - 1) if base else None, "ships": ships, "log": state.log[-20:]}
    gain = f"{out['gain'] * 100:+.1f}%" if out["gain"] is not None else "n/a"
    out["text"] = (f"campaign {name}: {len(exps)} experiments in {wall_s:.0f} s on {device} "
                   f"(fast {state.evaluated.get('fast', 0)}, slow {state.evaluated.get('slow', 0)}); serving "
                   f"{state.shipped[0]} at objective {state.shipped[1]:.4g} ({gain} over baseline); store {store.path}")
    return out


def cmd_watch(args):
    from tkcc.agents.engine_eval import EngineEvaluator
    from tkcc.agents.search import BayesianSearch, SearchSpace
    from tkcc.agents.store import ExperimentStore
    from tkcc.agents.watch import watch
    from tkcc.traffic.follow import RollingWorkload

    path = Path(args.trace_stream)
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.is_file()), key=lambda p: p.stat().st_mtime)
        if not files:
            raise TkccError(f"--trace-stream {path}: the folder has no files yet")
        path = files[-1]
    if not path.exists():
        raise TkccError(f"--trace-stream {path} does not exist")
    rolling = RollingWorkload(path, horizon=args.horizon, format=args.format)
    store = ExperimentStore(args.store)  # a bad store is refused before an engine starts
    with _Engine(args) as client:
        worker = client.status().get("worker") or {}
        wk = {"max_context": int(worker.get("max_cache_len") or 4096), "batch_sizes": (int(worker.get("batch") or 1),)}
        model = str((client.status().get("engine") or {}).get("model") or args.model)
        events = watch(rolling, lambda wl: EngineEvaluator(client, wl, pass_modules=args.pass_module, reps=args.reps),
                       lambda: BayesianSearch(SearchSpace.from_registry(exact_only=not args.tolerance,
                                                                        device=str(worker.get("device", "cpu"))),
                                              seed=args.seed),
                       store, name=args.name or f"watch-{model}", model=model,
                       budget_s=_seconds(args.budget, "--budget"), min_requests=args.min_requests,
                       poll_s=args.poll, max_polls=args.polls, workload_kwargs=wk, progress=not args.no_progress)
    evs = [{"time": e.time, "kind": e.kind, **e.detail} for e in events]
    text = "\n".join(f"{time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['kind']}: "
                     f"{json.dumps({k: v for k, v in e.items() if k not in ('time', 'kind')}, default=str)[:200]}"
                     for e in evs)
    return {"events": evs, "store": args.store, "text": text}


def cmd_report(args):
    from tkcc.agents.report import write_report

    if not os.path.exists(args.store):
        raise TkccError(f"no experiment store at {args.store}")
    out = args.out or f"{args.campaign}.html"
    path = write_report(args.store, args.campaign, out)
    return {"report": str(path), "text": f"wrote {path}"}
