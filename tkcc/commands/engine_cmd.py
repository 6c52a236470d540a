"""`tkcc serve`, `tkcc submit`, `tkcc engine status|stop|revert`: the engine from the command line."""
from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading

from tkcc.errors import EngineError, TkccError


def register(subparsers) -> None:
    from tkcc.cli import add_json_flag

    p = subparsers.add_parser("serve", help="start a persistent engine for one model on one device",
                              description="Build/load the model once and serve the engine's RPC API until stopped "
                                          "(tkcc engine stop). See docs/engine.md.")
    p.add_argument("--model", required=True, help="built-in model name (tkcc.frontend.models) or FILE.py:factory")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, help="float32|float16|bfloat16 (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--max-cache-len", type=int, default=None, help="KV cache length the model is captured with")
    p.add_argument("--batch", type=int, default=1, help="batch size the model is captured with (default 1; with "
                   "--http: requests decoded together, continuous batching)")
    p.add_argument("--fast-blocks", type=int, default=None,
                   help="blocks in the fast tier (default: a fifth of the model's, at least 1)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads of the worker (default: torch's)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: one engine rank per GPU (cuda:0..N-1), or N gloo processes on cpu; "
                        "the baseline is the model sharded N ways, candidates must shard with degree N (default 1)")
    for flag, choices, hlp in (  # the ways of validating and isolating candidates; "auto" lets the engine pick
            ("--validation", ("exact", "tolerance"),
             "how candidates are validated: exact (bitwise; refused at start-up if the model does not "
             "reproduce itself), tolerance (error bound relative to the output's scale plus greedy "
             "tokens), auto (default: exact per tier where the start-up probe finds the reference "
             "bitwise reproducible, else tolerance)"),
            ("--isolation", ("process", "inprocess"),
             "process: every candidate runs in a clean process forked from the worker, which keeps the "
             "clock, the reference and the checks; inprocess: candidates run in the worker, which "
             "audits its global state after each; auto (default): process on a CPU with one rank, "
             "else inprocess (a CUDA context does not survive fork). See docs/engine.md")):
        p.add_argument(flag, default="auto", choices=["auto", *choices], help=hlp)
    p.add_argument("--tolerance-safety", type=float, default=4.0,
                   help="tolerance mode: the error bound is this many times the reference's measured "
                        "self-disagreement (relative to the output's scale), never below the dtype floor (default 4)")
    _address_args(p, serving=True)
    p.add_argument("--allow-remote", action="store_true", help="allow --host to be a non-loopback address")
    p.add_argument("--journal", default=None, help="JSONL journal of results (default: next to the socket)")
    p.add_argument("--state-dir", default=None, help="folder for compiled candidates (default: next to the socket)")
    p.add_argument("--timeout", type=float, default=600.0, help="default seconds one operation may take (600)")
    p.add_argument("--worker-max-rss", type=float, default=0.0,
                   help="GiB of host memory the worker may use before it is restarted (default 0: its size after "
                        "start-up plus max(2 GiB, 4x the model and its KV cache))")
    p.add_argument("--trial-max-rss", type=float, default=0.0,
                   help="GiB a candidate's own process may write before it is killed (process isolation; default "
                        "0: max(1 GiB, 4x the model and its KV cache), at most half the machine)")
    p.add_argument("--device-max-mem", type=float, default=0.0,
                   help="GiB of GPU memory the worker's caching allocator may hold (a real cap: a candidate that "
                        "allocates past it fails as out of memory; device memory a candidate leaves behind is "
                        "charged to it). Default 0: derived, what the engine holds after start-up (weights, KV "
                        "cache, the reference's graphs) plus max(2 GiB, 2x the weights and cache, 2x the start-up's "
                        "transient peak), at most the device less max(1 GiB, 5%%)")
    p.add_argument("--kernel-cache", default=None,
                   help="shared, checksummed Triton kernel cache folder (default $TKCC_KERNEL_CACHE_DIR or "
                        "~/.cache/tkcc/triton): kernels compiled by any engine, tier, candidate or campaign")
    p.add_argument("--compile-workers", type=int, default=None,
                   help="processes compiling candidates' kernels ahead (default: the machine's cores on a GPU, "
                        "0 on a CPU engine, which compiles no Triton kernels)")
    p.add_argument("--compile-executor", default="local", choices=["local", "ray"],
                   help="where the compile pool runs: local processes, or Ray tasks on any node's CPUs")
    p.add_argument("--ray-address", default=None, help="Ray cluster for --compile-executor ray (default: local)")
    p.add_argument("--compile-target", default=None,
                   help="on a CPU engine, list and compile plan candidates' kernels for this GPU target "
                        "(e.g. cuda:90:32) with in-process isolation")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request accepted (1 MiB)")
    p.add_argument("--max-artifact-bytes", type=int, default=256 << 20, help="largest artifact/source loaded")
    from tkcc.commands.http_cmd import add_http_args

    add_http_args(p)  # `tkcc serve --http ADDR`: the OpenAI server instead of the RPC (tkcc.serve)
    add_json_flag(p)
    p.set_defaults(func=cmd_serve)

    s = subparsers.add_parser("submit", help="run one candidate through a running engine (validate, swap, measure)",
                              description="Submit a candidate (plan, artifact or source file) to a running engine: "
                                          "it is compiled per tier, validated, swapped in, measured on the "
                                          "workload, and swapped back out unless --keep.")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", help="pass plan: a JSON file or a JSON string")
    what.add_argument("--artifact", help="prebuilt artifact folder (one tier)")
    what.add_argument("--source", help="Python file defining build(program) -> {phase: callable}")
    what.add_argument("--baseline", action="store_true", help="the captured, un-rewritten forward")
    s.add_argument("--pass-module", action="append", default=[], help="Python file with user passes (repeatable)")
    s.add_argument("--tier", default="both", choices=["fast", "slow", "both"])
    s.add_argument("--trace", help="trace file or bundled trace name: the workload is built from it for this "
                                   "engine's model")
    s.add_argument("--format", default=None, help="trace format (default: detected)")
    s.add_argument("--workload", help="workload JSON file (as written by --save-workload)")
    s.add_argument("--save-workload", help="write the workload used to this JSON file")
    s.add_argument("--keep", action="store_true", help="leave the candidate serving after measuring")
    s.add_argument("--reps", type=int, default=30, help="timed repetitions per bucket (default 30)")
    s.add_argument("--warmup", type=int, default=5)
    s.add_argument("--timeout", type=float, default=None, help="seconds each step may take (engine default)")
    s.add_argument("--request-id", default=None, help="id to find this result later in the journal")
    _address_args(s)
    add_json_flag(s)
    s.set_defaults(func=cmd_submit)

    e = subparsers.add_parser("engine", help="talk to a running engine: status, stop, revert")
    esub = e.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    for name, fn, hlp in (("status", cmd_status, "what the engine serves, its tiers, memory, restarts"),
                          ("stop", cmd_stop, "stop the engine (and its worker)"),
                          ("revert", cmd_revert, "put back the forward that served before the last swap"),
                          ("results", cmd_results, "journaled results (experiments, failures, recoveries)")):
        q = esub.add_parser(name, help=hlp)
        if name == "revert":
            q.add_argument("--tier", default="slow", choices=["fast", "slow"])
        if name == "results":
            q.add_argument("--since", type=int, default=0, help="only records after this sequence number")
            q.add_argument("--request-id", default=None)
            q.add_argument("--kind", default=None, help="experiment|recovery|swap|revert|accepted|...")
        _address_args(q)
        add_json_flag(q)
        q.set_defaults(func=fn)


