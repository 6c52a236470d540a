"""`tkcc campaign`, `tkcc watch`, `tkcc report`: the continual loop from the shell."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from tkcc.errors import TkccError


def register(sub) -> None:
    from tkcc.cli import add_json_flag

    c = sub.add_parser("campaign", help="propose, screen (fast tier), confirm (slow tier) and ship candidates")
    _engine_args(c)
    c.add_argument("--trace", default="azure-conv", help="trace file or bundled name (default azure-conv)")
    c.add_argument("--format", default=None, help="trace format (default: detected)")
    c.add_argument("--budget", default="10m", help="wall-clock bound on the whole command, start-up included, "
                   "e.g. 90s, 30m, 2h (default 10m)")
    c.add_argument("--name", default=None, help="campaign name in the store (default: model-timestamp)")
    c.add_argument("--resume", action="store_true", help="continue the named campaign; reuse what it measured")
    c.add_argument("--tiers", default="fast,slow", choices=["fast,slow", "slow"], metavar="fast,slow|slow",
                   help="screen on the fast tier and confirm on the slow one (default), or the slow tier only")
    c.add_argument("--aa-pairs", type=int, default=3,
                   help="A/A pairs needed before anything ships (default 3; more if the budget affords them)")
    c.add_argument("--batch", type=int, default=4,
                   help="candidates proposed per round (default 4; the built-in search's first round is its whole "
                   "screening, every pass alone)")
    c.add_argument("--ahead", type=int, default=4,
                   help="candidates kept proposed, with their kernels compiling, ahead of the one measured "
                        "(default 4; 0: none): needs an engine with a compile pool (a GPU engine has one)")
    c.add_argument("--compile-workers", type=int, default=None,
                   help="processes of the started engine's compile pool (default: the machine's cores on a GPU)")
    c.add_argument("--phases", default=None, metavar="PHASE[,PHASE]",
                   help="measure only these phases' buckets of the trace (e.g. decode: the default objective, P90 "
                        "per-user decode tokens/s, depends on decode steps only; a model whose eager prefill cannot "
                        "run at the trace's prompt lengths)")
    c.add_argument("--kernel-cache", default=None,
                   help="the started engine's shared kernel cache folder (default ~/.cache/tkcc/triton)")
    c.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="one engine per Ray actor, screening in parallel; ADDRESS: a running Ray cluster "
                        "(default: start a local one)")
    c.add_argument("--engines", type=int, default=None,
                   help="with --ray: engine actors (default: one per GPU of the cluster, or per --tp GPUs; 2 on CPU)")
    c.add_argument("--tp", type=int, default=1,
                   help="with --ray: each engine is `tkcc serve --tp N` (N ranks: GPUs, or gloo processes on a CPU), "
                        "placed in a placement group that keeps its ranks on one node; plans shard N ways first")
    _proposer_args(c)
    add_json_flag(c)
    c.set_defaults(func=cmd_campaign)

    w = sub.add_parser("watch", help="follow a growing request log; on drift, re-check and re-optimise")
    _engine_args(w)
    w.add_argument("--trace-stream", required=True, help="request log FILE (or DIR: its newest file) to follow")
    w.add_argument("--format", default=None, help="trace format (default: detected)")
    w.add_argument("--horizon", default="10m", help="rolling window of traffic (default 10m)")
    w.add_argument("--budget", default="5m", help="budget of each re-optimisation campaign (default 5m)")
    w.add_argument("--poll", type=float, default=5.0, help="seconds between reads of the log (default 5)")
    w.add_argument("--polls", type=int, default=None, help="stop after this many polls (default: run until killed)")
    w.add_argument("--min-requests", type=int, default=200,
                   help="requests in the window needed before deciding anything: the reference, a drift verdict, "
                        "a re-optimisation (default 200)")
    w.add_argument("--name", default=None, help="campaign name prefix in the store (default: watch-<model>)")
    w.add_argument("--serve", default=None, metavar="URL",
                   help="also hot-swap each ship/revert into this running `tkcc serve --http` server")
    w.add_argument("--serve-token-file", default=None, help="that server's admin token file")
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
    p.add_argument("--reps", type=int, default=None,
                   help="timed repetitions per bucket (default: sized to the budget, 5 to 30)")
    p.add_argument("--tolerance", action="store_true", help="search tolerance-mode passes too (default exact only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines (on stderr)")
    p.add_argument("--keep-temp", action="store_true", help="keep the started engine's temporary folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the search proposer (default 0)")


def _proposer_args(p) -> None:
    p.add_argument("--proposer", default="search", choices=["search", "agent"],
                   help="the built-in search (default) or an external coding agent (--agent-cmd)")
    p.add_argument("--agent-cmd", default=None, help="command an external coding agent runs in its workspace")
    p.add_argument("--agent-notes", default=None, help="optional notes file appended to the one-sentence goal")
    p.add_argument("--agent-time-limit", default="30m", help="time limit of one agent run (default 30m)")


def _seconds(text: str, what: str) -> float:
    from tkcc.traffic.drift import parse_duration

    return parse_duration(text, what)


def _reps(args, budget_s: float) -> int:
    """--reps, or repetitions per bucket sized to the budget: 5 for a 20 s campaign, 30 from 5 minutes."""
    if args.reps is not None:
        if args.reps < 1:
            raise TkccError(f"--reps must be at least 1, got {args.reps}")
        return args.reps
    return int(min(30, max(5, round(budget_s / 10))))


STOP_RESERVE_S = 1.5  # kept from the budget for stopping the engine and writing the summary
SUMMARY_S = 0.3  # of which the summary's: the engine is killed if it has not stopped by then


class _Engine:
    """Connect to --engine-socket, or start an engine for the command's lifetime (within ``start_timeout_s``)."""

    def __init__(self, args, start_timeout_s: float = 900, stop_by: float | None = None):
        self.args, self.ctx, self.start_timeout_s, self.stop_by = args, None, start_timeout_s, stop_by
        self.stop_error: str | None = None

    def __enter__(self):
        from tkcc.runtime import EngineClient

        if self.args.engine_socket:
            self.client = EngineClient(socket_path=self.args.engine_socket)
            return self.client
        from tkcc.agents.engine_eval import spawned_engine
        from tkcc.frontend.models import DEFAULT_MODEL

        self.ctx = spawned_engine(self.args.model or DEFAULT_MODEL, self.args.device,
                                  extra=tuple(self.args.engine_arg) + compile_args(self.args),
                                  start_timeout_s=self.start_timeout_s,
                                  keep_temp=getattr(self.args, "keep_temp", False), stop_by=self.stop_by)
        self.client = self.ctx.__enter__()
        return self.client

    def __exit__(self, *exc):
        if self.ctx is not None:
            try:
                return self.ctx.__exit__(*exc)
            except Exception as e:  # noqa: BLE001 - stopping must not lose what the command did
                self.stop_error = f"stopping the engine failed: {type(e).__name__}: {e}"
                return False
        self.client.close()
        return False


