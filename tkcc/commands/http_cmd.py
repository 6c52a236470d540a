"""`tkcc serve --http ADDR --model M [--artifact DIR]`: the OpenAI-compatible server, from the shell.

``tkcc serve`` without ``--http`` is the engine's RPC harness
(``tkcc.commands.engine_cmd``); that parser calls ``add_http_args`` for these flags
and hands over to ``cmd_http`` when ``--http`` is given. The server itself is
``tkcc.serve``; this module builds its forwards (``http_forwards``) and starts it. Importing this
module imports nothing heavy: the server's libraries load in ``cmd_http``.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from tkcc.errors import TkccError


def add_http_args(p) -> None:
    g = p.add_argument_group("OpenAI HTTP server (tkcc serve --http ADDR; see docs/serve.md)")
    g.add_argument("--http", default=None, metavar="ADDR",
                   help="serve the OpenAI API on HOST:PORT (e.g. 127.0.0.1:8000; loopback unless --allow-remote) "
                        "instead of the engine's RPC")
    g.add_argument("--artifact", default=None, help="serve this saved artifact (tkcc.load) instead of compiling")
    g.add_argument("--plan", default=None, help="pass plan to compile and serve (JSON or file; default: the "
                                                "default plan)")
    g.add_argument("--mode", default=None, choices=["exact", "tolerance"],
                   help="compile mode of the plans built and searched while serving (default: --artifact's own "
                        "mode, else exact)")
    g.add_argument("--tokenizer", default=None, help="HF tokenizer directory (default: the model directory's; "
                                                     "built-in models: bytes)")
    g.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --model's)")
    g.add_argument("--api-key", default=os.environ.get("TKCC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default $TKCC_API_KEY; none: open)")
    g.add_argument("--admin-token-file", default=None,
                   help="where the admin token (for /admin/swap) is written, 0600 (default: in --trace-out)")
    g.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 429 (default 64)")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: the KV cache)")
    g.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted (default 4096)")
    g.add_argument("--max-prompts", type=int, default=16, help="prompts in one completions request (default 16)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds from arrival to the last token, queue included (default 600)")
    g.add_argument("--trace-out", default="tkcc-traffic", help="folder of the rolling trace of served requests "
                                                              "(default ./tkcc-traffic)")
    g.add_argument("--no-record", action="store_true", help="do not record the served traffic")
    g.add_argument("--trace-rotate", type=int, default=100_000, help="requests per trace file (default 100000)")
    g.add_argument("--trace-keep", type=int, default=10, help="trace files kept (default 10)")
    g.add_argument("--moe-counts", default="all", choices=["all", "idle", "off"],
                   help="take each request's per-layer MoE expert counts: for every request, only when no request "
                        "waits, or never (default all; the cost is tkcc_moe_count_seconds in /metrics)")
    g.add_argument("--watch", action="store_true",
                   help="re-optimise on drift of the recorded traffic (an engine beside the server measures) and "
                        "hot-swap each shipped candidate in")
    g.add_argument("--watch-budget", default="5m", help="budget of each re-optimisation (default 5m)")
    g.add_argument("--watch-horizon", default="10m", help="rolling window of traffic (default 10m)")
    g.add_argument("--watch-poll", type=float, default=5.0, help="seconds between reads of the trace (default 5)")
    g.add_argument("--watch-min-requests", type=int, default=200, help="requests before deciding (default 200)")
    g.add_argument("--watch-store", default="tkcc-campaigns.db", help="experiment store (default tkcc-campaigns.db)")
    g.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")


def cmd_http(args):
    """Build the forward, start the scheduler and uvicorn on ADDR, serve until SIGINT/SIGTERM."""
    t0 = time.perf_counter()
    from tkcc.serve.runner import bind, parse_address

    host, port = parse_address(args.http)
    if args.batch < 1:
        raise TkccError(f"--batch {args.batch}: the sequences served together must be at least 1")
    for flag, v in (("--max-queue", args.max_queue), ("--max-tokens-limit", args.max_tokens_limit - 1),
                    ("--max-prompts", args.max_prompts - 1), ("--request-timeout", args.request_timeout)):
        if v < 0:
            raise TkccError(f"{flag}: must be {'positive' if flag != '--max-queue' else '>= 0'}")
    sock = bind(host, port, allow_remote=args.allow_remote)  # fail on the address before minutes of compiling
    server = watcher = None
    try:
        server, info = _build_server(args)
        if args.watch:
            from tkcc.serve.watching import ServeWatch

            watcher = server.watcher = ServeWatch(server, args).start()
        _serve_forever(args, server, info, sock, t0)
    finally:
        if watcher is not None:
            watcher.stop()
        if server is not None:
            server.close()
        sock.close()
    if not args.json:
        print("tkcc serve: stopped", file=sys.stderr)
    return 0


def _serve_forever(args, server, info, sock, t0) -> None:
    """Print the ready line, run uvicorn on ``sock`` until SIGINT/SIGTERM (graceful: open responses finish)."""
    from tkcc.serve.runner import uvicorn_server

    h, p = sock.getsockname()[:2]
    url = f"http://{h if ':' not in h else f'[{h}]'}:{p}"
    ready = {"ready": True, "url": url, "model": server.model_name, "forward": server.scheduler.current.tag,
             "batch": server.scheduler.slots,
             "device": info["device"], "dtype": info["dtype"], "trace": str(server.recorder.path)
             if server.recorder else None, "admin_token_file": info["admin_token_file"],
             "api_key": bool(server.api_key), "watch": bool(args.watch), "moe_counts": server.scheduler.moe_counts,
             "decode_graph": info.get("decode_graph"),
             "startup_s": round(time.perf_counter() - t0, 2), "pid": os.getpid()}
    if args.json:
        print(json.dumps(ready), flush=True)
    else:
        print(f"tkcc serve: {server.model_name} ({info['dtype']} on {info['device']}), forward {ready['forward']}, "
              f"OpenAI API on {url}/v1; trace {ready['trace']}; admin token in {info['admin_token_file']}; "
              f"started in {ready['startup_s']} s", flush=True)
    uv = uvicorn_server(server.app, log_level=args.log_level, max_connections=4 * (args.max_queue + 1) + 64)

    def _stop(signum, frame):
        uv.should_exit = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    http = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="tkcc-serve-http")
    http.start()  # off the main thread, so uvicorn leaves the signals to us
    while http.is_alive():
        http.join(0.5)


def _serving_mode(args, compiled) -> str:
    """The mode plans are built and searched in: ``--mode``, else an artifact's own (a watcher in exact mode
    could neither propose a tolerance artifact's passes nor hold its plan to their bound)."""
    if not args.artifact:
        return args.mode or "exact"
    built = compiled.report(print_report=False).mode or "exact"
    if args.mode == "exact" and built == "tolerance":
        raise TkccError(f"--mode exact: --artifact {args.artifact} was compiled in tolerance mode (its passes "
                        "change rounding); serve it with --mode tolerance, or leave --mode out")
    return args.mode or built