def _device_max_bytes(gib: float, device: str) -> int:
    """--device-max-mem GiB in bytes, refused here if it makes no sense (before any engine starts)."""
    from tkcc.runtime.supervisor import check_device_max

    if not gib >= 0:
        raise EngineError(f"--device-max-mem {gib:g}: must be 0 (derived from the device and the model) or a "
                          "positive number of GiB")
    return check_device_max(int(gib * (1 << 30)), device)


def _address_args(p, serving: bool = False) -> None:
    p.add_argument("--socket", default=None, help="Unix socket path (default $TKCC_ENGINE_SOCKET or "
                                                  "/tmp/tkcc-<uid>/engine.sock)")
    p.add_argument("--host", default=None, help="listen/connect on TCP instead (loopback unless --allow-remote)")
    p.add_argument("--port", type=int, default=0 if serving else None, help="TCP port (serve: 0 picks a free one)")
    p.add_argument("--token-file", default=None, help="file holding the engine's token (default <socket>.token)")
    if not serving:
        p.add_argument("--token", default=None, help="the engine's token (else read from --token-file)")


def _client(args):
    from tkcc.runtime.client import EngineClient

    if args.host and args.port is None:
        raise EngineError("--host needs --port")
    return EngineClient(socket_path=args.socket, host=args.host, port=args.port, token=args.token,
                        token_file=args.token_file)


