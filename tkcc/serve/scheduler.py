"""The scheduler: one thread runs every model step; requests wait in a bounded FIFO queue.

Why one thread: a Program's static KV cache holds one sequence per batch row,
and the captured decode step takes one ``cache_position`` for every row, so
a batch-1 Program serves one request at a time, from prefill to its last
token. Running every step (and every swap, warm-up and MoE count) on one
thread makes that true by construction: two requests can never interleave on
one cache, whichever forwards share it. Requests beyond the one being served
wait in a FIFO queue of ``max_queue``; past that, ``submit`` raises
``QueueFull`` with a Retry-After estimate (the HTTP side answers 429).

Swaps: ``swap(compiled)`` is applied on the scheduler thread before the next
request starts. A request pins the forward it started with and finishes on
it, so every token a request gets is one that forward produced, and no
request fails because of a swap. ``call(fn)`` runs any function there the
same way (the swapper uses it to know which Programs are free).

Per generated id the scheduler asks the request's ``TextStop`` whether it is
finished (stop string, end of sequence, max_tokens), checks cancellation
(client gone) and the deadline, and hands (id, text) to the request's
``deliver`` callback (the HTTP side's event loop). On CUDA it reads each id
one step late: step i+1 is launched before id i is copied back, so the host
never idles the GPU between steps; a request that stops at id i has then
spent one extra step, never returned.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import math
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from tkcc.errors import TkccError


class QueueFull(TkccError):
    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"the server's queue is full ({waiting} requests waiting); retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass
class Served:
    """A forward in service: a CompiledModel (or anything with ``stream`` and ``program``) and its name."""

    compiled: object
    tag: str

    @property
    def program(self):
        return self.compiled.program


@dataclass
class Token:
    id: int
    text: str


@dataclass
class Done:
    finish: str  # stop | length | cancelled | timeout
    text: str    # text still held back, emitted with the end


@dataclass
class Failed:
    status: int
    message: str
    kind: str = "server_error"


@dataclass
class Job:
    """One prompt to complete. ``deliver`` receives Token, then Done or Failed, from the scheduler thread."""

    prompt: list[int]
    stop: object  # tkcc.serve.stops.TextStop
    deliver: Callable
    timeout_s: float
    cancelled: bool = False
    seq: int = -1
    arrival: float = 0.0
    started: float | None = None
    first: float | None = None
    ended: float | None = None
    tokens: list = field(default_factory=list)
    finish: str | None = None
    forward: str | None = None
    served: Served | None = None  # the forward it is pinned to, while it runs

    @property
    def max_tokens(self) -> int:
        return self.stop.max_tokens

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    def __init__(self, served: Served, *, max_queue: int = 64, recorder=None, moe_counts: str = "all",
                 metrics=None, clock: Callable[[], float] = time.monotonic):
        if max_queue < 0:
            raise TkccError(f"max_queue must be >= 0, got {max_queue}")
        if moe_counts not in ("all", "idle", "off"):
            raise TkccError(f"moe_counts must be all, idle or off, got {moe_counts!r}")
        batch = int(served.program.meta.get("batch", 1))
        if batch != 1:
            raise TkccError(f"this forward was captured for batch {batch}; the server runs batch-1 forwards (the "
                            "captured decode step has one cache position for all rows, so rows of different "
                            "requests cannot advance independently)")
        self.current = served
        self.max_queue = int(max_queue)
        self.recorder, self.metrics, self.clock = recorder, metrics, clock
        self.moe_counts = moe_counts
        self.t0 = clock()
        self._queue: deque[Job] = deque()
        self._controls: deque = deque()
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._stopping = False
        self.running: Job | None = None
        self._service_s = None  # moving average of a request's service time (Retry-After)
        self._counter_of: tuple | None = None  # (program, its ExpertCounter or None)
        self.swaps = 0
        self.served = 0
        self.moe_note: str | None = None
        self._thread = threading.Thread(target=self._loop, name="tkcc-serve-scheduler", daemon=True)

    # ---- the HTTP side -------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def queued(self) -> list[Job]:
        """The waiting jobs, oldest first (a snapshot)."""
        with self._cv:
            return list(self._queue)

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` (one request's prompts) together, in arrival order, or raise QueueFull."""
        with self._cv:
            if self._stopping:
                raise TkccError("the server is shutting down")
            if len(self._queue) + len(jobs) + (self.running is not None) > self.max_queue + 1:
                raise QueueFull(len(self._queue), self.retry_after())
            now = self.clock()
            for j in jobs:
                j.seq, j.arrival = next(self._seq), now
                self._queue.append(j)
            self._cv.notify_all()
        self._report_queue()

    def retry_after(self) -> int:
        """Seconds until the queue has room, estimated from the recent service time (at least 1)."""
        per = self._service_s if self._service_s is not None else 1.0
        return max(1, min(3600, math.ceil(per * (len(self._queue) + 1))))

    def swap(self, compiled, tag: str, warm: bool = False) -> concurrent.futures.Future:
        """Serve ``compiled`` from the next request on; the future resolves with (previous tag, new tag)."""
        def apply():
            if warm:
                warm_up(compiled)
            prev, self.current = self.current, Served(compiled, tag)
            self.swaps += 1
            if self.metrics is not None:
                self.metrics.on_swap(tag)
            return prev.tag, tag
        return self.call(apply)

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn()`` on the scheduler thread before the next request starts."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise TkccError("the server is shutting down")
            self._controls.append((fn, fut))
            self._cv.notify_all()
        return fut

    def programs_in_use(self) -> set[int]:
        """ids of the Programs a request may run on now (call it through ``call`` to get a stable answer)."""
        ids = {id(self.current.program)}
        running = self.running
        if running is not None and running.served is not None:
            ids.add(id(running.served.program))
        return ids

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel the request being served, refuse the waiting ones (503), stop the thread."""
        with self._cv:
            self._stopping = True
            if self.running is not None:
                self.running.cancel()
            left = list(self._queue)
            self._queue.clear()
            controls = list(self._controls)
            self._controls.clear()
            self._cv.notify_all()
        for j in left:
            j.deliver(Failed(503, "the server is shutting down", "server_error"))
        for _, fut in controls:
            fut.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self.recorder is not None:
            self.recorder.close()

    # ---- the scheduler thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._controls or self._queue or self._stopping):
                    self._cv.wait()
                if self._controls:
                    fn, fut = self._controls.popleft()
                    job = None
                elif self._queue:
                    job = self._queue.popleft()
                    self.running = job
                else:
                    return
            if job is None:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - the caller gets it
                        fut.set_exception(e)
                continue
            self._report_queue()
            try:
                self._serve(job)
            except Exception as e:  # noqa: BLE001 - book-keeping that fails must not stop the server
                traceback.print_exc()
                if job.finish is None:
                    job.finish = "error"
                    job.deliver(Failed(500, f"the server failed serving this request: {type(e).__name__}: {e}"))
            finally:
                with self._cv:
                    self.running = None
                self._report_queue()

    def _serve(self, job: Job) -> None:
        now = self.clock()
        job.started = now
        if job.cancelled:
            self._end(job, "cancelled")
            return
        if now - job.arrival > job.timeout_s:
            job.finish = "timeout"
            job.ended = now
            job.deliver(Failed(504, f"the request waited {now - job.arrival:.1f} s in the queue, past its "
                                    f"timeout of {job.timeout_s:g} s", "timeout"))
            self._after(job)
            return
        served = self.current
        job.served, job.forward = served, served.tag
        finish = None
        try:
            prompt = torch.tensor([job.prompt], dtype=torch.long)
            steps = served.compiled.stream(prompt, job.max_tokens)
            try:
                for tok in token_ids(steps, served.program):
                    if job.cancelled:
                        finish = "cancelled"
                        break
                    t = self.clock()
                    if job.first is None:
                        job.first = t
                    job.tokens.append(tok)
                    text, fin = job.stop.push(tok)
                    if fin is not None:
                        job.ended = t
                        job.finish = fin
                        job.deliver(Token(tok, ""))
                        job.deliver(Done(fin, text))
                        break
                    job.deliver(Token(tok, text))
                    if t - job.arrival > job.timeout_s:
                        finish = "timeout"
                        break
            finally:
                steps.close()
        except Exception as e:  # noqa: BLE001 - a forward that raises fails its request, not the server
            job.finish, job.ended = "error", self.clock()
            job.deliver(Failed(500, f"the forward {served.tag} failed: {type(e).__name__}: {e}"))
            self._after(job)
            return
        if job.finish is None:
            self._end(job, finish or "length")
        else:
            self._after(job)

    def _end(self, job: Job, reason: str) -> None:
        job.finish, job.ended = reason, self.clock()
        text = job.stop.end(reason)
        job.deliver(Done(reason, text))
        self._after(job)

    def _after(self, job: Job) -> None:
        """Book-keeping after the answer went out: service time, MoE counts, the trace line, metrics."""
        self.served += 1
        if job.started is not None and job.ended is not None and job.tokens:
            dt = job.ended - job.started
            self._service_s = dt if self._service_s is None else 0.8 * self._service_s + 0.2 * dt
        moe = None
        served = job.served
        if served is not None and job.tokens and self._count_now():
            try:
                counter = self._counter(served.program)
                if counter is not None:
                    t = time.perf_counter()
                    moe = counter.count(job.prompt + job.tokens[:-1])
                    if self.metrics is not None:
                        self.metrics.on_moe_count(time.perf_counter() - t)
            except TkccError as e:  # a forward whose graph has no recognisable routers: record without counts
                self.moe_note = str(e)
        if self.recorder is not None:
            self.recorder.record(job.arrival - self.t0, job.prompt, len(job.tokens), moe=moe)
        if self.metrics is not None:
            self.metrics.on_finish(job)
        job.served = None

    def _count_now(self) -> bool:
        if self.moe_counts == "off" or self.recorder is None:
            return False
        return self.moe_counts == "all" or not self._queue

    def _counter(self, program):
        """The ExpertCounter of ``program`` (None for a dense model); one kept, so a retired Program is freed."""
        if self._counter_of is None or self._counter_of[0] is not program:
            from tkcc.serve.routing import ExpertCounter, is_moe

            self._counter_of = (program, ExpertCounter(program) if is_moe(program) else None)
        return self._counter_of[1]

    def _report_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.on_queue(len(self._queue), 1 if self.running is not None else 0)


def warm_up(compiled) -> None:
    """Run a two-token prompt through prefill and one decode step (first-call compiles, allocations)."""
    for _ in compiled.stream(torch.tensor([[0, 1]], dtype=torch.long), 2):
        pass


def token_ids(steps, program):
    """The ids a CompiledModel's ``stream`` yields, as ints; on CUDA each read one step late (see above)."""
    dev = torch.device(program.meta.get("device", "cpu"))
    if dev.type != "cuda":
        return (int(t[0]) for t in steps)
    bufs = [torch.empty(1, dtype=torch.long, pin_memory=True) for _ in range(2)]
    n = itertools.count()

    def start_copy(t):
        buf = bufs[next(n) % 2]  # step i's buffer is read at step i+1, before step i+2 writes it again
        buf.copy_(t[:1], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()

        def wait():
            ev.synchronize()
            return int(buf[0])
        return wait

    return one_step_late(steps, start_copy)


def one_step_late(steps, start_copy):
    """Yield each step's value after the next step was started: ``start_copy(t)`` begins reading step t
    back and returns a function that waits for it; the last value is read after the steps run out."""
    pending = None
    for t in steps:
        ready = start_copy(t)
        if pending is not None:
            yield pending()
        pending = ready
    if pending is not None:
        yield pending()
