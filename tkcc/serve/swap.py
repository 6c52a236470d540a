"""Hot swaps into the live server: build a shipped candidate on a Program no request runs on, then switch.

``Swapper.ship(spec)`` takes a candidate as the engine names it (``{"plan":
[...]}``, ``{"baseline": true}``, or ``{"artifact": DIR}``), checks the spec,
then, as one control on the scheduler thread (between requests; with slots,
between steps), builds it with the server's ``ForwardBuilder``
(``tkcc.compile`` with the golden check, or ``tkcc.load``) on a Program no
request is running on, warms it up there (the decode step's CUDA graph is
captured then) and swaps it in (``Scheduler.swap_here``): requests that
started before finish on the forward they started with, which is freed on
that thread once its last request is done.

Why on the scheduler thread, not beside it: every device call of the server
process is made from that one thread, so a build's captures and probes never
run while another thread launches (see ``tkcc.serve.scheduler``). Serving
pauses for the build (``paused_s`` in each ship's record); nothing a build
does can fail a request. A build that fails costs the swap only: ``ship``
raises ``SwapError`` naming the stage, the cause and the forward still
serving. A forward whose decode step could not be captured as a CUDA graph on
the GPU (it would decode eagerly, several times slower than the engine
measured it) is refused the same way.

Plans are built on one of two Programs (captures of the same model sharing
its weights, each with its own KV cache): the serving one is never touched.

``ShippingEvaluator`` wraps a campaign Evaluator (the engine's) so that a ship
or a revert decided by ``tkcc watch`` or ``tkcc campaign`` also reaches the
server: in this process (``--watch``) or over HTTP (``AdminClient``, the
``/admin/swap`` endpoint, for ``tkcc watch --serve URL``).
"""
from __future__ import annotations

import concurrent.futures
import json
import sys
import time
import traceback
import urllib.error
import urllib.request

from tkcc.errors import TkccError
from tkcc.runtime.client import read_token
from tkcc.serve.scheduler import decode_graph, warm_up

MAX_PROGRAMS = 2  # the serving Program and the one the next candidate is built on


class SwapError(TkccError):
    """A swap that did not happen: the server still serves ``serving``. ``status``: 400 when the candidate was
    refused (a bad spec, a failed golden check, a decode step that cannot be captured), 500 when building it
    raised something else."""

    def __init__(self, message: str, status: int, serving: str):
        super().__init__(message)
        self.status, self.serving = status, serving


class Swapper:
    def __init__(self, server, builder):
        self.server, self.builder = server, builder
        self.history: list[dict] = []
        self.failures: list[dict] = []
        first = server.scheduler.current.program
        self._programs = [first] if builder.can_build_on(first) else []

    def ship(self, spec: dict) -> dict:
        """Build ``spec`` and swap it in; returns what served before, what serves now and what it cost.

        Raises SwapError (the server serving on as before) when the candidate could not be built or swapped."""
        sched = self.server.scheduler
        try:
            self.builder.check(spec)
        except TkccError as e:
            raise SwapError(f"{e}; still serving {sched.current.tag}", 400, sched.current.tag) from None
        queued = time.perf_counter()
        if sched.on_thread():  # already in a control (a call that ships): waiting for another would deadlock
            return self._ship_here(spec, queued)
        try:
            fut = sched.call(lambda: self._ship_here(spec, queued))
            return fut.result()
        except concurrent.futures.CancelledError:
            raise SwapError("the server stopped before the swap ran", 503, sched.current.tag) from None
        except SwapError:
            raise
        except TkccError as e:  # the scheduler is shutting down
            raise SwapError(f"{e}; nothing was swapped", 503, sched.current.tag) from None

    def _ship_here(self, spec: dict, queued: float) -> dict:
        """The ship itself, on the scheduler thread: nothing else uses the device meanwhile."""
        sched = self.server.scheduler
        sched.check_thread("a ship")
        serving, where = sched.current.tag, {"stage": "choosing a Program"}
        t0 = time.perf_counter()
        try:
            rec = self._build_and_swap(spec, where)
        except Exception as e:  # noqa: BLE001 - a failed build costs the swap, never the server or a request
            status = 400 if isinstance(e, TkccError) else 500
            msg = (f"could not ship {_spec_text(spec)}: {where['stage']} failed: {type(e).__name__}: {e}; "
                   f"still serving {serving}")
            if status == 500:
                traceback.print_exc(file=sys.stderr)
            traceback.clear_frames(e.__traceback__)  # the failed candidate goes now, on this thread
            self.failures.append({"time": time.time(), "spec": spec, "stage": where["stage"], "error": msg})
            raise SwapError(msg, status, serving) from None
        done = time.perf_counter()
        rec.update(paused_s=round(done - t0, 3), waited_s=round(t0 - queued, 3))
        self.history.append(rec)
        return rec

    def _build_and_swap(self, spec: dict, where: dict) -> dict:
        sched = self.server.scheduler
        t0 = time.perf_counter()
        program = self._free_program() if self.builder.needs_program(spec) else None
        where["stage"] = "building"
        compiled, tag = self.builder.build(spec, program)
        if program is not None and compiled.program is not program:
            raise TkccError("the builder did not build on the Program it was given")
        if id(compiled.program) in sched.programs_in_use():
            raise TkccError("the candidate was built on a Program a request runs on")
        built = time.perf_counter()
        where["stage"] = "warming up"
        warm_up(compiled)  # its own KV cache, no request on it: the decode graph is captured here
        graph = decode_graph(compiled)
        if graph is not None and not graph["replayed"] and _on_gpu(compiled):
            raise TkccError(f"its {graph['phase']} step could not be captured as a CUDA graph here ("
                            f"{'; '.join(graph['refused']) or 'no reason recorded'}), so it would decode "
                            "eagerly, several times slower than the engine measured it")
        where["stage"] = "swapping"
        prev, now = sched.swap_here(compiled, tag)
        return {"time": time.time(), "previous": prev, "current": now, "spec": spec,
                "build_s": round(built - t0, 3), "swap_s": round(time.perf_counter() - built, 3),
                "decode_graph": graph}

    def _free_program(self):
        """A Program of the served model that no request can be running on (captured when none is)."""
        in_use = self.server.scheduler.programs_in_use()  # on the scheduler thread: exact until we return
        for p in self._programs:
            if id(p) not in in_use:
                return p
        p = self.builder.capture()
        self._programs = [q for q in self._programs if id(q) in in_use][: MAX_PROGRAMS - 1] + [p]
        return p