# ------------------------------------------------------------------- serve
def cmd_serve(args):
    if getattr(args, "http", None):
        from tkcc.commands.http_cmd import cmd_http

        return cmd_http(args)
    from tkcc.runtime import protocol
    from tkcc.runtime.journal import Journal
    from tkcc.runtime.server import EngineServer
    from tkcc.runtime.supervisor import Supervisor

    if args.host is None and args.port:
        raise EngineError("--port needs --host (e.g. --host 127.0.0.1); without them the engine uses a Unix socket")
    dtype = args.dtype or ("bfloat16" if str(args.device).startswith("cuda") else "float32")
    _check_tp(args.tp, args.device)
    for flag, gib in (("--worker-max-rss", args.worker_max_rss), ("--trial-max-rss", args.trial_max_rss)):
        if not gib >= 0:
            raise EngineError(f"{flag} {gib:g}: must be 0 (derived from the machine and the model) or a positive "
                              "number of GiB")
    if not args.tolerance_safety >= 1.0:
        raise EngineError(f"--tolerance-safety {args.tolerance_safety}: must be at least 1 (a bound below the "
                          "measured self-disagreement would reject the baseline against itself)")
    if args.host is None:
        sock = os.path.abspath(args.socket or protocol.default_socket_path())
        base = sock
    else:
        sock = None
        base = os.path.join(f"/tmp/tkcc-{os.getuid()}", f"engine-tcp-{args.host}-{args.port}")
        os.makedirs(os.path.dirname(base), mode=0o700, exist_ok=True)
    state_dir = args.state_dir or (base + ".state")
    cfg = {"model": args.model, "device": args.device, "dtype": dtype, "max_cache_len": args.max_cache_len,
           "batch": args.batch, "fast_blocks": args.fast_blocks, "state_dir": state_dir,
           "work_dir": os.path.join(state_dir, "candidates"), "timeout_s": args.timeout,
           "worker_max_rss_bytes": int(args.worker_max_rss * (1 << 30)), "isolation": args.isolation,
           "trial_max_bytes": int(args.trial_max_rss * (1 << 30)),
           "device_max_bytes": _device_max_bytes(args.device_max_mem, args.device),
           "max_artifact_bytes": args.max_artifact_bytes, "threads": args.threads, "tp": args.tp,
           "validation": args.validation, "tolerance_safety": args.tolerance_safety,
           "compile_workers": args.compile_workers, "compile_executor": args.compile_executor,
           "ray_address": args.ray_address, "compile_target": args.compile_target}
    if args.kernel_cache:
        cfg["kernel_cache"] = os.path.abspath(args.kernel_cache)
    sup = Supervisor(cfg, Journal(args.journal or (base + ".journal.jsonl")))
    server = EngineServer(sup, secrets.token_hex(32), socket_path=sock, host=args.host, port=args.port,
                          allow_remote=args.allow_remote, max_request_bytes=args.max_request_bytes)
    try:
        info = sup.start()
    except BaseException:
        server.stop()
        raise
    token_file = args.token_file or (protocol.token_path_for(sock) if sock else base + ".token")
    protocol.write_secret(token_file, server.token)
    ready = {"ready": True, "address": server.address, "token_file": token_file, "journal": sup.journal.path,
             "pid": os.getpid(), "worker_pid": info.get("pid"), "model": args.model, "device": cfg["device"],
             "dtype": dtype, "tiers": {t: v["blocks"] for t, v in info["tiers"].items()},
             "startup_s": info.get("worker_start_s"), "tp": args.tp,
             "validation": {t: v.get("validation") for t, v in info["tiers"].items()},
             "isolation": (info.get("isolation") or {}).get("mode"), "worker_max_rss_bytes": sup.max_rss,
             "device_max_bytes": sup.device_max()}
    if args.tp > 1:
        ready["rank_pids"] = [r["pid"] for r in info.get("ranks", [])]
    if args.host is not None:
        ready["token"] = server.token  # TCP clients on other shells need it; it is also in token_file (0600)
    if args.json:
        print(json.dumps(ready), flush=True)
    else:
        where = server.address.get("socket") or f"{server.address['host']}:{server.address['port']}"
        tp = f" x{args.tp} ranks (tensor parallel)" if args.tp > 1 else ""
        print(f"tkcc engine ready: {args.model} on {cfg['device']}{tp} ({dtype}), tiers {ready['tiers']}, listening on "
              f"{where}; token in {token_file}; started in {ready['startup_s']:.1f} s", flush=True)
        for t, v in ready["validation"].items():
            if v:
                print(f"  {t} tier validation: {v.get('why')}", flush=True)

    def _stop(signum, frame):
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        server.serve_forever()
    finally:
        server.stop()
        sup.journal.close()
    if not args.json:
        print("tkcc engine stopped", file=sys.stderr)
    return 0


