"""Serving benchmark: `tkcc serve --http` driven by a replayed real trace, measured as `vllm bench serve` does.

The server is started through the front door (`python -m tkcc.cli serve --http 127.0.0.1:0 ...`, a
subprocess) and driven on loopback by a bounded load generator (aiohttp, streaming completions with
token-id prompts): every request is sent at its trace arrival time divided by the rate factor, with the
trace's input and output lengths (clipped to the KV cache; the clipped share is reported). Per request:
TTFT (send to first token), ITL (gaps between tokens), TPOT ((E2E - TTFT) / (out - 1)) and E2E; reported
as mean, median, P90 and P99 over the run.

Phases, per model:
1. single stream: sequential requests at one context; TPOT against the serving forward's decode step at
   the same context, timed in the server between requests by the runtime's clock (`/admin/measure`).
2. load: Azure conv arrivals time-scaled by a ladder of rate factors; the largest factor whose P90 TTFT
   stays under 1 s.
3. cost of measuring: the same steady load, idle and while `tkcc campaign` measures candidates on the
   same device (P90 TPOT both ways).
4. drift run: Azure conv, then a long-context ServeGen client, on a server started with `--watch` (it
   sees the drift in its own trace, re-optimises with an engine beside it and hot-swaps what ships),
   paced at `--drift-util` of the capacity measured for each trace's requests on the first server; the
   benchmark also re-ships what serves every `--swap-every` completions (`/admin/swap`: a new build
   swapped in while requests run) so the run holds several swaps whatever the campaigns decide. Failed =
   any request without a 200 and its max_tokens (429s included). TPOT per stretch between swaps and
   while the watcher's engine measures against idle say where a slow TPOT came from.

TPOT is vLLM's ((E2E - TTFT) / (out - 1)); see ``summarize``. `--phases` runs a subset (the rest is kept
from what --out holds for the model).

  PYTHONPATH=. python benchmarks/serve.py --model llama-1b-16l --out benchmarks/results/serve.json   # H200
  PYTHONPATH=. python benchmarks/serve.py --model olmoe-16l --out benchmarks/results/serve.json      # adds a run
  PYTHONPATH=. python benchmarks/serve.py --smoke                                                   # CPU, < 2 min

Batching (``--batching``, alone): one saturated set of Azure conv requests served at batch 1 and at each B of
``--batches`` (``tkcc serve --http --batch B``, or ``--in-process``: the server's ForwardBuilder and Scheduler
without HTTP, so no serve wheels are needed): output tokens/s, TTFT/TPOT/ITL/E2E per request, the throughput
ratio to batch 1, and a few requests served again alone that must get the same tokens.

  PYTHONPATH=. python benchmarks/serve.py --batching --model llama-1b-16l                 # H200, HTTP
  PYTHONPATH=. python benchmarks/serve.py --batching --model llama-1b-16l --in-process    # H200, no HTTP
  PYTHONPATH=. python benchmarks/serve.py --batching --smoke [--in-process]               # CPU, < 1 min

serve.json: {"runs": [one object per model: model, single_stream_tpot_ms, engine_step_ms, drift_run
{requests, failed, swaps, p90_tpot_ms_before, p90_tpot_ms_after, ...}, load {factor: {ttft_ms, tpot_ms,
itl_ms, e2e_ms: {mean, median, p90, p99}, ...}}, max_rate_factor_p90_ttft_under_1s, campaign_cost,
measured_on]}; a run replaces the earlier run of the same model.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tkcc.serve.swap import AdminClient  # noqa: E402
from tkcc.traffic.loaders import bundled_trace, load_trace  # noqa: E402

T0 = time.time()


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:5.0f}s]", *a, flush=True)


# ---- the server, as a user starts it ------------------------------------------------------------

class ServerProcess:
    def __init__(self, model: str, device: str, workdir: Path, extra=(), start_timeout_s: float = 900,
                 label: str = "server"):
        self.label = label
        self.dir = Path(tempfile.mkdtemp(prefix="serve-", dir=workdir))
        cmd = [sys.executable, "-m", "tkcc.cli", "serve", "--http", "127.0.0.1:0", "--model", model, "--device",
               device, "--json", "--trace-out", str(self.dir / "traffic"), *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.err = open(self.dir / "server.stderr", "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env, cwd=self.dir,
                                     start_new_session=True)  # its own group: the server and an engine it starts
        got = {}
        t = threading.Thread(target=lambda: got.update(line=self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(start_timeout_s)
        if not got.get("line"):
            self.stop()
            raise RuntimeError(f"server did not start: {(self.dir / 'server.stderr').read_text()[-3000:]}")
        self.ready = json.loads(got["line"])
        if "url" not in self.ready:  # the server refused to start (a bad plan, model, flag): its own words
            self.stop()
            raise RuntimeError(f"server did not start: {self.ready.get('type', '')}: {self.ready.get('error')}")
        self.url = self.ready["url"]
        self.admin = AdminClient(self.url, token_file=self.ready["admin_token_file"])

    def metrics(self) -> dict:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()) if k != "model")
                out[key] = s.value
        return out

    def stderr_tail(self, n: int = 6000) -> str:
        """The end of the server's stderr (tracebacks of what failed in it)."""
        if not self.err.closed:
            self.err.flush()
        return (self.dir / "server.stderr").read_text(errors="replace")[-n:]

    def stop(self) -> None:
        self._stop()
        if os.environ.get("OUT"):  # the whole stderr beside the results, for what the tail leaves out
            shutil.copy(self.dir / "server.stderr", Path(os.environ["OUT"], f"serve_{self.label}.stderr"))

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its group outlived it (a --watch engine)
        except ProcessLookupError:
            pass
        self.err.close()


# ---- the load generator -------------------------------------------------------------------------