def _build_server(args):
    from tkcc.runtime.programs import check_device, parse_dtype
    from tkcc.runtime.protocol import write_secret
    from tkcc.serve.app import Limits
    from tkcc.commands.http_forwards import ForwardBuilder, load_model
    from tkcc.serve.server import Server
    from tkcc.serve.tokenizer import load_tokenizer

    device = check_device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    model, name, tok_dir = load_model(args.model, parse_dtype(dtype_name), device)
    builder = ForwardBuilder(model, max_cache_len=args.max_cache_len, mode=args.mode or "exact", batch=args.batch)
    plan = None
    if args.plan:
        from tkcc.passes.default_plan import resolve_plan

        plan = resolve_plan(args.plan, args.mode or "exact")
    # an inexact plan is golden-checked before it serves, as every later ship of one is
    compiled, tag = builder.first(plan=plan, artifact=args.artifact, check=args.mode == "tolerance")
    args.mode = builder.mode = _serving_mode(args, compiled)
    vocab = int(compiled.program.meta["vocab_size"])
    tokenizer = load_tokenizer(args.tokenizer or tok_dir, vocab)
    limits = Limits(max_body_bytes=args.max_request_bytes, max_prompt_tokens=args.max_prompt_tokens,
                    max_tokens=args.max_tokens_limit, max_prompts=args.max_prompts,
                    request_timeout_s=args.request_timeout)
    trace_dir = None if args.no_record else args.trace_out
    server = Server(compiled, model_name=args.served_model_name or name, tokenizer=tokenizer, tag=tag,
                    limits=limits, api_key=args.api_key, trace_dir=trace_dir, moe_counts=args.moe_counts,
                    max_queue=args.max_queue, builder=builder, rotate_requests=args.trace_rotate,
                    keep_files=args.trace_keep)
    token_file = args.admin_token_file or os.path.join(trace_dir or ".", "admin.token")
    os.makedirs(os.path.dirname(os.path.abspath(token_file)), exist_ok=True)
    write_secret(token_file, server.admin_token)
    server.start()
    graph = server.warm_up()  # before the first request: compiles, the decode step's CUDA graph (as a swap does)
    return server, {"device": device, "dtype": dtype_name, "admin_token_file": os.path.abspath(token_file),
                    "decode_graph": graph}