def compile_args(args, ray_address: str | None = None) -> tuple[str, ...]:
    """``tkcc serve`` arguments for the engine's compile pool, kernel cache and validation, from the campaign's.
    ``--tolerance`` validates in tolerance mode unless ``--engine-arg`` says how (``tkcc.runtime.determinism``:
    ``auto`` would keep a bit-reproducible reference's tier exact and refuse every inexact pass)."""
    out: tuple[str, ...] = ()
    given = [a.split("=")[0] for a in getattr(args, "engine_arg", None) or ()]
    if getattr(args, "tolerance", False) and "--validation" not in given:
        out += ("--validation", "tolerance")
    if getattr(args, "compile_workers", None) is not None:
        if args.compile_workers < 0:
            raise TkccError(f"--compile-workers must be 0 or more, got {args.compile_workers}")
        out += ("--compile-workers", str(args.compile_workers))
    if getattr(args, "kernel_cache", None):
        out += ("--kernel-cache", str(Path(args.kernel_cache).resolve()))
    if ray_address:  # the engines' kernels compile as Ray tasks, on any node's CPUs
        out += ("--compile-executor", "ray", "--ray-address", ray_address)
    return out


def _workload_for(client, trace):
    from tkcc.traffic.buckets import workload_from_trace

    worker = client.status().get("worker") or {}
    cap = worker.get("max_cache_len")
    if not cap:
        raise TkccError("the engine's model has no KV cache length; campaigns need an LLM engine")
    return workload_from_trace(trace, max_context=int(cap), batch_sizes=(int(worker.get("batch") or 1),))


