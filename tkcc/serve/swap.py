"""Hot swaps into the live server: build a shipped candidate beside the serving forward, then switch.

``Swapper.ship(spec)`` takes a candidate as the engine names it (``{"plan":
[...]}``, ``{"baseline": true}``, or ``{"artifact": DIR}``), builds it with
the server's ``ForwardBuilder`` (``tkcc.compile`` with the golden check, or
``tkcc.load``) on a Program no request is running on, warms it up there, and
swaps it in (``Scheduler.swap``): requests that started before finish on the
forward they started with. Plans are built on one of two Programs (captures
of the same model sharing its weights, each with its own KV cache): the
serving one is never touched, so a build's checks cannot disturb a request.
One build at a time.

``ShippingEvaluator`` wraps a campaign Evaluator (the engine's) so that a ship
or a revert decided by ``tkcc watch`` or ``tkcc campaign`` also reaches the
server: in this process (``--watch``) or over HTTP (``AdminClient``, the
``/admin/swap`` endpoint, for ``tkcc watch --serve URL``).
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from tkcc.errors import TkccError
from tkcc.runtime.client import read_token
from tkcc.serve.scheduler import warm_up

MAX_PROGRAMS = 2  # the serving Program and the one the next candidate is built on


class Swapper:
    def __init__(self, server, builder):
        self.server, self.builder = server, builder
        self.history: list[dict] = []
        self._lock = threading.Lock()
        first = server.scheduler.current.program
        self._programs = [first] if builder.can_build_on(first) else []

    def ship(self, spec: dict) -> dict:
        """Build ``spec`` and swap it in; returns what served before, what serves now and what it cost."""
        if not isinstance(spec, dict):
            raise TkccError(f"a candidate to ship is a JSON object, got {type(spec).__name__}")
        with self._lock:
            t0 = time.perf_counter()
            program = self._free_program() if self.builder.needs_program(spec) else None
            compiled, tag = self.builder.build(spec, program)
            built = time.perf_counter()
            if compiled.program is not program and program is not None:
                raise TkccError("the builder did not build on the Program it was given")
            if compiled.program is not self.server.scheduler.current.program:
                warm_up(compiled)  # its own cache: no request runs there, so warm here, off the scheduler
                warm = False
            else:
                warm = True
            prev, now = self.server.swap(compiled, tag, warm=warm)
            rec = {"time": time.time(), "previous": prev, "current": now, "spec": spec,
                   "build_s": round(built - t0, 3), "swap_s": round(time.perf_counter() - built, 3)}
            self.history.append(rec)
            return rec

    def _free_program(self):
        """A Program of the served model that no request can be running on (captured when none is)."""
        sched = self.server.scheduler
        in_use = sched.call(sched.programs_in_use).result()
        for p in self._programs:
            if id(p) not in in_use:
                return p
        p = self.builder.capture()
        self._programs = [q for q in self._programs if id(q) in in_use][: MAX_PROGRAMS - 1] + [p]
        return p


class ShippingEvaluator:
    """A campaign Evaluator whose ``ship`` also swaps the candidate into a live server (``ship_to(spec)``)."""

    def __init__(self, inner, ship_to):
        self.inner, self.ship_to = inner, ship_to
        self.shipped: list[dict] = []

    def __getattr__(self, name):  # build, measure, workload_fingerprint, validation, device_type, ...
        return getattr(self.inner, name)

    def ship(self, key: str) -> None:
        self.inner.ship(key)  # the engine re-validates it on the slow tier first
        spec = self.inner.spec_of(key)
        self.shipped.append(self.ship_to(spec))


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