def requests_from(trace, n: int, rate_factor: float, max_ctx: int, max_out: int | None, vocab: int, seed: int,
                  start: int = 0, rate: float | None = None):
    """n consecutive requests of a trace: (arrival s, prompt ids, max_tokens), arrivals / rate_factor.

    ``rate``: instead of the trace's own gaps scaled by ``rate_factor``, its gaps rescaled to this mean rate."""
    rng = np.random.default_rng(seed)
    sel = slice(start, start + n)
    arr = trace.arrival_s[sel] - trace.arrival_s[start]
    if rate is not None and len(arr) > 1 and arr[-1] > 0:
        arr = arr * ((len(arr) - 1) / arr[-1]) / rate
    else:
        arr = arr / rate_factor
    out, clipped = [], 0
    for a, i, o in zip(arr, trace.input_tokens[sel], trace.output_tokens[sel]):
        o = max(1, int(o) if max_out is None else min(int(o), max_out))
        o = min(o, max_ctx // 2)
        i = max(1, int(i))
        if i + o - 1 > max_ctx:
            i, clipped = max(1, max_ctx - o + 1), clipped + 1
        out.append((float(a), rng.integers(0, vocab, i).tolist(), o))
    return out, clipped / max(1, len(out))


async def _one(session, url: str, model: str, prompt, max_tokens: int, res: dict):
    t0 = time.perf_counter()
    res.update(sent=t0, tokens=[], ids=[], status=None, error=None, max_tokens=max_tokens, prompt=len(prompt),
               wall0=time.time() - t0, forward=None)  # wall0 + a perf_counter time = that moment's time.time()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            res["status"] = r.status
            if r.status != 200:
                res["error"] = (await r.text())[:300]
                return
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res["error"] = obj["error"].get("message")
                    break
                now = time.perf_counter()
                if res["forward"] is None and obj.get("system_fingerprint"):
                    res["forward"] = obj["system_fingerprint"].removeprefix("tkcc-")
                for c in obj.get("choices", []):
                    res["tokens"] += [now] * len(c.get("token_ids") or [])
                    res["ids"] += list(c.get("token_ids") or [])
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        res["error"] = f"{type(e).__name__}: {e}"
    res["end"] = time.perf_counter()


async def replay(url: str, model: str, reqs, time_limit_s: float, on_done=None) -> list[dict]:
    """Send each request at its arrival time; bounded by count and ``time_limit_s`` (the rest is not sent)."""
    import aiohttp

    results = []
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=max(60.0, time_limit_s))
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks = []
        for k, (a, prompt, n) in enumerate(reqs):
            delay = t0 + a - time.perf_counter()
            if a > time_limit_s:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            res = {"index": k}
            results.append(res)
            task = asyncio.ensure_future(_one(session, url, model, prompt, n, res))
            if on_done is not None:
                task.add_done_callback(lambda _t, r=res: on_done(r))
            tasks.append(task)
        await asyncio.gather(*tasks)
    return results


def _stats(xs) -> dict | None:
    if not len(xs):
        return None
    a = np.asarray(xs, dtype=np.float64) * 1e3
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "n": int(a.size)}


def summarize(results) -> dict:
    """vLLM's figures per request. TPOT = (last token - first token) / (out - 1), i.e. vLLM's
    (E2E - TTFT) / (out - 1): it leaves out the request's queueing and its own prefill (both in TTFT). At batch 1
    the server runs one request at a time from prefill to last token, so nothing else runs inside a TPOT: it is
    the serving forward's decode step plus the HTTP relay (and whatever shares the GPU: a campaign's engine).
    With --batch B it also holds the prefills of requests admitted meanwhile (no chunked prefill)."""
    ok = [r for r in results if r.get("status") == 200 and not r.get("error") and len(r["tokens"]) == r["max_tokens"]]
    ttft = [r["tokens"][0] - r["sent"] for r in ok]
    tpot = [(r["tokens"][-1] - r["tokens"][0]) / (len(r["tokens"]) - 1) for r in ok if len(r["tokens"]) > 1]
    itl = [b - a for r in ok for a, b in zip(r["tokens"], r["tokens"][1:])]
    e2e = [r["end"] - r["sent"] for r in ok]
    span = (max(r["end"] for r in ok) - min(r["sent"] for r in ok)) if ok else 0.0
    out_tok = sum(len(r["tokens"]) for r in ok)
    return {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
            "rejected_429": sum(r.get("status") == 429 for r in results),
            "ttft_ms": _stats(ttft), "tpot_ms": _stats(tpot), "itl_ms": _stats(itl), "e2e_ms": _stats(e2e),
            "duration_s": span, "output_tok_per_s": out_tok / span if span else None,
            "request_rate_per_s": len(ok) / span if span else None,
            "errors": sorted({str(r.get("error"))[:120] for r in results if r.get("error")})[:5]}


# ---- phases -------------------------------------------------------------------------------------

def single_stream(srv, model, vocab, ctx: int, new: int, n: int) -> dict:
    rng = np.random.default_rng(1)
    reqs = [(0.0, rng.integers(0, vocab, ctx).tolist(), new)]
    asyncio.run(replay(srv.url, model, reqs, 600))  # warm-up: first-call compiles at this shape
    runs = []
    for k in range(n):
        reqs = [(0.0, rng.integers(0, vocab, ctx).tolist(), new)]
        runs += asyncio.run(replay(srv.url, model, reqs, 600))
    s = summarize(runs)
    step = srv.admin.measure_step(ctx + new // 2, reps=30)
    tpot = s["tpot_ms"]["median"] if s["tpot_ms"] else None
    return {"context": ctx, "new_tokens": new, "requests": n, "tpot_ms": s["tpot_ms"], "ttft_ms": s["ttft_ms"],
            "engine_step": step, "tpot_over_step": tpot / step["median_ms"] if tpot else None,
            "failed": s["failed"]}


def load_ladder(srv, model, vocab, trace, args, est_service_s: float) -> tuple[dict, float | None]:
    rate = len(trace) / max(trace.duration_s(), 1e-9)
    f = max(1e-3, 0.5 / (rate * est_service_s))  # start at half the estimated capacity
    load, best, fail = {}, None, None
    for _ in range(args.ladder_steps):
        reqs, clipped = requests_from(trace, args.load_requests, f, args.max_ctx, args.load_max_output, vocab,
                                      seed=2, start=args.trace_start)
        t = time.perf_counter()
        s = summarize(asyncio.run(replay(srv.url, model, reqs, args.run_limit_s)))
        s.update(rate_factor=f, offered_rate_per_s=rate * f, clipped_inputs=clipped,
                 wall_s=time.perf_counter() - t)
        load[f"{f:.4g}"] = s
        p90 = s["ttft_ms"]["p90"] if s["ttft_ms"] else float("inf")
        ok = p90 < 1000.0 and s["failed"] == 0
        log(f"  load x{f:.4g}: {s['completed']}/{s['requests']} ok, P90 TTFT {p90:.0f} ms, "
            f"P90 TPOT {s['tpot_ms']['p90'] if s['tpot_ms'] else float('nan'):.2f} ms")
        if ok:
            best = f if best is None else max(best, f)
        else:
            fail = f if fail is None else min(fail, f)
        f = (f * 2.0) if fail is None else (((best or f / 4) * fail) ** 0.5 if best is not None else f / 2.0)
        if best is not None and fail is not None and fail / best < 1.3:
            break
    return load, best


def campaign_cost(srv, model, vocab, trace, args, factor: float) -> dict:
    reqs, _ = requests_from(trace, args.cost_requests, factor, args.max_ctx, args.load_max_output, vocab, seed=3,
                            start=args.trace_start)
    idle = summarize(asyncio.run(replay(srv.url, model, reqs, args.run_limit_s)))
    cmd = [sys.executable, "-m", "tkcc.cli", "campaign", "--model", args.engine_model, "--device", args.device,
           "--budget", f"{args.campaign_budget_s + args.campaign_warm_s:.0f}s", "--store", str(srv.dir / "campaign.db"), "--no-progress",
           "--json", "--reps", "10"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    camp = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=srv.dir,
                            start_new_session=True)  # its own process group: it and the engine it starts
    try:
        started = _wait_measuring(srv.dir / "campaign.db", camp, args.campaign_warm_s)
        busy = summarize(asyncio.run(replay(srv.url, model, reqs, args.run_limit_s)))
        measuring = camp.poll() is None
    finally:
        if camp.poll() is None:
            camp.send_signal(signal.SIGINT)  # KeyboardInterrupt: the campaign stops its engine on the way out
            try:
                camp.wait(60)
            except subprocess.TimeoutExpired:
                camp.kill()
                camp.wait(30)
        try:
            os.killpg(camp.pid, signal.SIGKILL)  # the group this benchmark made: an engine left behind goes too
        except ProcessLookupError:
            pass
    p = lambda s: s["tpot_ms"]["p90"] if s["tpot_ms"] else None  # noqa: E731
    return {"rate_factor": factor, "idle": idle, "while_campaign": busy, "p90_tpot_ms_idle": p(idle),
            "p90_tpot_ms_while_campaign": p(busy), "campaign_measuring_at_start": started,
            "campaign_still_measuring_at_end": measuring,
            "ratio": (p(busy) / p(idle)) if p(idle) and p(busy) else None}


def _wait_measuring(store: Path, proc, timeout_s: float) -> bool:
    """Wait until the campaign's engine has recorded its first experiment (it measures from then on)."""
    import sqlite3

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=1) as db:
                if db.execute("SELECT count(*) FROM experiments").fetchone()[0] > 0:
                    return True
        except sqlite3.Error:
            pass
        time.sleep(1.0)
    return False


