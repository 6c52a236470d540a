"""``Server``: one served model (scheduler, tokenizer, rolling trace, metrics, swapper) and its ASGI app.

    compiled = tkcc.compile(model, "azure-conv", measure=False, check=False)
    server = Server(compiled, model_name="llama-tiny", trace_dir="tkcc-traffic").start()
    with ServerThread(server.app) as http:       # tkcc.serve.runner; `tkcc serve --http` runs uvicorn itself
        ...                                      # OpenAI clients talk to http.url + "/v1"
        server.swap(other_compiled)              # hot swap: from the next request on
    server.close()

``Server`` takes what the API layer built (a CompiledModel, a tokenizer, a
``ForwardBuilder`` for swaps by plan or artifact) and never calls the
compiler itself, keeping ``serve`` below the API in the layering.
"""
from __future__ import annotations

import secrets
import time

import torch

from tkcc.errors import TkccError
from tkcc.serve.app import Limits, build_app
from tkcc.serve.metrics import CONTENT_TYPE, ServeMetrics
from tkcc.serve.scheduler import Scheduler, Served, decode_graph, warm_up
from tkcc.serve.tokenizer import ByteTokenizer


def forward_tag(compiled) -> str:
    """A forward's name in responses (``system_fingerprint``), metrics and status: its plan's hash."""
    plan = getattr(compiled, "plan", None)
    try:
        return plan.hash() if plan is not None else f"forward-{id(compiled):x}"
    except Exception:  # noqa: BLE001 - a forward without a readable plan still gets a name
        return f"forward-{id(compiled):x}"