def _check_tp(tp: int, device: str) -> None:
    """--tp N: at least 1, ranks on cuda:0..N-1 (or gloo on cpu), no more ranks than devices; before anything starts."""
    if tp < 1:
        raise EngineError(f"--tp {tp}: the tensor-parallel degree must be at least 1")
    if tp == 1:
        return
    from tkcc.parallel.launch import check_world
    from tkcc.parallel.layout import LayoutError

    dev = str(device)
    if dev.startswith("cuda") and dev not in ("cuda", "cuda:0"):
        raise EngineError(f"--tp {tp} --device {dev}: tensor-parallel ranks use cuda:0..cuda:{tp - 1}; "
                          "pass --device cuda (restrict GPUs with CUDA_VISIBLE_DEVICES)")
    if not dev.startswith(("cuda", "cpu")):
        raise EngineError(f"--tp {tp} --device {dev}: tensor parallelism runs on cuda (NCCL) or cpu (gloo)")
    try:
        check_world(tp, "nccl" if dev.startswith("cuda") else "gloo")
    except LayoutError as e:
        raise EngineError(f"--tp {tp}: {e}") from None


# ------------------------------------------------------------------ submit
def _candidate(args) -> dict:
    if args.baseline:
        return {"baseline": True}
    if args.plan:
        from tkcc.passes.plan import PassPlan

        text = args.plan
        if os.path.isfile(text):
            with open(text) as f:
                text = f.read()
        elif text.strip()[:1] not in ("[", "{", '"') and (text.strip().endswith(".json") or "/" in text):
            raise EngineError(f"--plan {text!r}: no such file (a plan is a JSON file or JSON text)")
        plan = PassPlan.from_json(text)
        cand = {"plan": plan.to_json()}
    elif args.artifact:
        cand = {"artifact": args.artifact}
    else:
        cand = {"source": args.source}
    if args.pass_module:
        cand["pass_modules"] = args.pass_module
    return cand


def _workload(args, client):
    from tkcc.runtime.workloads import workload_to_json

    if args.workload and args.trace:
        raise EngineError("give --workload or --trace, not both")
    if args.workload:
        try:
            with open(args.workload) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise EngineError(f"--workload {args.workload}: {e}") from None
    if args.trace:
        from tkcc.traffic.buckets import workload_from_trace
        from tkcc.traffic.names import load_named_trace

        st = client.status()
        worker = st.get("worker") or {}
        cap = worker.get("max_cache_len")
        if not cap:
            raise EngineError("the engine's model has no KV cache length; pass --workload for it")
        trace = load_named_trace(args.trace, format=args.format)
        w = workload_from_trace(trace, max_context=int(cap), batch_sizes=(int(worker.get("batch") or 1),))
        return workload_to_json(w)
    return None