DRIFT_TRACES = ("azure-conv", "servegen-m-mid-81")
# where each phase starts in its trace: past Azure conv's first 100 requests (median input 391 tokens against
# about 1000 after them: a reference taken there makes the watcher see a drift inside Azure conv) and past
# ServeGen's first 5 (gaps of hours to a day: rescaled to the run's rate they left the phase after the switch
# idle for a minute, then sent it in one burst; from the 6th on the gaps are regular)
DRIFT_STARTS = (100, 5)


def drift_requests(args, vocab):
    """The drift run's two phases before pacing: Azure conv, then the long-context ServeGen client (each
    request's arrival is set by ``pace``), and the share of ServeGen inputs clipped to the cache."""
    azure = load_trace(bundled_trace(DRIFT_TRACES[0]))
    servegen = load_trace(bundled_trace(DRIFT_TRACES[1]), max_requests=20000)
    n_a = int(round(args.drift_requests * args.drift_before_share))
    ra, _ = requests_from(azure, n_a, 1.0, args.max_ctx, args.drift_max_output, vocab, seed=4,
                          start=args.trace_start + DRIFT_STARTS[0])
    rb, clipped_b = requests_from(servegen, args.drift_requests - n_a, 1.0, args.max_ctx, args.drift_max_output,
                                  vocab, seed=5, start=DRIFT_STARTS[1])
    return ra, rb, clipped_b


def measure_service(srv, model, args, vocab, n: int) -> dict:
    """Seconds one drift request of each trace takes alone (mean E2E of ``n`` sent one after another, after one
    warm-up each), on a server without --watch: what the drift run's arrival rates are set from."""
    ra, rb, _ = drift_requests(args, vocab)
    out = {}
    for name, reqs in zip(DRIFT_TRACES, (ra, rb)):
        picks = [reqs[int(k)] for k in np.linspace(0, len(reqs) - 1, n + 1)]  # across the phase's lengths
        runs = []
        for k, (_a, prompt, m) in enumerate(picks):
            r = asyncio.run(replay(srv.url, model, [(0.0, prompt, m)], 600))
            if k:  # the first is a warm-up (new prefill shapes)
                runs += r
        s = summarize(runs)
        out[name] = s["e2e_ms"]["mean"] / 1e3 if s["e2e_ms"] else None
    return out


def pace(ra, rb, service: dict, args, limit_s: float) -> tuple[list, dict]:
    """Arrival times: each phase at ``drift_util`` of the server's measured capacity for that trace (its
    requests' own gaps rescaled to that mean rate), raised uniformly if the whole run would not fit in
    ``limit_s`` at that load (up to 0.85; past that, the requests after ``limit_s`` are not sent)."""
    s_a, s_b = service[DRIFT_TRACES[0]], service[DRIFT_TRACES[1]]
    busy = len(ra) * s_a + len(rb) * s_b  # seconds of service the run asks for
    room = max(1.0, limit_s - 5.0)
    util = min(0.85, max(args.drift_util, busy / room))
    if busy / util > room:  # too many even at 0.85: fewer of each, so the switch and the phase after still come
        keep = room * util / busy
        ra, rb = ra[:max(1, int(len(ra) * keep))], rb[:max(1, int(len(rb) * keep))]

    def spaced(reqs, rate):  # the trace's own gaps, scaled so that n requests span (n - 1) / rate
        n = len(reqs)
        gaps = np.diff([a for a, _, _ in reqs])
        gaps = gaps * ((n - 1) / gaps.sum()) / rate if n > 1 and gaps.sum() > 0 else np.full(n - 1, 1.0 / rate)
        t = np.concatenate([[0.0], np.cumsum(gaps)])
        return [(float(x), p, m) for x, (_, p, m) in zip(t, reqs)]

    a = spaced(ra, util / s_a)
    b = spaced(rb, util / s_b)
    start_b = (a[-1][0] + s_a / util) if a else 0.0
    reqs = a + [(start_b + x, p, m) for x, p, m in b]
    return reqs, {"utilisation": util, "service_s": service, "requests": [len(ra), len(rb)], "rate_per_s": {DRIFT_TRACES[0]: util / s_a,
                                                                             DRIFT_TRACES[1]: util / s_b},
                  "switch_at_s": start_b, "planned_span_s": reqs[-1][0] if reqs else 0.0}