class Server:
    def __init__(self, compiled, *, model_name: str, tokenizer=None, tag: str | None = None,
                 limits: Limits | None = None, api_key: str | None = None, admin_token: str | None = None,
                 trace_dir=None, moe_counts: str = "all", max_queue: int = 64, builder=None,
                 rotate_requests: int = 100_000, keep_files: int = 10):
        program = getattr(compiled, "program", None)
        phases = set(getattr(program, "meta", {}).get("phases") or getattr(program, "graphs", {}))
        if program is None or not {"prefill", "decode"} <= phases:  # a loaded artifact has no graphs, its phases
            raise TkccError("the server serves causal LMs: a CompiledModel whose Program has prefill and decode")
        meta = program.meta
        self.model_name = model_name
        self.vocab_size = int(meta["vocab_size"])
        self.max_cache_len = int(meta["max_cache_len"])
        self.tokenizer = tokenizer or ByteTokenizer(self.vocab_size)
        if self.tokenizer.vocab_size > self.vocab_size:
            raise TkccError(f"the tokenizer has {self.tokenizer.vocab_size} ids, the model {self.vocab_size}")
        self.limits = limits or Limits()
        self.api_key = api_key.encode() if api_key else None
        self.admin_token = admin_token or secrets.token_hex(32)
        self.created = time.time()
        self.metrics = ServeMetrics(model_name)
        self.metrics_content_type = CONTENT_TYPE
        self.moe_note = None
        self.recorder = None
        if trace_dir is not None:
            from tkcc.serve.recorder import RollingTrace

            moe = self._moe_header(program) if moe_counts != "off" else None
            if moe is None and moe_counts != "off":
                moe_counts = "off"
            self.recorder = RollingTrace(trace_dir, model=model_name, moe=moe, rotate_requests=rotate_requests,
                                         keep=keep_files)
        tag = tag or forward_tag(compiled)
        self.scheduler = Scheduler(Served(compiled, tag), max_queue=max_queue, recorder=self.recorder,
                                   moe_counts=moe_counts, metrics=self.metrics)
        self.metrics.set_forward(tag)
        self.watcher = None  # a tkcc.serve.watching.ServeWatch, when --watch runs
        self.swapper = None
        if builder is not None:
            from tkcc.serve.swap import Swapper

            self.swapper = Swapper(self, builder)
        self.app = build_app(self)

    def _moe_header(self, program):
        from tkcc.serve.routing import ExpertCounter, is_moe

        if not is_moe(program):
            return None
        try:
            return ExpertCounter(program).header
        except TkccError as e:
            self.moe_note = f"MoE counts off: {e}"
            return None

    def start(self) -> "Server":
        self.scheduler.start()
        return self

    def warm_up(self, timeout_s: float | None = None) -> dict | None:
        """Run a two-token prompt through the serving forward on the scheduler thread (first-call compiles, the
        decode step's CUDA graph), as a swap does before it serves; how its decode step runs (``decode_graph``)."""
        def run():
            c = self.scheduler.current.compiled
            warm_up(c)
            return decode_graph(c)
        return self.scheduler.call(run).result(timeout_s)

    def swap(self, compiled, tag: str | None = None, warm: bool = True, timeout_s: float | None = None):
        """Serve ``compiled`` from the next request on (in-flight requests finish on theirs); (previous, new) tags.

        With ``warm`` the new forward runs a two-token prompt on the scheduler thread first."""
        fut = self.scheduler.swap(compiled, tag or forward_tag(compiled), warm=warm)
        return fut.result(timeout_s)

    def measure_step(self, context: int, reps: int = 30, warmup: int = 5) -> dict:
        """The serving forward's decode step at ``context``, timed by the runtime's clock between requests.

        What single-stream TPOT is compared with (benchmarks/serve.py): the same forward object, the
        same device, ``tkcc.runtime.timing.time_eager`` (CUDA events on a GPU), on two input sets with
        the KV cache filled to ``context``; run on the scheduler thread, so no request shares the cache.
        With slots it times the ``decode_slots`` step (every slot at ``context``), once the serving
        Program's slots are drained (no request is admitted there meanwhile)."""
        from tkcc.runtime.timing import time_eager
        from tkcc.traffic.workload import Bucket

        if not 0 <= int(context) < self.max_cache_len or not 1 <= int(reps) <= 10_000:
            raise TkccError(f"measure_step: context must be in 0..{self.max_cache_len - 1} and reps in 1..10000")

        def run():
            served = self.scheduler.current
            program = served.program
            dev = torch.device(program.meta.get("device", "cpu"))
            gen = torch.Generator().manual_seed(0)
            phase = "decode_slots" if program.meta.get("slots") else "decode"
            sets = [program.inputs(phase, Bucket("decode", 1, int(context)), gen) for _ in range(2)]
            try:
                t = sorted(time_eager(served.compiled.forwards[phase], sets, int(reps), int(warmup), dev))
            finally:
                program.reset_state()
            return {"forward": served.tag, "context": int(context), "median_ms": 1e3 * t[len(t) // 2],
                    "p10_ms": 1e3 * t[len(t) // 10], "p90_ms": 1e3 * t[(9 * len(t)) // 10], "samples": len(t),
                    "device": str(dev), "clock": "tkcc.runtime.timing.time_eager", "phase": phase,
                    "slots": int(program.meta.get("slots") or 1)}
        return self.scheduler.call(run, quiet=lambda: self.scheduler.current.program).result()

    def status(self) -> dict:
        s = self.scheduler
        return {"model": self.model_name, "forward": s.current.tag, "waiting": s.waiting,
                "running": s.num_running, "slots": s.slots, "served": s.served, "swaps": s.swaps,
                "trace": str(self.recorder.path) if self.recorder else None, "moe_counts": s.moe_counts,
                "moe_note": self.moe_note or s.moe_note, "ships": list(self.swapper.history) if self.swapper else [],
                "swap_failures": list(self.swapper.failures) if self.swapper else [],
                "decode_graph": decode_graph(s.current.compiled),
                "max_cache_len": self.max_cache_len, "tokenizer": self.tokenizer.name,
                "watch": self.watcher.status() if self.watcher is not None else None}

    def close(self) -> None:
        self.scheduler.stop()


__all__ = ["Server", "forward_tag", "warm_up"]