def cmd_submit(args):
    client = _client(args)
    with client:
        workload = _workload(args, client)
        if args.save_workload and workload is not None:
            with open(args.save_workload, "w") as f:
                json.dump(workload, f, indent=1)
        kw = {}
        if args.timeout is not None:
            kw["timeout_s"] = args.timeout
        res = client.experiment(_candidate(args), tiers=args.tier, workload=workload, keep=args.keep, reps=args.reps,
                                warmup=args.warmup, request_id=args.request_id, **kw)
    res["text"] = _experiment_text(res)
    return res


def _experiment_text(res: dict) -> str:
    from tkcc.runtime.measurement import Measurement

    name = res.get("candidate") or "(not loaded)"  # a candidate refused before it loaded has no id
    lines = [f"candidate {name}: {'ok' if res.get('ok') else 'FAILED: ' + str(res.get('reason'))}"
             f" (journal seq {res.get('seq')}, request {res.get('request_id')})"]
    for tier, rec in res.get("tiers", {}).items():
        v = rec.get("validation") or {}
        bound = f" (error <= {v['tolerance']['bound']:.3g} of output scale)" if v.get("tolerance") else ""
        lines.append(f"[{tier}] {rec.get('seconds', 0):.2f} s" + (f", validation {v['mode']}{bound} ok" if v.get("ok") else ""))
        if rec.get("swap"):
            lines.append(f"  swap {rec['swap']['swap_s'] * 1e3:.2f} ms, capture {rec['swap']['capture_s']:.3f} s "
                         f"({rec['swap']['graphs']} graphs)")
        if rec.get("measurement"):
            lines.append("  " + Measurement.from_json(rec["measurement"]).summary().replace("\n", "\n  "))
    return "\n".join(lines)


# ------------------------------------------------------------------ engine
def cmd_status(args):
    with _client(args) as c:
        st = c.status()
    w = st.get("worker") or {}
    eng = st["engine"]
    lines = [f"engine pid {eng['pid']} (worker {eng.get('worker_pid')}): {eng['model']} on {eng['device']}, "
             f"up {eng['uptime_s']:.0f} s, {eng['restarts']} restart(s)"]
    if w.get("ranks"):
        lines.append(f"  tensor parallel: {len(w['ranks'])} ranks, pids {[r['pid'] for r in w['ranks']]}, "
                     f"baseline strategy {(w.get('tp') or {}).get('strategy')}")
    for t, info in (w.get("tiers") or {}).items():
        lines.append(f"  {t}: {info['blocks']} blocks, serving {info['current']}, history {info['history']}")
        if info.get("validation"):
            lines.append(f"    validation {info['validation'].get('why')}")
    mem = w.get("memory") or {}
    if mem:
        lines.append(f"  memory: model {mem.get('model_bytes', 0) / 2**20:.1f} MiB, cache "
                     f"{mem.get('cache_bytes', 0) / 2**20:.1f} MiB"
                     + (f", device allocated {mem['allocated_bytes'] / 2**20:.1f} MiB" if "allocated_bytes" in mem
                        else f", rss {mem.get('rss_bytes', 0) / 2**20:.1f} MiB"))
    for r in eng.get("recoveries", []):
        lines.append(f"  recovered in {r['recovery_s']:.2f} s: {r['reason']}")
    st["text"] = "\n".join(lines)
    return st


def cmd_stop(args):
    with _client(args) as c:
        res = c.shutdown()
    res["text"] = "engine stopping"
    return res


def cmd_revert(args):
    with _client(args) as c:
        res = c.revert(tier=args.tier)
    res["text"] = f"{args.tier} tier: reverted {res['reverted']}, now serving {res['current']}"
    return res


def cmd_results(args):
    with _client(args) as c:
        res = c.results(since=args.since, request_id=args.request_id, kind=args.kind)
    keys = ("candidate", "ok", "reason", "recovery_s", "tier", "request_id")
    res["text"] = "\n".join(f"{r['seq']:>6} {r['kind']:<12} {json.dumps({k: r[k] for k in keys if k in r})}"
                            for r in res["records"])
    return res


__all__ = ["register", "TkccError"]