def drift_run(args, model_name, vocab, service: dict) -> dict:
    """Azure conv, then ServeGen, on a server started with --watch; every ``swap_every`` completions the
    benchmark also re-ships what serves (``/admin/swap``: a new build on the other Program, swapped in while
    requests run), so the run holds several swaps whatever the campaigns decide and what the watcher shipped
    keeps serving."""
    extra = list(args.server_args) + ["--moe-counts", args.moe_counts]
    if args.watch:
        extra += ["--watch", "--watch-budget", f"{args.watch_budget_s:.0f}s", "--watch-poll", f"{args.watch_poll_s:g}",
                  "--watch-min-requests", str(args.watch_min_requests), "--watch-horizon", args.watch_horizon]
    ra, rb, clipped_b = drift_requests(args, vocab)
    srv = ServerProcess(args.model, args.device, args.workdir, extra, label=f"{args.model}_drift")
    try:
        engine_s = _wait_watching(srv, args.watch_ready_s) if args.watch else None
        left = args.budget_s - (time.time() - T0) - 30.0  # the drain and the shutdown after the last arrival
        limit = max(30.0, min(args.drift_limit_s, left))
        reqs, plan = pace(ra, rb, service, args, limit)
        plan.update(limit_s=limit, watch_engine_ready_s=engine_s)
        n_a, n_b = plan["requests"]
        if n_a + n_b < len(ra) + len(rb):
            log(f"  drift: {len(ra)} + {len(rb)} requests do not fit in {limit:.0f} s at 0.85 of capacity")
        log(f"  drift: {n_a} + {n_b} requests at {plan['utilisation']:.2f} of capacity "
            f"({plan['rate_per_s'][DRIFT_TRACES[0]]:.2f} then {plan['rate_per_s'][DRIFT_TRACES[1]]:.2f} req/s), "
            f"switch at {plan['switch_at_s']:.0f} s, last arrival {plan['planned_span_s']:.0f} s (sent until "
            f"{limit:.0f} s)" + (f"; the watcher's engine was ready after {engine_s:.0f} s" if engine_s else ""))
        done = {"n": 0}
        lock = threading.Lock()
        forced, busy = [], threading.Event()

        def reship():
            try:
                ships = [r for r in srv.admin.status().get("ships", []) if "spec" in r]
                first = {"artifact": str(args.artifact)} if args.artifact else {"plan": _start_plan_json(args)}
                spec = ships[-1]["spec"] if ships else first  # what serves, built again
                forced.append(_safe_ship(srv, spec))
            finally:
                busy.clear()

        def on_done(_r):
            with lock:
                done["n"] += 1
                k = done["n"]
            if args.swap_every and k % args.swap_every == 0:
                if busy.is_set():
                    forced.append({"skipped": "the previous forced swap was still building", "at": k})
                    return
                busy.set()
                threading.Thread(target=reship, daemon=True).start()

        t = time.perf_counter()
        res = asyncio.run(replay(srv.url, model_name, reqs, limit, on_done=on_done))
        wall = time.perf_counter() - t
        _wait_event(busy, 90)  # a forced swap still building: its result belongs to the run
        status = srv.admin.status()
        health = json.loads(__import__("urllib.request").request.urlopen(srv.url + "/health", timeout=30).read())
        before = summarize([r for r in res if r["index"] < n_a])
        after = summarize([r for r in res if r["index"] >= n_a])
        watch_swaps = (status.get("watch") or {}).get("swaps")
        allr = summarize(res)
        done_ok = [f for f in forced if "current" in f]
        ships = status.get("ships", [])
        watch = status.get("watch") or {}
        windows = measuring_windows(watch.get("events") or [], time.time())
        origin = min((r["wall0"] + r["sent"] for r in res), default=time.time())  # the first send (time.time())
        m = _pick(srv.metrics())
        out = {"requests": allr["requests"], "requests_planned": len(reqs), "failed": allr["failed"],
               "swaps": health["swaps"], "swaps_forced": len(done_ok),
               "swaps_by_watch": watch_swaps if watch_swaps is not None else max(0, health["swaps"] - len(done_ok)),
               "swap_failures": status.get("swap_failures", [])[-5:],  # the server's: stage and cause
               "forced_swap_errors": [f for f in forced if "error" in f][:3],  # as the client saw them
               "swaps_skipped": sum(1 for f in forced if "skipped" in f),
               "paused_s_total": round(sum(r.get("paused_s") or 0.0 for r in ships), 3),
               "p90_tpot_ms_before": before["tpot_ms"]["p90"] if before["tpot_ms"] else None,
               "p90_tpot_ms_after": after["tpot_ms"]["p90"] if after["tpot_ms"] else None,
               "tpot_ms_by_serving_window": by_serving_window(res, ships),
               "tpot_ms_while_watch_measures": by_measuring(res, windows),
               "phase_before": {"trace": DRIFT_TRACES[0], **before},
               "phase_after": {"trace": DRIFT_TRACES[1], "clipped_inputs": clipped_b, **after},
               "pacing": plan, "max_output_tokens": args.drift_max_output, "wall_s": wall,
               "watch": bool(args.watch), "watch_settings": {"budget_s": args.watch_budget_s,
                                                             "min_requests": args.watch_min_requests,
                                                             "poll_s": args.watch_poll_s,
                                                             "horizon": args.watch_horizon} if args.watch else None,
               "watch_state": {k: watch.get(k) for k in ("state", "error", "swaps", "swap_errors", "polls_quiet")},
               "watch_events": [{k: v for k, v in e.items() if k in ("time", "kind", "field", "magnitude",
                                                                     "requests", "reverted", "shipped", "stopped",
                                                                     "evaluated", "reason", "stage", "name",
                                                                     "error", "note", "tried", "decisions")}
                                for e in watch.get("events") or [] if e.get("kind") != "waiting"][-12:],
               "measuring_windows_s": [[round(a - origin, 1), round(b - origin, 1)] for a, b in windows],
               "ships": ships[-12:], "watch_experiments": watch_experiments(srv.dir / "tkcc-campaigns.db"),
               "decode_graph": status.get("decode_graph"), "server_metrics": m,
               "moe_counts": args.moe_counts, "moe_counted_requests": m.get("tkcc_moe_count_seconds_count"),
               "moe_count_s_per_request": (m["tkcc_moe_count_seconds_sum"] / m["tkcc_moe_count_seconds_count"])
               if m.get("tkcc_moe_count_seconds_count") else None}
        if (out["failed"] or out["swap_failures"] or out["forced_swap_errors"] or watch.get("error")
                or any(e.get("kind") == "failed" for e in watch.get("events") or [])):
            out["server_stderr_tail"] = srv.stderr_tail()
        return out
    finally:
        srv.stop()


