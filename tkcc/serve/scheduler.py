"""The scheduler: one thread runs every model step; requests wait in a bounded FIFO queue.

Why one thread: a Program's static KV cache holds one sequence per row, and
running every step (and every swap, warm-up and MoE count) on one thread
means two requests can never interleave on one cache row, whichever forwards
share it. It is also the only thread of the server process that uses the
device: a swap's build (``tkcc.compile`` with its golden check, or
``tkcc.load``), its CUDA-graph captures and its warm-up run here as a control
too, because a capture and its probe change process-wide state (the
sync-debug mode, the allocator's capture pools, the one capture stream) under
any other thread that launches work. On the H200 a swap captured beside the
serving thread failed a request ("operation not permitted when stream is
capturing") and left the new forward decoding eagerly. The cost: serving
pauses while a swap builds (``Swapper`` records it as ``paused_s``).

Requests beyond the streams being served wait in a FIFO queue of
``max_queue``; past that, ``submit`` raises ``QueueFull`` with a Retry-After
estimate (the HTTP side answers 429).

Batch 1 (the fast path): a batch-1 Program serves one request at a time,
from prefill to its last token, through ``CompiledModel.stream``.

Batch B (a forward compiled for B slots, ``tkcc.frontend.slots``): up to B
requests decode together, one ``decode_slots`` step for all of them per
iteration (``tkcc.frontend.slot_batch.SlotBatch``). Between steps the
scheduler admits waiting requests into free slots (each one's prefill, on the
staging row, then a copy into its slot) and a request that finishes (its
``max_tokens``, a stop string, end of sequence, a cancel, its deadline) frees
its slot at once for the next. A row's tokens depend only on that row, so a
request gets the tokens it would get served alone on the same forward; free
slots compute junk in their own rows only.

Swaps: ``swap(compiled)`` is applied on the scheduler thread before the next
request starts. A request pins the forward it started with and finishes on
it, so every token a request gets is one that forward produced, and no
request fails because of a swap. ``call(fn)`` runs any function there the
same way (the swapper uses it to know which Programs are free). With slots,
requests of the previous forward keep decoding on its Program (its own KV
cache: the swapper builds on another one) while new requests start on the
new forward, so a step per forward runs until the old ones are done. A
control that must not share a Program's cache with live requests (a swap onto
the serving Program itself, ``measure_step``) waits until that Program's
slots are drained, and no request is admitted there meanwhile.

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
    slot: int | None = None  # with slots: its row of the KV cache, while it decodes
    batch: object = None     # with slots: the SlotBatch it decodes in (None once its slot is freed)

    @property
    def max_tokens(self) -> int:
        return self.stop.max_tokens

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    def __init__(self, served: Served, *, max_queue: int = 64, recorder=None, moe_counts: str = "all",
                 metrics=None, clock: Callable[[], float] = time.monotonic, read_late: bool | None = None):
        if max_queue < 0:
            raise TkccError(f"max_queue must be >= 0, got {max_queue}")
        if moe_counts not in ("all", "idle", "off"):
            raise TkccError(f"moe_counts must be all, idle or off, got {moe_counts!r}")
        self.slots = slots_of(served.compiled)
        # with slots: launch step i+1 before reading step i's ids (default: on CUDA, where it keeps the GPU busy)
        self.read_late = read_late
        self.current = served
        self.max_queue = int(max_queue)
        self.recorder, self.metrics, self.clock = recorder, metrics, clock
        self._in_order = None  # with slots: the trace's lines held back until earlier arrivals are written
        if recorder is not None and self.slots > 1:
            from tkcc.serve.recorder import ArrivalOrder

            self._in_order = ArrivalOrder(recorder.record)
        self.moe_counts = moe_counts
        self.t0 = clock()
        self._queue: deque[Job] = deque()
        self._controls: deque = deque()
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._stopping = False
        self.running: Job | None = None  # batch 1: the request being served
        self._live: list[Job] = []  # slots: the requests decoding, each with its .slot
        self._batches: dict[int, object] = {}  # slots: id(Program) -> its SlotBatch
        self._pending: list = []  # slots on CUDA: launched steps whose tokens are not read yet
        self._service_s = None  # moving average of a request's service time (Retry-After)
        self._counter_of: tuple | None = None  # (program, its ExpertCounter or None)
        self.swaps = 0
        self.served = 0  # requests answered (see _answer)
        self._served_lock = threading.Lock()
        self.moe_note: str | None = None
        loop = self._loop if self.slots == 1 else self._loop_slots
        self._thread = threading.Thread(target=loop, name="tkcc-serve-scheduler", daemon=True)

    # ---- the HTTP side -------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        """Requests being decoded now (at most the forward's slots)."""
        return len(self._live) + (self.running is not None)

    def queued(self) -> list[Job]:
        """The waiting jobs, oldest first (a snapshot)."""
        with self._cv:
            return list(self._queue)

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` (one request's prompts) together, in arrival order, or raise QueueFull."""
        with self._cv:
            if self._stopping:
                raise TkccError("the server is shutting down")
            if len(self._queue) + len(jobs) + self.num_running > self.max_queue + self.slots:
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
        return max(1, min(3600, math.ceil(per * (len(self._queue) + 1) / self.slots)))

    def swap(self, compiled, tag: str, warm: bool = False) -> concurrent.futures.Future:
        """Serve ``compiled`` from the next request on; the future resolves with (previous tag, new tag)."""
        self._check_slots(compiled)

        def apply():
            if warm:
                warm_up(compiled)
            return self.swap_here(compiled, tag)
        # warming up (or serving with slots) on a Program whose cache rows live requests hold would clobber them
        return self.call(apply, quiet=compiled.program)

    def swap_here(self, compiled, tag: str) -> tuple[str, str]:
        """``swap`` from inside a control (on the scheduler thread): serve ``compiled`` from the next request on.

        The forward replaced is not freed here while a request still runs on it: each request holds the one
        it started with (``Job.served``, and with slots its ``SlotBatch``) until its last token, and lets go of
        it on this thread, so its graphs and memory go when its last request is done, between two steps."""
        self.check_thread("a swap")
        self._check_slots(compiled)
        prev, self.current = self.current, Served(compiled, tag)
        self.swaps += 1
        if self.metrics is not None:
            self.metrics.on_swap(tag)
        return prev.tag, tag

    def _check_slots(self, compiled) -> None:
        if slots_of(compiled) != self.slots:
            raise TkccError(f"cannot swap in a forward for {slots_of(compiled)} concurrent sequence(s): this server "
                            f"serves {self.slots} (compile it with the same batch)")

    def on_thread(self) -> bool:
        """True on the scheduler thread (where every model step, build, capture and warm-up runs)."""
        return threading.current_thread() is self._thread

    def check_thread(self, what: str) -> None:
        if self._thread.is_alive() and not self.on_thread():
            raise TkccError(f"{what} runs on the scheduler thread (Scheduler.call), not on "
                            f"{threading.current_thread().name}: the device is only ever used from there")

    def call(self, fn: Callable, quiet=None) -> concurrent.futures.Future:
        """Run ``fn()`` on the scheduler thread before the next request starts (with slots: between steps).

        ``quiet``: a Program (or a function returning one, asked each time) whose slots must hold no live
        request when ``fn`` runs: it waits for them to finish, and none is admitted there meanwhile. Batch 1
        runs controls between requests anyway."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise TkccError("the server is shutting down")
            self._controls.append((fn, fut, quiet))
            self._cv.notify_all()
        return fut

    def programs_in_use(self) -> set[int]:
        """ids of the Programs a request may run on now (call it through ``call`` to get a stable answer)."""
        ids = {id(self.current.program)}
        for job in [self.running, *self._live]:
            if job is not None and job.served is not None:
                ids.add(id(job.served.program))
        return ids

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel the request being served, refuse the waiting ones (503), stop the thread."""
        with self._cv:
            self._stopping = True
            for job in [self.running, *self._live]:
                if job is not None:
                    job.cancel()
            left = list(self._queue)
            self._queue.clear()
            controls = list(self._controls)
            self._controls.clear()
            self._cv.notify_all()
        for j in left:
            j.deliver(Failed(503, "the server is shutting down", "server_error"))
        for _, fut, _quiet in controls:
            fut.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self.recorder is not None:
            if self._in_order is not None:
                self._in_order.flush()
            self.recorder.close()

    # ---- the scheduler thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._controls or self._queue or self._stopping):
                    self._cv.wait()
                if self._controls:
                    fn, fut, _quiet = self._controls.popleft()
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
                    self._answer(job, Failed(500, f"the server failed serving this request: {type(e).__name__}: {e}"))
            finally:
                with self._cv:
                    self.running = None
                self._report_queue()

    def _serve(self, job: Job) -> None:
        if not self._start(job):
            return
        served = self.current
        job.served, job.forward = served, served.tag
        finish = None
        try:
            prompt = torch.tensor([job.prompt], dtype=torch.long)
            steps = served.compiled.stream(prompt, job.max_tokens)
            try:
                for tok in token_ids(steps, served.program):
                    finish = self._push(job, tok)
                    if finish is not None:
                        break
            finally:
                steps.close()
        except Exception as e:  # noqa: BLE001 - a forward that raises fails its request, not the server
            job.finish, job.ended = "error", self.clock()
            self._answer(job, Failed(500, f"the forward {served.tag} failed: {type(e).__name__}: {e}"))
            self._after(job)
            return
        if job.finish is None:
            self._end(job, finish or "length")
        else:
            self._after(job)

    def _push(self, job: Job, tok: int) -> str | None:
        """Hand one generated id to ``job``; None while it goes on, else why it stopped (its finish is
        delivered when the TextStop ended it; a cancel or the deadline is left for ``_end``)."""
        if job.cancelled:
            return "cancelled"
        t = self.clock()
        if job.first is None:
            job.first = t
        job.tokens.append(tok)
        text, fin = job.stop.push(tok)
        if fin is not None:
            job.ended = t
            job.finish = fin
            job.deliver(Token(tok, ""))
            self._answer(job, Done(fin, text))
            return fin
        job.deliver(Token(tok, text))
        if t - job.arrival > job.timeout_s:
            return "timeout"
        return None

    def _start(self, job: Job) -> bool:
        """The checks before a request's first step: False if it ended here (cancelled, or its deadline)."""
        now = self.clock()
        job.started = now
        if job.cancelled:
            self._end(job, "cancelled")
            return False
        if now - job.arrival > job.timeout_s:
            job.finish = "timeout"
            job.ended = now
            self._answer(job, Failed(504, f"the request waited {now - job.arrival:.1f} s in the queue, past its "
                                    f"timeout of {job.timeout_s:g} s", "timeout"))
            self._after(job)
            return False
        return True

    def _end(self, job: Job, reason: str) -> None:
        job.finish, job.ended = reason, self.clock()
        text = job.stop.end(reason)
        self._answer(job, Done(reason, text))
        self._after(job)

    def _answer(self, job: Job, last) -> None:
        """Deliver ``job``'s last event (Done or Failed), counted as served first: a client holding its answer
        sees it in the admin status, while the book-keeping (``_after``) runs after the answer went out."""
        with self._served_lock:
            self.served += 1
        job.deliver(last)

    def _after(self, job: Job) -> None:
        """Book-keeping after the answer went out: service time, MoE counts, the trace line, metrics."""
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
        if self._in_order is not None:
            self._in_order.add(job.seq, job.arrival - self.t0, job.prompt, len(job.tokens), moe=moe)
        elif self.recorder is not None:
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
            self.metrics.on_queue(len(self._queue), self.num_running)

    # ---- the scheduler thread, with slots ------------------------------------------------------
    def _loop_slots(self) -> None:
        """Controls, then admissions into free slots, then one step of every Program with live requests."""
        late = self.read_late
        if late is None:
            late = torch.device(self.current.program.meta.get("device", "cpu")).type == "cuda"
        while True:
            with self._cv:
                while not (self._controls or self._queue or self._live or self._pending or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    break
            try:
                self._run_controls()
                self._admit_waiting()
                launched = [self._launch(b) for b in list(self._batches.values()) if b.num_live]
                if not late:
                    self._collect(launched)
                    launched = []
                done, self._pending = self._pending, launched
                self._collect(done)  # on CUDA: the step before, read while this one runs
                self._drop_idle_batches()
            except Exception:  # noqa: BLE001 - book-keeping that fails must not stop the server
                traceback.print_exc()
            self._report_queue()
        for job in list(self._live):  # stopping: every live request ends here
            self._retire(job, "cancelled")
        self._pending = []

    def _run_controls(self) -> None:
        """Run the waiting controls in order; one whose ``quiet`` Program still has live requests waits."""
        while True:
            with self._cv:
                if not self._controls:
                    return
                fn, fut, quiet = self._controls[0]
                if quiet is not None and self._live_on(_program(quiet)):
                    return
                self._controls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - the caller gets it
                    fut.set_exception(e)

    def _live_on(self, program) -> bool:
        b = self._batches.get(id(program))
        return b is not None and b.num_live > 0

    def _admit_waiting(self) -> None:
        while True:
            served = self.current
            with self._cv:
                if not self._queue:
                    return
                if any(q is not None and _program(q) is served.program for _, _, q in self._controls):
                    return  # a control waits for this Program's slots to drain
                batch = self._batch_for(served)
                if batch is None or not batch.free:
                    return
                job = self._queue.popleft()
            self._report_queue()
            self._admit(job, served, batch)

    def _batch_for(self, served: Served):
        """The SlotBatch of ``served``'s Program, decoding with its forwards (None: another forward's requests
        still hold that Program's slots)."""
        from tkcc.frontend.slot_batch import SlotBatch

        b = self._batches.get(id(served.program))
        if b is None:
            b = self._batches[id(served.program)] = SlotBatch(served.program, served.compiled.forwards)
            b.served = served
        elif b.served is not served:
            if b.num_live:
                return None
            b.rebind(served.compiled.forwards)
            b.served = served
        return b

    def _admit(self, job: Job, served: Served, batch) -> None:
        """Prefill ``job`` into a free slot and hand it its first token."""
        if not self._start(job):
            return
        job.served, job.forward = served, served.tag
        try:
            slot, tok = batch.admit(job.prompt)
            first = int(tok)
        except Exception as e:  # noqa: BLE001 - a forward that raises fails its request, not the server
            job.finish, job.ended = "error", self.clock()
            self._answer(job, Failed(500, f"the forward {served.tag} failed: {type(e).__name__}: {e}"))
            self._after(job)
            return
        job.slot, job.batch = slot, batch
        self._live.append(job)
        why = self._push(job, first)
        if why is not None:
            self._retire(job, why)

    def _launch(self, batch):
        """Start one step of ``batch``: (batch, [(slot, job)] it ran for, a function that returns its ids)."""
        owners = [(j.slot, j) for j in self._live if j.batch is batch]
        try:
            nxt = batch.step()
        except Exception as e:  # noqa: BLE001 - the forward failed: its requests fail, the server goes on
            for _, job in owners:
                self._fail(job, f"the forward {job.forward} failed: {type(e).__name__}: {e}")
            return batch, [], lambda: []
        return batch, owners, read_ids(nxt, batch)

    def _collect(self, launched: list) -> None:
        for _batch, owners, read in launched:
            ids = read()
            for slot, job in owners:
                if job.finish is not None or job.batch is None:
                    continue  # it ended at an earlier step (the host reads one step late on CUDA)
                why = self._push(job, ids[slot])
                if why is not None:
                    self._retire(job, why)

    def _retire(self, job: Job, why: str) -> None:
        """``job`` is done: free its slot now, then its finish (if not delivered yet) and book-keeping."""
        if job.batch is not None:
            job.batch.release(job.slot)
            job.batch = None
        if job in self._live:
            self._live.remove(job)
        if job.finish is None:
            self._end(job, why)
        else:
            self._after(job)

    def _fail(self, job: Job, message: str) -> None:
        if job.batch is not None:
            job.batch.release(job.slot)
            job.batch = None
        if job in self._live:
            self._live.remove(job)
        job.finish, job.ended = "error", self.clock()
        self._answer(job, Failed(500, message))
        self._after(job)

    def _drop_idle_batches(self) -> None:
        """Forget the SlotBatch of a Program out of service once its last request is done."""
        cur = id(self.current.program)
        for key in [k for k, b in self._batches.items() if k != cur and not b.num_live]:
            del self._batches[key]


def _program(quiet):
    return quiet() if callable(quiet) else quiet


def slots_of(compiled) -> int:
    """Sequences a forward serves together: its Program's slots (``tkcc.frontend.slots``), else 1."""
    meta = compiled.program.meta
    batch = int(meta.get("batch", 1))
    if batch != 1:
        raise TkccError(f"this forward was captured for batch {batch} with one cache position for all rows, so "
                        "rows of different requests cannot advance independently; compile it for slots instead "
                        "(tkcc.compile(model, trace, batch=B), tkcc serve --batch B)")
    return int(meta.get("slots") or 1)


def read_ids(nxt: torch.Tensor, batch) -> Callable[[], list[int]]:
    """A function returning a step's ids as ints: on CPU at once; on CUDA from a pinned copy that started now,
    so the next step can be launched before this one's ids are read (two buffers per SlotBatch in turn)."""
    if nxt.device.type != "cuda":
        ids = nxt.tolist()
        return lambda: ids
    bufs = getattr(batch, "_host_ids", None)
    if bufs is None:
        bufs = batch._host_ids = [torch.empty(nxt.shape, dtype=nxt.dtype, pin_memory=True) for _ in range(2)]
        batch._host_turn = 0
    buf = bufs[batch._host_turn]
    batch._host_turn ^= 1
    buf.copy_(nxt, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()

    def wait() -> list[int]:
        ev.synchronize()
        return buf.tolist()
    return wait


def warm_up(compiled) -> None:
    """Run a two-token prompt through prefill and one decode step (first-call compiles, allocations)."""
    for _ in compiled.stream(torch.tensor([[0, 1]], dtype=torch.long), 2):
        pass


def decode_graph(compiled) -> dict | None:
    """How a forward's decode step runs on a GPU: replayed from a CUDA graph, or eagerly and why (None: not a
    graph-cached step, e.g. on CPU or a step that replays its own graph). Read it after ``warm_up``."""
    from tkcc.kernels.graph_replay import GraphCache

    forwards = getattr(compiled, "forwards", None) or {}
    phase = "decode_slots" if "decode_slots" in forwards else "decode"
    step = forwards.get(phase)
    if not isinstance(step, GraphCache):
        return None
    r = step.report()
    return {"phase": phase, "graphs": r["graphs"], "replays": r["replays"], "eager_calls": r["eager_calls"],
            "refused": r["refused"], "replayed": r["graphs"] > 0}


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