def _phases(workload, phases: str | None):
    """The workload with only ``--phases``' buckets measured (all when not given)."""
    if not phases:
        return workload
    want = [p.strip() for p in phases.split(",") if p.strip()]
    try:
        return workload.only(*want)
    except ValueError as e:
        raise TkccError(f"--phases {phases}: {e}") from None


def _search_space(args, device: str):
    from tkcc.agents.search import SearchSpace

    return SearchSpace.from_registry(exact_only=not args.tolerance, device=device)


def _proposer(args, client, evaluator):
    from tkcc.agents.search import BayesianSearch

    if args.proposer == "search":
        return BayesianSearch(_search_space(args, evaluator.device_type), seed=args.seed)
    from tkcc.agents.external import agent_for_engine

    if not args.agent_cmd:
        raise TkccError("--proposer agent needs --agent-cmd")

    return agent_for_engine(client, args.agent_cmd, Path(args.store).with_suffix(".agent"), notes=args.agent_notes,
                            time_limit_s=_seconds(args.agent_time_limit, "--agent-time-limit"))


def cmd_campaign(args):
    from tkcc.agents.budget import cost_estimates, up_front
    from tkcc.agents.campaign import CampaignConfig, run_campaign
    from tkcc.agents.summary import summary_of, summary_text
    from tkcc.agents.engine_eval import EngineEvaluator
    from tkcc.agents.noise import check_aa_pairs
    from tkcc.agents.store import ExperimentStore
    from tkcc.cli import builtin_models, command_started
    from tkcc.traffic.names import load_named_trace

    if args.tp != 1 and args.ray is None:
        raise TkccError(f"--tp {args.tp} goes with --ray (one tensor-parallel engine per Ray actor); a single "
                        f"engine campaign does not shard its candidates")

    started = command_started()
    budget = _seconds(args.budget, "--budget")
    check_aa_pairs(args.aa_pairs)
    if args.batch < 1:
        raise TkccError(f"--batch must be at least 1, got {args.batch}")
    if args.ahead < 0:
        raise TkccError(f"--ahead must be 0 or more, got {args.ahead}")
    tiers = tuple(args.tiers.split(","))
    reps = _reps(args, budget)
    trace = load_named_trace(args.trace, format=args.format)  # bad input fails before an engine starts
    store = ExperimentStore(args.store)
    model_name = str(args.model or builtin_models()[1])
    costs, source = cost_estimates(store, model_name, None if args.engine_socket else args.device)
    if args.engine_socket:
        costs.pop("startup", None)
    short = up_front(budget, costs, source, tiers[0], STOP_RESERVE_S)
    if short:  # said before an engine starts, so it costs nothing
        raise TkccError(short)
    # an engine that has not started by then is stopped half-way, which costs more than a normal stop
    left = budget - (time.monotonic() - started) - STOP_RESERVE_S - 1.0
    if args.ray is not None:
        return _campaign_on_ray(args, started, budget, tiers, reps, trace, store, costs, source, left)
    engine = _Engine(args, start_timeout_s=max(1.0, left), stop_by=started + budget - SUMMARY_S)
    if args.proposer == "search":  # the passes load (torch, the registry) while the engine starts in its process
        threading.Thread(target=_search_space, args=(args, args.device), daemon=True).start()
    try:
        client = engine.__enter__()
    except TkccError as e:
        if "not ready within" in str(e):
            raise TkccError(f"the budget of {budget:.0f} s is too short to try any candidate: the engine did not "
                            f"start within it ({e})") from None
        raise
    try:
        workload = _phases(_workload_for(client, trace), getattr(args, "phases", None))
        ev = EngineEvaluator(client, workload, pass_modules=args.pass_module, reps=reps,
                             keep_artifacts=_artifacts_dir(args.store))
        model = ev.model or args.model
        name = args.name or f"{model}-{time.strftime('%Y%m%d-%H%M%S')}"
        cfg = CampaignConfig(name=name, model=str(model), budget_s=budget, tiers=tiers, batch=args.batch,
                             aa_pairs=args.aa_pairs, resume=args.resume, started=started, reserve_s=STOP_RESERVE_S,
                             ahead=args.ahead,
                             extra={"trace": str(args.trace), "objective": workload.objective, "device": args.device,
                                    "reps": reps, "buckets": [b.__dict__ for b in workload.buckets]})
        state = run_campaign(cfg, store, _proposer(args, client, ev), ev, progress=not args.no_progress,
                             costs=costs, costs_source=source)
    finally:
        engine.__exit__(None, None, None)
    out = summary_of(store, state)
    out.update(store=str(store.path), wall_s=round(time.monotonic() - started, 1), device=ev.device,
               experiments=len(store.experiments(state.campaign_id)), ships=store.ships(state.campaign_id),
               log=state.log[-40:], reps=reps)
    if engine.stop_error:
        out["engine_stop"] = engine.stop_error
    out["text"] = summary_text(out, ev.device) + f"\nstore {store.path}; report: tkcc report {name} --store {args.store}"
    return out