def watch_experiments(db: Path) -> list[dict]:
    """What the watcher's campaigns tried, from the server's experiment store: per experiment its campaign, tier,
    plan (pass names), verdict, objective, reason (why one was invalid or not promoted), and its seconds per phase
    (render, compile wait, validate, capture, measure: a 77 s experiment beside the traffic says which)."""
    if not db.exists():
        return []
    from tkcc.agents.store import ExperimentStore

    store = ExperimentStore(db)
    try:
        names = {c["id"]: c["name"] for c in store.campaigns()}
        return [{"campaign": names.get(e.campaign_id, e.campaign_id), "tier": e.tier, "proposer": e.proposer,
                 "candidate": e.candidate[:16], "plan": [s.get("name") for s in e.plan or []], "verdict": e.verdict,
                 "objective": e.objective, "reason": (e.reason or "")[:300],
                 "seconds": round(e.finished - e.started, 1), "timing": e.timing} for e in store.experiments()]
    finally:
        store.close()


def _wait_watching(srv, timeout_s: float) -> float | None:
    """Seconds until the server's watch loop has its engine up (it starts beside the server); None if not in
    ``timeout_s`` (the run goes on: the engine's start-up then shares the device with the first requests)."""
    t = time.perf_counter()
    while time.perf_counter() - t < timeout_s:
        w = srv.admin.status().get("watch") or {}
        if w.get("state") not in (None, "starting the engine"):
            return time.perf_counter() - t
        time.sleep(1.0)
    return None


