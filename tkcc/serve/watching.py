"""``tkcc serve --http ... --watch``: the continual loop inside the server.

A thread runs ``tkcc.agents.watch.watch`` on the server's own rolling trace:
the first full window sets the reference and a campaign optimises for it; on
drift the shipped candidate is re-checked (reverted if it lost) and a new
campaign runs. Candidates are measured by a persistent engine (``tkcc
serve`` without ``--http``, started beside the server on the same device:
its side slot), and each ship or revert is rebuilt here and hot-swapped into
the live server (``ShippingEvaluator`` -> ``Swapper.ship``).

Measuring shares the device with the served traffic; the cost shows in the
served latencies (``benchmarks/serve.py`` measures it: P90 TPOT while a
campaign measures, against idle).
"""
from __future__ import annotations

import os
import threading
import traceback

from tkcc.errors import TkccError


class _ServerTrace:
    """A RollingWorkload over the server's trace that follows it across rotations (one time origin)."""

    def __init__(self, server, horizon: str):
        from tkcc.traffic.follow import RollingWorkload

        self.server = server
        self.rolling = RollingWorkload(server.recorder.path, horizon=horizon)

    def __getattr__(self, name):
        return getattr(self.rolling, name)

    def update(self) -> int:
        from tkcc.traffic.follow import TraceFollower

        n = self.rolling.update()
        path = str(self.server.recorder.path)
        if path != self.rolling.follower.path:  # rotated: read the rest of the old file, then follow the new one
            n += self.rolling.update()
            last = self.rolling.follower.last_t
            self.rolling.follower = TraceFollower(path)
            self.rolling.follower.last_t = last
            n += self.rolling.update()
        return n


class _Events(list):
    """The watch loop's event list; ``on(event)`` runs as each one is appended (the loop runs in a thread)."""

    def __init__(self, on):
        super().__init__()
        self.on = on

    def append(self, ev) -> None:
        super().append(ev)
        self.on(ev)