def _campaign_on_ray(args, started, budget, tiers, reps, trace, store, costs, source, left):
    """`tkcc campaign --ray`: the same campaign over a pool of engine actors (``tkcc.agents.ray_pool``)."""
    try:
        import ray
    except ImportError:
        raise TkccError("--ray needs Ray: pip install 'tkcc[ray]'") from None
    import sys

    from tkcc.agents.campaign import CampaignConfig, run_campaign
    from tkcc.agents.ray_pool import RayEvaluator, init_ray
    from tkcc.agents.summary import summary_of, summary_text
    from tkcc.frontend.models import DEFAULT_MODEL

    if args.engine_socket or args.proposer != "search":
        raise TkccError("--ray starts its own engines and feeds them from the built-in search: it takes neither "
                        "--engine-socket nor --proposer agent")
    gpu = not str(args.device).startswith("cpu")
    if args.engines is not None and args.engines < 1:
        raise TkccError(f"--engines must be at least 1, got {args.engines}")
    if args.tp < 1:
        raise TkccError(f"--tp must be at least 1, got {args.tp}")
    # a local cluster: every core, so the engines' kernel compiles have CPUs to run on beside the engines
    ours = init_ray(args.ray or None, num_cpus=max((args.engines or 2) * args.tp + 1, os.cpu_count() or 1))
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        k = args.engines or (gpus // args.tp if gpu else 2)
        if k < 1:
            raise TkccError(f"--ray on {args.device}: the Ray cluster has {gpus} GPU(s), fewer than one engine of "
                            f"--tp {args.tp} needs; pass --engines" if gpus else
                            f"--ray on {args.device}: the Ray cluster has no GPU; pass --engines")
        address = ray.get_runtime_context().gcs_address if args.compile_workers != 0 else None
        ev = RayEvaluator(args.model or DEFAULT_MODEL, k, lambda c: _phases(_workload_for(c, trace), args.phases),
                          device=args.device, extra=tuple(args.engine_arg) + compile_args(args, address),
                          reps=reps, pass_modules=args.pass_module,
                          gpus_per_engine=1.0 if gpu else 0.0, tp=args.tp, start_timeout_s=max(1.0, left),
                          out=None if args.no_progress else (lambda m: print(m, file=sys.stderr)))
        try:
            name = args.name or f"{ev.model}-{time.strftime('%Y%m%d-%H%M%S')}"
            cfg = CampaignConfig(name=name, model=str(ev.model), budget_s=budget, tiers=tiers,
                                 batch=max(args.batch, k), aa_pairs=args.aa_pairs, resume=args.resume,
                                 started=started, reserve_s=STOP_RESERVE_S, ahead=args.ahead,
                                 extra={"trace": str(args.trace), "objective": ev.workload.objective,
                                        "device": args.device, "reps": reps, "ray": args.ray or "local",
                                        "tp": args.tp,
                                        "engines": ev.engines(),
                                        "buckets": [b.__dict__ for b in ev.workload.buckets]})
            state = run_campaign(cfg, store, _proposer(args, None, ev), ev, progress=not args.no_progress,
                                 costs=costs, costs_source=source)
            engines = ev.engines()
        finally:
            ev.close()
    finally:
        if ours:
            ray.shutdown()
    rows = store.experiments(state.campaign_id)
    out = summary_of(store, state)
    out.update(store=str(store.path), wall_s=round(time.monotonic() - started, 1), device=ev.device,
               experiments=len(rows), ships=store.ships(state.campaign_id), log=state.log[-40:], reps=reps,
               engines={n: {"pid": i["pid"], "host": i["host"], "device": i["device"], "tp": i["tp"],
                            "placement": i["placement"],
                            "experiments": sum(r.engine == n for r in rows)} for n, i in engines.items()},
               engine_deaths=ev.deaths)
    out["text"] = (summary_text(out, ev.device) + f"\n{k} engines on Ray: "
                   + ", ".join(f"{n} {sum(r.engine == n for r in rows)} rows" for n in sorted({r.engine for r in rows
                                                                                                if r.engine}))
                   + f"\nstore {store.path}; report: tkcc report {name} --store {args.store}")
    return out


def _artifacts_dir(store_path) -> Path:
    """Where a store keeps its candidates' pass logs and generated source (beside the store)."""
    p = Path(store_path)
    return p.with_name(p.name + ".artifacts")


def cmd_watch(args):
    import sys

    from tkcc.agents.engine_eval import EngineEvaluator
    from tkcc.agents.search import BayesianSearch, SearchSpace
    from tkcc.agents.store import ExperimentStore
    from tkcc.agents.watch import watch
    from tkcc.traffic.follow import RollingWorkload

    budget = _seconds(args.budget, "--budget")
    if args.min_requests < 1:
        raise TkccError(f"--min-requests must be at least 1, got {args.min_requests}")
    if not args.poll > 0:
        raise TkccError(f"--poll must be positive, got {args.poll}")
    path = Path(args.trace_stream)
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.is_file()), key=lambda p: p.stat().st_mtime)
        if not files:
            raise TkccError(f"--trace-stream {path}: the folder has no files yet")
        path = files[-1]
    if not path.exists():
        raise TkccError(f"--trace-stream {path} does not exist")
    rolling = RollingWorkload(path, horizon=args.horizon, format=args.format, min_reopt_requests=args.min_requests)
    reps = _reps(args, budget)
    ship_to = None
    if args.serve:  # a live server: each ship/revert is also swapped into it (tkcc.serve.swap)
        from tkcc.serve.swap import AdminClient

        live = AdminClient(args.serve, token_file=args.serve_token_file)
        live.status()  # fail now on a wrong URL or token, not at the first ship
        ship_to = live.ship

    def make_ev(client, wl):
        ev = EngineEvaluator(client, wl, pass_modules=args.pass_module, reps=reps, keep_artifacts=keep)
        if ship_to is None:
            return ev
        from tkcc.serve.swap import ShippingEvaluator

        return ShippingEvaluator(ev, ship_to)

    events: list = []  # filled as they happen: neither an interrupt nor a failing engine stop loses them
    on_event = None if args.no_progress else (lambda e: print(e.line(), file=sys.stderr, flush=True))
    interrupted = False
    store = ExperimentStore(args.store)  # a bad store is refused before an engine starts
    keep = _artifacts_dir(args.store)
    engine = _Engine(args)
    client = engine.__enter__()
    try:
        worker = client.status().get("worker") or {}
        wk = {"max_context": int(worker.get("max_cache_len") or 4096), "batch_sizes": (int(worker.get("batch") or 1),)}
        model = str((client.status().get("engine") or {}).get("model") or args.model)
        watch(rolling, lambda wl: make_ev(client, wl),
              lambda: BayesianSearch(SearchSpace.from_registry(exact_only=not args.tolerance,
                                                               device=str(worker.get("device", "cpu"))),
                                     seed=args.seed),
              store, name=args.name or f"watch-{model}", model=model, budget_s=budget,
              min_requests=args.min_requests, poll_s=args.poll, max_polls=args.polls, workload_kwargs=wk,
              progress=not args.no_progress, on_event=on_event, events=events)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        engine.__exit__(None, None, None)
    evs = [{"time": e.time, "kind": e.kind, **e.detail} for e in events]
    out = {"events": evs, "store": args.store, "polls": len(events), "interrupted": interrupted,
           "text": "\n".join(e.line() for e in events) or "no polls"}
    if engine.stop_error:
        out["engine_stop"] = engine.stop_error
        out["text"] += f"\n{engine.stop_error}"
    return out


def cmd_report(args):
    from tkcc.agents.report import write_report

    if not os.path.exists(args.store):
        raise TkccError(f"no experiment store at {args.store}")
    out = args.out or f"{args.campaign}.html"
    path = write_report(args.store, args.campaign, out)
    return {"report": str(path), "text": f"wrote {path}"}