def _wait_event(ev: threading.Event, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while ev.is_set() and time.monotonic() < deadline:
        time.sleep(0.2)


def _safe_ship(srv, spec):
    try:
        return srv.admin.ship(spec)
    except Exception as e:  # noqa: BLE001 - a failed swap is a result to report
        return {"error": str(e)[:600], "spec": spec}


def _tpot_s(r) -> float | None:
    ok = r.get("status") == 200 and not r.get("error") and len(r["tokens"]) == r["max_tokens"]
    return (r["tokens"][-1] - r["tokens"][0]) / (len(r["tokens"]) - 1) if ok and len(r["tokens"]) > 1 else None


def by_serving_window(res, ships) -> list[dict]:
    """TPOT of the requests whose first token came in each stretch between two swaps (a rebuild of the same
    plan is its own stretch: the tag alone cannot tell them apart), with the forward the responses named."""
    edges = sorted(r["time"] for r in ships if "time" in r)
    groups: dict[int, list] = {}
    tags: dict[int, set] = {}
    for r in res:
        t = _tpot_s(r)
        if t is None:
            continue
        first = r["wall0"] + r["tokens"][0]
        k = int(np.searchsorted(edges, first))
        groups.setdefault(k, []).append(t)
        tags.setdefault(k, set()).add(r.get("forward"))
    out = []
    for k in sorted(groups):
        out.append({"after_swap": k, "forward": sorted(str(x) for x in tags[k]), "since": edges[k - 1] if k else None,
                    **_stats(groups[k])})
    return out


def measuring_windows(events, now: float) -> list[tuple[float, float]]:
    """When the server's watch loop had its engine measure (time.time() spans): from a reference or a drift to
    the end of the campaign that follows it (the re-check of a drift included)."""
    spans, start = [], None
    for e in events:
        if e.get("kind") in ("reference", "drift") and start is None:
            start = e["time"]
        elif e.get("kind") == "campaign" and start is not None:
            spans.append((start, e["time"]))
            start = None
    if start is not None:
        spans.append((start, now))
    return spans


def by_measuring(res, windows) -> dict:
    """TPOT of requests that decoded while the watch loop's engine measured on the same device, and of the rest."""
    busy, idle = [], []
    for r in res:
        t = _tpot_s(r)
        if t is None:
            continue
        a, b = r["wall0"] + r["tokens"][0], r["wall0"] + r["tokens"][-1]
        (busy if any(a < w1 and b > w0 for w0, w1 in windows) else idle).append(t)
    return {"while_measuring": _stats(busy), "idle": _stats(idle)}


def _start_plan_json(args) -> list:
    """The plan the server started on (no artifact): its ``--plan``, else the default plan of its ``--mode``, read
    as the server reads them (``resolve_plan``); ``--plan`` text that is not a plan raises a PlanError."""
    from tkcc.passes.default_plan import resolve_plan

    return resolve_plan(args.plan, args.mode or "exact").to_json()


def _pick(m: dict) -> dict:
    keep = ("tkcc_moe_count_seconds_sum", "tkcc_moe_count_seconds_count", "tkcc_forward_swaps_total")
    return {k: v for k, v in m.items() if k.startswith(keep) or k.startswith("tkcc_request_success_total")}


# ---- batching: throughput and per-request latency at batch 1 and batch B -------------------------

def batching_run(args) -> dict:
    """The same saturated request set served at each ``--batches`` B (a server started with ``--batch B``, or
    in process: ``ForwardBuilder(batch=B)`` and the ``Scheduler`` it serves with, no HTTP), then a few of those
    requests again, one at a time: each must get the tokens it got beside the others."""
    from tkcc.frontend.models import make_config

    cfg = make_config(args.model)
    vocab = int(cfg.vocab_size)
    args.max_ctx = int(args.max_cache_len or min(cfg.max_position_embeddings, 2048))
    azure = load_trace(bundled_trace("azure-conv"))
    reqs, clipped = requests_from(azure, args.batch_requests, 1.0, args.max_ctx, args.batch_max_output, vocab,
                                  seed=6, start=args.trace_start)
    reqs = [(0.0, p, n) for _, p, n in reqs]  # all at once: the queue holds what the slots do not
    serve = _InProcess(args, vocab) if args.in_process else _OverHTTP(args)
    out = {"model": args.model, "device": args.device, "mode": "in-process" if args.in_process else "http",
           "requests": len(reqs), "arrivals": "all at t=0 (saturated: throughput at full occupancy)",
           "prompt_tokens_mean": float(np.mean([len(p) for _, p, _ in reqs])),
           "output_tokens_mean": float(np.mean([n for _, _, n in reqs])), "clipped_inputs": clipped,
           "max_output_tokens": args.batch_max_output, "max_cache_len": args.max_ctx, "batches": {}}
    for b in args.batches:
        if time.time() - T0 > args.budget_s and out["batches"]:
            out["batches"][str(b)] = {"skipped": "time budget"}
            continue
        log(f"{args.model}: batch {b} ({out['mode']})")
        t = time.perf_counter()
        with serve.at(b) as run:
            startup = time.perf_counter() - t
            run([(0.0, reqs[0][1][:16], 4)])  # warm-up: first-call compiles, CUDA graph capture of the step
            t = time.perf_counter()
            res = run(reqs)
            wall = time.perf_counter() - t
            s = summarize(res)
            sample = list(range(0, len(reqs), max(1, len(reqs) // args.batch_check)))[:args.batch_check]
            alone = [run([reqs[i]])[0] for i in sample]
        same = [i for i, r in zip(sample, alone) if r["ids"] == res[i]["ids"]]
        s.update(batch=b, startup_s=round(startup, 1), wall_s=round(wall, 2),
                 tokens_match_alone={"checked": len(sample), "equal": len(same),
                                     "differ": [i for i in sample if i not in same][:5]},
                 alone=summarize(alone))
        out["batches"][str(b)] = s
        tp = s["output_tok_per_s"]
        log(f"  {s['completed']}/{s['requests']} ok, {tp or 0:.1f} output tok/s, median TPOT "
            f"{(s['tpot_ms'] or {}).get('median', float('nan')):.2f} ms, P90 TTFT "
            f"{(s['ttft_ms'] or {}).get('p90', float('nan')):.0f} ms; tokens as alone {len(same)}/{len(sample)}")
    base = (out["batches"].get("1") or {}).get("output_tok_per_s")
    out["throughput_vs_batch1"] = {k: v["output_tok_per_s"] / base for k, v in out["batches"].items()
                                   if base and v.get("output_tok_per_s")}
    out["measured_on"] = environment(args)
    out["wall_s"] = round(time.time() - T0, 1)
    return out


class _OverHTTP:
    """``tkcc serve --http --batch B`` in a subprocess, driven by the aiohttp load generator."""

    def __init__(self, args):
        self.args = args

    def at(self, batch: int):
        import contextlib

        a = self.args

        @contextlib.contextmanager
        def cm():
            extra = ["--batch", str(batch), "--max-queue", str(a.batch_requests + 8), "--max-cache-len",
                     str(a.max_ctx), "--moe-counts", "off", "--no-record"]
            srv = ServerProcess(a.model, a.device, a.workdir, extra)
            try:
                yield lambda reqs: asyncio.run(replay(srv.url, a.model, reqs, 3600))
            finally:
                srv.stop()
        return cm()


class _InProcess:
    """The server's own pieces without HTTP: ``ForwardBuilder(batch=B).first()`` (tkcc.compile, default plan)
    and the ``Scheduler`` driven directly; each token is timed when the scheduler hands it over."""

    def __init__(self, args, vocab: int):
        import torch

        from tkcc.frontend.models import build_model
        from tkcc.runtime.programs import parse_dtype

        dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
        self.args, self.vocab, self.torch = args, vocab, torch
        self.model = build_model(args.model, dtype=parse_dtype(dtype), device=args.device)

    def at(self, batch: int):
        import contextlib
        import gc

        from tkcc.commands.http_forwards import ForwardBuilder
        from tkcc.serve.scheduler import Scheduler, Served

        @contextlib.contextmanager
        def cm():
            compiled, tag = ForwardBuilder(self.model, max_cache_len=self.args.max_ctx, batch=batch).first()
            sched = Scheduler(Served(compiled, tag), max_queue=self.args.batch_requests + 8).start()
            try:
                yield lambda reqs: self._run(sched, reqs)
            finally:
                sched.stop()
                del compiled, sched
                gc.collect()
                if self.torch.cuda.is_available():
                    self.torch.cuda.empty_cache()
        return cm()

    def _run(self, sched, reqs) -> list[dict]:
        from tkcc.serve.scheduler import Failed, Job, Token
        from tkcc.serve.stops import TextStop
        from tkcc.serve.tokenizer import ByteTokenizer

        tok = ByteTokenizer(self.vocab)
        left = threading.Semaphore(0)
        results, jobs = [], []
        for k, (_a, prompt, n) in enumerate(reqs):
            res = {"index": k, "tokens": [], "ids": [], "status": 200, "error": None, "max_tokens": n,
                   "prompt": len(prompt)}

            def deliver(ev, res=res):
                now = time.perf_counter()
                if isinstance(ev, Token):
                    res["tokens"].append(now)
                    res["ids"].append(ev.id)
                    return
                if isinstance(ev, Failed):
                    res["status"], res["error"] = ev.status, ev.message
                res["end"] = now
                left.release()
            results.append(res)
            jobs.append(Job(prompt, TextStop(tok, n), deliver, 3600.0))
        t = time.perf_counter()
        for r in results:
            r["sent"] = t
        sched.submit(jobs)
        for _ in jobs:
            left.acquire()
        return results


# ---- main -----------------------------------------------------------------------------------------

def run_model(args) -> dict:
    from tkcc.frontend.models import make_config

    cfg = make_config(args.model)
    vocab = int(cfg.vocab_size)
    args.max_ctx = int(args.max_cache_len or min(cfg.max_position_embeddings, 4096))
    out = {"model": args.model, "device": args.device, "started": datetime.datetime.now().isoformat(),
           "phases": sorted(args.phases)}
    log(f"{args.model}: starting the server")
    srv = ServerProcess(args.model, args.device, args.workdir, list(args.server_args) + ["--moe-counts", "off"],
                        label=args.model)
    service = None
    try:
        out["startup_s"] = srv.ready["startup_s"]
        out["forward"] = srv.ready["forward"]
        out["artifact"] = args.artifact
        if getattr(args, "compile_report", None):
            out["compiled"] = args.compile_report
        out["decode_graph"] = srv.ready.get("decode_graph")
        log(f"  ready in {srv.ready['startup_s']} s (decode step: {_graph_text(srv.ready.get('decode_graph'))}); "
            "single stream")
        ss = single_stream(srv, args.model, vocab, args.ss_context, args.ss_tokens, args.ss_requests)
        out["single_stream"] = ss
        out["single_stream_tpot_ms"] = ss["tpot_ms"]["median"] if ss["tpot_ms"] else None
        out["engine_step_ms"] = ss["engine_step"]["median_ms"]
        log(f"  single stream TPOT {out['single_stream_tpot_ms']:.3f} ms vs decode step "
            f"{out['engine_step_ms']:.3f} ms (x{ss['tpot_over_step']:.3f})")
        tpot_s = out["single_stream_tpot_ms"] / 1e3
        prefill_s = ss["ttft_ms"]["median"] / 1e3 / max(1, args.ss_context)  # per prompt token, roughly

        def est(trace, max_out):  # estimated seconds of service per request of this trace (batch 1)
            i = np.minimum(trace.input_tokens[:2000], args.max_ctx).mean()
            o = np.minimum(trace.output_tokens[:2000], max_out or args.max_ctx).mean()
            return float(i * prefill_s + o * tpot_s)

        azure = load_trace(bundled_trace("azure-conv"))
        if "load" in args.phases:
            log("  load ladder (Azure conv)")
            out["load"], best = load_ladder(srv, args.model, vocab, azure, args, est(azure, args.load_max_output))
            out["max_rate_factor_p90_ttft_under_1s"] = best
            out["load_max_output_tokens"] = args.load_max_output
        else:
            best = None
        if "cost" in args.phases and args.campaign_budget_s > 0 and time.time() - T0 < args.budget_s * 0.6:
            log("  serving while a campaign measures beside it")
            out["campaign_cost"] = campaign_cost(srv, args.model, vocab, azure, args,
                                                 0.5 * (best or 1.0 / (len(azure) / azure.duration_s()
                                                                       * est(azure, args.load_max_output))))
        elif "cost" in args.phases:
            out["campaign_cost"] = {"skipped": "--campaign-budget-s 0 (the drift run reports TPOT while its "
                                               "watcher measures)" if args.campaign_budget_s <= 0 else "time budget"}
        if "drift" in args.phases:
            service = measure_service(srv, args.model, args, vocab, args.service_requests)
            log("  drift requests alone: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in service.items()))
    finally:
        srv.stop()
    if "drift" in args.phases:
        log("  drift run")
        out["drift_run"] = drift_run(args, args.model, vocab, service)
        d = out["drift_run"]
        log(f"  drift: {d['requests']} requests, {d['failed']} failed, {d['swaps']} swaps ({d['swaps_by_watch']} by "
            f"the watcher, {d['paused_s_total']:.1f} s paused building), P90 TPOT {_ms(d['p90_tpot_ms_before'])} -> "
            f"{_ms(d['p90_tpot_ms_after'])} ms; while the watcher measured "
            f"{_ms(_p90(d['tpot_ms_while_watch_measures']['while_measuring']))} ms, idle "
            f"{_ms(_p90(d['tpot_ms_while_watch_measures']['idle']))} ms")
    out["measured_on"] = environment(args)
    out["wall_s"] = round(time.time() - T0, 1)
    return out


def _p90(stats):
    return stats["p90"] if stats else None


def _ms(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _graph_text(g) -> str:
    if g is None:
        return "no graph cache (CPU, or a step that replays its own graph)"
    return "replayed from a CUDA graph" if g.get("replayed") else f"EAGER ({'; '.join(g.get('refused') or [])})"


def environment(args) -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "device": args.device, "command": " ".join(sys.argv), "commit": _commit(),
           "timing": "aiohttp client on loopback, time.perf_counter per SSE chunk; engine step: "
                     "tkcc.runtime.timing.time_eager in the server between requests",
           "prompts": "random token ids of the trace's lengths (the trace's prefix sharing is not replayed)"}
    if args.device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    return env


def _commit() -> str:
    from provenance import commit

    return commit()


def given_dests(ap, argv) -> set[str]:
    """The options named on the command line in full (``--flag``, ``--no-flag`` or ``--flag=value``)."""
    words = {w.split("=", 1)[0] for w in argv if w.startswith("--")}
    return {act.dest for act in ap._actions if words & set(act.option_strings)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b-16l")
    ap.add_argument("--device", default=None, help="default cuda when there is one, else cpu")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/serve.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU: llama-tiny (or a tiny --model), small runs, < 2 min")
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget; later phases shrink")
    ap.add_argument("--max-cache-len", type=int, default=None)
    ap.add_argument("--ss-context", type=int, default=512)
    ap.add_argument("--ss-tokens", type=int, default=128)
    ap.add_argument("--ss-requests", type=int, default=5)
    ap.add_argument("--load-requests", type=int, default=80)
    ap.add_argument("--load-max-output", type=int, default=None, help="clip output lengths in the load runs")
    ap.add_argument("--ladder-steps", type=int, default=5)
    ap.add_argument("--run-limit-s", type=float, default=60.0, help="arrival span one load run may send over")
    ap.add_argument("--trace-start", type=int, default=0)
    ap.add_argument("--cost-requests", type=int, default=60)
    ap.add_argument("--campaign-budget-s", type=float, default=60.0)
    ap.add_argument("--campaign-warm-s", type=float, default=240.0,
                    help="longest wait for the campaign's engine to start measuring")
    ap.add_argument("--phases", default="single,load,cost,drift",
                    help="comma-separated phases to run (single always runs: the drift run's pacing is measured on "
                         "its server); a phase left out keeps what --out holds for this model")
    ap.add_argument("--drift-requests", type=int, default=1000)
    ap.add_argument("--drift-before-share", type=float, default=0.6,
                    help="share of the drift run's requests from Azure conv (the rest: ServeGen); default 0.6")
    ap.add_argument("--drift-max-output", type=int, default=16)
    ap.add_argument("--drift-util", type=float, default=0.5,
                    help="offered load as a share of the capacity measured for each trace's requests (raised to "
                         "fit --drift-limit-s, at most 0.85)")
    ap.add_argument("--drift-limit-s", type=float, default=300.0,
                    help="arrival span of the drift run (shrunk to what --budget-s leaves)")
    ap.add_argument("--service-requests", type=int, default=6,
                    help="requests of each drift trace timed alone to pace the drift run (default 6)")
    ap.add_argument("--swap-every", type=int, default=200,
                    help="completions between the benchmark's own swaps (re-ships of what serves)")
    ap.add_argument("--watch", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--watch-budget-s", type=float, default=40.0)
    ap.add_argument("--watch-min-requests", type=int, default=120)
    ap.add_argument("--watch-poll-s", type=float, default=2.0)
    ap.add_argument("--watch-horizon", default="90s",
                    help="the watch loop's window: short enough that after the switch it is mostly the new "
                         "traffic, long enough to hold --watch-min-requests (default 90s)")
    ap.add_argument("--watch-ready-s", type=float, default=120.0,
                    help="longest wait for the watch loop's engine before the drift traffic starts")
    ap.add_argument("--moe-counts", default="idle", choices=["all", "idle", "off"],
                    help="MoE counts in the drift run's server (default idle: counted between requests when none "
                         "waits; the cost per counted request is drift_run.moe_count_s_per_request)")
    g = ap.add_argument_group("batching (--batching): throughput and per-request latency at batch 1 and batch B")
    g.add_argument("--batching", action="store_true",
                   help="only this comparison (results to benchmarks/results/serve_batching.json)")
    ap.add_argument("--artifact", default=None,
                    help="serve this saved artifact (compiled.save / tkcc compile's model/) from the start")
    ap.add_argument("--compile-budget", default=None,
                    help="first compile the model for the Azure conv trace with this budget (tkcc compile, "
                         "tolerance mode, e.g. 150s) and serve what it ships: the front door's winner")
    ap.add_argument("--mode", default=None, choices=["exact", "tolerance"],
                    help="the server's --mode: the mode its plans are built and its watcher searches in (default: "
                         "the artifact's own, else exact); tolerance lets a watcher over the default plan find "
                         "the inexact passes, such as the lowered decode step")
    ap.add_argument("--plan", default=None,
                    help="the server's --plan (JSON text): what it serves from the start (default: the default "
                         "plan of --mode); e.g. the exact default with --mode tolerance, so that the watcher, not "
                         "the start, brings in the inexact passes")
    g.add_argument("--batches", default="1,8", help="batch sizes to serve at, comma-separated (default 1,8)")
    g.add_argument("--in-process", action="store_true",
                   help="drive the server's scheduler in this process (no HTTP: needs no serve wheels)")
    g.add_argument("--batch-requests", type=int, default=64, help="requests of the saturated set (default 64)")
    g.add_argument("--batch-max-output", type=int, default=128, help="clip output lengths (default 128)")
    g.add_argument("--batch-check", type=int, default=4, help="requests served again alone (default 4)")
    g.add_argument("--dtype", default=None, help="in-process model dtype (default bfloat16 on cuda)")
    a = ap.parse_args(argv)
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.batching:
        return main_batching(a, ap)
    if a.smoke:  # small settings, each unless given on the command line
        a.device = "cpu"
        small = dict(model="llama-tiny", max_cache_len=256, ss_context=32, ss_tokens=32, ss_requests=3, load_requests=20,
                     load_max_output=24, ladder_steps=3, run_limit_s=10.0, campaign_budget_s=0.0, cost_requests=20,
                     campaign_warm_s=120.0, drift_requests=120, drift_max_output=8, drift_limit_s=30.0, swap_every=40,
                     watch=False, watch_budget_s=20.0, watch_min_requests=40, service_requests=2,
                     out=str(ROOT / "benchmarks/results/serve_cpu_smoke.json"))
        given = given_dests(ap, sys.argv[1:] if argv is None else argv)
        for k, v in small.items():
            if k not in given:  # a flag given on the command line wins, also when it equals the default (--watch)
                setattr(a, k, v)
    a.phases = {x.strip() for x in str(a.phases).split(",") if x.strip()} | {"single"}
    unknown = a.phases - {"single", "load", "cost", "drift"}
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)}; the phases are single, load, cost, drift")
    a.engine_model = a.model
    a.server_args = ["--max-queue", "256"] + (["--max-cache-len", str(a.max_cache_len)] if a.max_cache_len else [])
    a.workdir = Path(tempfile.mkdtemp(prefix="tkcc-bench-serve-"))
    log(f"benchmark serve: {a.model} on {a.device}; work in {a.workdir}")
    if a.compile_budget is not None and a.artifact is None:
        a.artifact, a.compile_report = compile_first(a)
    if a.artifact is not None:
        a.server_args += ["--artifact", str(a.artifact)]
    if a.mode is not None:
        a.server_args += ["--mode", a.mode]
    if a.plan is not None:
        _start_plan_json(a)  # a bad --plan fails here, not after minutes of serving
        a.server_args += ["--plan", a.plan]
    run = run_model(a)
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    prev = next((r for r in old.get("runs", []) if r.get("model") == a.model), None)
    if prev is not None:  # the phases not run this time keep what the earlier run measured
        kept = {k: v for k, v in prev.items() if k not in run and k in PHASE_KEYS}
        if kept:
            run = {**run, **kept, "kept_from_earlier_run": sorted(kept)}
    runs = [r for r in old.get("runs", []) if r.get("model") != a.model] + [run]
    path.write_text(json.dumps({"runs": runs}, indent=1, default=str))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(path.read_text())
    log(f"wrote {path} ({run['wall_s']} s)")


def compile_first(a) -> tuple[str, dict]:
    """``tkcc compile`` of the model (the front door, its loop at ``--compile-budget``) into the work folder, as a
    user would before serving; (the saved model folder, what its report says ships)."""
    out = a.workdir / "compiled"
    dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    cmd = [sys.executable, "-m", "tkcc.cli", "compile", "--model", a.model, "--device", a.device, "--dtype", dtype,
           "--mode", "tolerance", "--budget", str(a.compile_budget), "--out", str(out), "--json"]
    t0 = time.time()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=a.workdir)
    if r.returncode != 0:
        raise SystemExit(f"tkcc compile failed ({r.returncode}): {r.stderr[-3000:]}")
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    info = {"compile_s": round(time.time() - t0, 1), "serves": rep.get("serves"), "plan": rep.get("plan"),
            "loop": {k: (rep.get("loop") or {}).get(k) for k in ("serving", "why", "side_by_side")},
            "timings_s": {k: round(v, 1) for k, v in (rep.get("timings_s") or {}).items()}}
    log(f"  compiled in {info['compile_s']} s (tkcc.compile's own: {info['timings_s']}, the rest the process "
        f"and the model's build): {info['loop'].get('serving')} ({info['loop'].get('why')})")
    if os.environ.get("OUT"):  # on the device machine: the saved model comes back, for a later --artifact run
        kept = Path(os.environ["OUT"]) / f"compiled_{a.model}"
        shutil.copytree(out / "model", kept, dirs_exist_ok=True)
        log(f"  the saved model is also in {kept} (serve it later with --artifact, no compile)")
    return str(out / "model"), info


PHASE_KEYS = {"load", "max_rate_factor_p90_ttft_under_1s", "load_max_output_tokens", "campaign_cost", "drift_run"}


def main_batching(a, ap):
    try:
        a.batches = sorted({int(x) for x in str(a.batches).split(",") if x.strip()})
    except ValueError:
        ap.error(f"--batches {a.batches!r}: comma-separated integers, e.g. 1,8")
    if not a.batches or a.batches[0] < 1:
        ap.error("--batches: at least one batch size >= 1")
    if a.smoke:
        a.device = "cpu"
        small = dict(model="llama-tiny", max_cache_len=256, batches=[1, 4], batch_requests=16, batch_max_output=16,
                     batch_check=3)
        for k, v in small.items():
            if getattr(a, k) == ap.get_default(k) or (k == "batches" and a.batches == [1, 8]):
                setattr(a, k, v)
    if a.out == ap.get_default("out"):
        a.out = str(ROOT / "benchmarks/results" / ("serve_batching_cpu_smoke.json" if a.smoke else
                                                   "serve_batching.json"))
    a.workdir = Path(tempfile.mkdtemp(prefix="tkcc-bench-serve-"))
    log(f"benchmark serve --batching: {a.model} on {a.device}, batches {a.batches}; work in {a.workdir}")
    run = batching_run(a)
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    runs = [r for r in old.get("runs", []) if (r.get("model"), r.get("mode")) != (a.model, run["mode"])] + [run]
    path.write_text(json.dumps({"runs": runs}, indent=1, default=str))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(path.read_text())
    log(f"wrote {path} ({run['wall_s']} s)")


if __name__ == "__main__":
    main()
