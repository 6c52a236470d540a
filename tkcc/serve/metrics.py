"""Prometheus metrics of the server (``/metrics``), named after vLLM's where one exists.

Each server has its own ``CollectorRegistry`` (two servers in one process,
as in the tests, never share a counter). Latencies are histograms in seconds:
queue time, time to first token, time per output token (the mean gap after
the first token, per request), end-to-end; and the cost of taking MoE counts.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0,
            60.0, 120.0)
_TPOT = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    def __init__(self, model: str):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.model = model
        lab = ["model"]
        self.running = Gauge("tkcc_num_requests_running", "requests being decoded", lab, registry=r)
        self.waiting = Gauge("tkcc_num_requests_waiting", "requests waiting in the queue", lab, registry=r)
        self.finished = Counter("tkcc_request_success", "requests answered, by finish reason",
                                lab + ["finished_reason"], registry=r)
        self.rejected = Counter("tkcc_request_rejected", "requests refused, by HTTP status", lab + ["status"],
                                registry=r)
        self.prompt_tokens = Counter("tkcc_prompt_tokens", "prompt tokens processed", lab, registry=r)
        self.generation_tokens = Counter("tkcc_generation_tokens", "tokens generated", lab, registry=r)
        self.queue_time = Histogram("tkcc_request_queue_time_seconds", "time waiting in the queue", lab,
                                    buckets=_LATENCY, registry=r)
        self.ttft = Histogram("tkcc_time_to_first_token_seconds", "arrival to the first token", lab,
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("tkcc_time_per_output_token_seconds", "mean gap between tokens after the first",
                              lab, buckets=_TPOT, registry=r)
        self.e2e = Histogram("tkcc_e2e_request_latency_seconds", "arrival to the last token", lab,
                             buckets=_LATENCY, registry=r)
        self.moe = Histogram("tkcc_moe_count_seconds", "scheduler time spent taking one request's MoE counts",
                             lab, buckets=_LATENCY, registry=r)
        self.swaps = Counter("tkcc_forward_swaps", "forwards swapped into the live server", lab, registry=r)
        self.forward = Info("tkcc_forward", "the forward serving new requests", lab, registry=r)

    def on_queue(self, waiting: int, running: int) -> None:
        self.waiting.labels(self.model).set(waiting)
        self.running.labels(self.model).set(running)

    def on_reject(self, status: int) -> None:
        self.rejected.labels(self.model, str(status)).inc()

    def on_swap(self, tag: str) -> None:
        self.swaps.labels(self.model).inc()
        self.set_forward(tag)

    def set_forward(self, tag: str) -> None:
        self.forward.labels(self.model).info({"tag": str(tag)})

    def on_moe_count(self, seconds: float) -> None:
        self.moe.labels(self.model).observe(seconds)

    def on_finish(self, job) -> None:
        m = self.model
        self.finished.labels(m, job.finish or "unknown").inc()
        self.prompt_tokens.labels(m).inc(len(job.prompt))
        self.generation_tokens.labels(m).inc(len(job.tokens))
        if job.started is not None:
            self.queue_time.labels(m).observe(max(0.0, job.started - job.arrival))
        if job.first is not None:
            self.ttft.labels(m).observe(job.first - job.arrival)
            if job.ended is not None and len(job.tokens) > 1:
                self.tpot.labels(m).observe((job.ended - job.first) / (len(job.tokens) - 1))
        if job.ended is not None:
            self.e2e.labels(m).observe(job.ended - job.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