class ServeWatch:
    def __init__(self, server, args):
        if server.recorder is None:
            raise TkccError("--watch follows the server's own trace; it cannot run with --no-record")
        if server.swapper is None:
            raise TkccError("--watch needs a server that can build forwards")
        model = getattr(args, "model", None)
        if model is not None and os.path.isdir(model):
            raise TkccError(f"--watch: the engine that measures candidates builds built-in models; {model} is a "
                            "model directory (run `tkcc watch --serve URL` with an engine of your own instead)")
        self.server, self.args = server, args
        self.stop_event = threading.Event()
        self.error: str | None = None
        self.shipped: list = []
        self.events = _Events(self._on_event)  # tkcc.agents.watch.WatchEvent, as they happen
        self.store = None
        self.state = "starting the engine"
        self._engine = None  # the engine's Popen
        self._thread = threading.Thread(target=self._run, name="tkcc-serve-watch", daemon=True)

    def start(self) -> "ServeWatch":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the loop at its next poll; a campaign still measuring is ended with its engine (SIGTERM)."""
        self.stop_event.set()
        self._thread.join(timeout_s)
        eng = self._engine
        if eng is not None and eng.poll() is None:
            eng.terminate()
            try:
                eng.wait(60)
            except Exception:  # noqa: BLE001 - then it is killed
                eng.kill()
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as e:  # noqa: BLE001 - the server keeps serving; the failure is reported in status
            self.state = "failed"
            if not self.stop_event.is_set():
                self.error = f"{type(e).__name__}: {e}"
                traceback.print_exc()

    def _watch(self) -> None:
        from tkcc.agents.engine_eval import EngineEvaluator, spawned_engine
        from tkcc.agents.search import BayesianSearch, SearchSpace
        from tkcc.agents.store import ExperimentStore
        from tkcc.agents.watch import watch
        from tkcc.serve.swap import ShippingEvaluator
        from tkcc.traffic.drift import parse_window

        a, server = self.args, self.server
        extra = ["--dtype", a.dtype] if a.dtype else []
        if a.max_cache_len:
            extra += ["--max-cache-len", str(a.max_cache_len)]
        if a.mode == "tolerance":  # the search admits inexact passes: judged in tolerance (runtime.determinism)
            extra += ["--validation", "tolerance"]
        rolling = _ServerTrace(server, a.watch_horizon)
        self.store = ExperimentStore(a.watch_store)
        with spawned_engine(a.model, a.device, extra=tuple(extra),
                            on_start=lambda proc: setattr(self, "_engine", proc)) as client:
            self.state = "watching"
            worker = client.status().get("worker") or {}
            wk = {"max_context": int(worker.get("max_cache_len") or server.max_cache_len), "batch_sizes": (1,)}

            watch(rolling, lambda workload: ShippingEvaluator(EngineEvaluator(client, workload), self._ship),
                  lambda: BayesianSearch(SearchSpace.from_registry(exact_only=a.mode == "exact",
                                                                   device=str(worker.get("device", "cpu")))),
                  self.store, name=f"serve-{server.model_name}", model=server.model_name,
                  budget_s=parse_window(a.watch_budget), min_requests=a.watch_min_requests,
                  poll_s=a.watch_poll, workload_kwargs=wk, progress=False, stop=self.stop_event,
                  events=self.events, serving=self._serving_plan)
        self.state = "stopped"

    def _serving_plan(self):
        """The PassPlan of the forward serving now (what each campaign starts from); None if it has none."""
        return getattr(self.server.scheduler.current.compiled, "plan", None)

    def _on_event(self, ev) -> None:
        """After a campaign, serve what it left shipped: a campaign that keeps the baseline (or the candidate
        serving before it) records that ship in the store without calling the evaluator's ``ship``."""
        if ev.kind != "campaign" or not ev.detail.get("shipped") or self.store is None:
            return
        key = ev.detail["shipped"][0]
        rows = [r for r in self.store.ships() if r["candidate"] == key and r["action"] in ("ship", "revert")]
        if not rows:
            return
        plan = rows[-1]["plan"]
        self._ship({"plan": plan} if plan else {"baseline": True})

    def _ship(self, spec: dict) -> dict:
        """Swap ``spec`` in; a swap that fails is recorded with its cause and the loop goes on (the server
        serves on what it served). A campaign that keeps what serves ships it: nothing is rebuilt then."""
        if self._serves_already(spec):
            return {"kept": self.server.scheduler.current.tag, "spec": spec}
        try:
            rec = self.server.swapper.ship(spec)
        except TkccError as e:
            rec = {"error": str(e), "spec": spec}
        self.shipped.append(rec)
        return rec

    def _serves_already(self, spec: dict) -> bool:
        """``spec`` is the plan the server serves (a loaded artifact's tag is its plan's hash and its folder, so
        the tag alone does not say)."""
        from tkcc.serve.swap import plan_of

        serving = self._serving_plan()
        if serving is None or not isinstance(spec, dict) or not ({"plan", "baseline"} & set(spec)):
            return False
        try:
            plan = plan_of(spec)
        except TkccError:
            return False
        return plan is not None and plan.hash() == serving.hash()

    def status(self) -> dict:
        evs = [{"time": e.time, "kind": e.kind, **{k: v for k, v in e.detail.items() if k != "shifts"}}
               for e in self.events if e.kind not in ("quiet", "waiting")]
        waiting = [e for e in self.events if e.kind == "waiting"]
        return {"state": self.state, "error": self.error, "events": evs[-20:],
                "polls_quiet": sum(e.kind == "quiet" for e in self.events), "polls_waiting": len(waiting),
                "waiting": waiting[-1].detail if waiting else None,
                "swaps": sum("error" not in r for r in self.shipped),
                "swap_errors": [r["error"] for r in self.shipped if "error" in r][-5:]}