def _on_gpu(compiled) -> bool:
    return str(compiled.program.meta.get("device", "cpu")).startswith("cuda")


def plan_of(spec: dict):
    """The PassPlan a candidate spec names: ``{"baseline": true}`` the empty plan, ``{"plan": [...]}`` that plan;
    None for an artifact. Raises PlanError (a TkccError) naming a bad step."""
    from tkcc.passes.plan import PassPlan

    if "artifact" in spec:
        return None
    return PassPlan() if spec.get("baseline") else PassPlan.from_json(spec["plan"])


def _spec_text(spec) -> str:
    if not isinstance(spec, dict):
        return repr(spec)[:80]
    if spec.get("baseline"):
        return "the baseline (empty plan)"
    if "artifact" in spec:
        return f"artifact {spec['artifact']}"
    if isinstance(spec.get("plan"), list):
        return "plan [" + ", ".join(str(s.get("name")) if isinstance(s, dict) else "?" for s in spec["plan"]) + "]"
    return json.dumps(spec, default=str)[:120]


class ShippingEvaluator:
    """A campaign Evaluator whose ``ship`` also swaps the candidate into a live server (``ship_to(spec)``)."""

    def __init__(self, inner, ship_to):
        self.inner, self.ship_to = inner, ship_to
        self.shipped: list[dict] = []

    def __getattr__(self, name):  # build, measure, workload_fingerprint, validation, device_type, ...
        return getattr(self.inner, name)

    def ship(self, key: str) -> None:
        """The engine ships ``key`` (it re-validates it on the slow tier first), then the server swaps it in. A
        swap the server refuses or fails is recorded (``{"error", "spec"}``) and the campaign goes on: the
        server serves on what it served, and the watch loop asks it again after the campaign."""
        self.inner.ship(key)
        spec = self.inner.spec_of(key)
        try:
            self.shipped.append(self.ship_to(spec))
        except TkccError as e:
            print(f"tkcc serve: the server did not swap in {key}: {e}", file=sys.stderr, flush=True)
            self.shipped.append({"error": str(e), "spec": spec, "candidate": key})


class AdminClient:
    """The server's admin endpoints over HTTP (``/admin/swap``, ``/admin/status``), with its admin token."""

    def __init__(self, url: str, token: str | None = None, token_file: str | None = None, timeout_s: float = 3600):
        if token is None:
            token = read_token(token_file, "the server's admin token", "the server's admin token is needed: give "
                               "its --admin-token-file", "is a server running with that --admin-token-file?",
                               TkccError)
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read())["error"]["message"]
            except Exception:  # noqa: BLE001 - whatever the body, the status says enough
                msg = e.reason
            raise TkccError(f"{self.url}{path}: HTTP {e.code}: {msg}") from None
        except (urllib.error.URLError, OSError) as e:
            raise TkccError(f"{self.url}{path}: {e}") from None

    def ship(self, spec: dict) -> dict:
        return self._call("POST", "/admin/swap", spec)

    def status(self) -> dict:
        return self._call("GET", "/admin/status")

    def measure_step(self, context: int, reps: int = 30) -> dict:
        return self._call("POST", "/admin/measure", {"context": context, "reps": reps})
