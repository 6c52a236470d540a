"""Campaigns on Ray: one persistent engine (``tkcc serve``) per Ray actor, fed by one proposer.

Why this shape: the engine stays the one validating and measuring process (same rules as a single-engine
campaign); Ray only places the engines, carries candidates to them and results back, and says when one
is lost. The driver keeps the proposer, the ship rule and the SQLite store, so every row is written on one
machine as it arrives (``tkcc.agents.campaign._screen_batch``).

* **Screening is parallel, deciding is not.** A round's candidates are measured one per engine at once
  (``RayEvaluator.measure_batch``). The serving reference, the A/A pairs, confirmations and ships run on one
  engine, the *home* engine, so the ship rule's noise is that engine's own, calibrated on it.
* **Each engine is compared with itself.** Before an engine screens, it measures the serving candidate
  (recorded, ``proposer="engine-reference"``); its candidates' objectives are scaled by the home engine's
  reference over its own, so a slower GPU (or a busier CPU) neither wins nor loses by its speed. The raw
  objective, the reference and the scale are in each row's measurement.
* **Faults.** An actor whose engine died (or that Ray lost) is retired; its in-flight experiment is retried
  once on another engine (the row says so) and a replacement actor is started; the campaign goes on with
  the rest. The home engine's loss moves the sequential steps to another engine (said in the log).
"""
from __future__ import annotations

import time
from contextlib import ExitStack

from tkcc.agents.campaign import BatchResult, EvalResult
from tkcc.agents.proposer import Candidate
from tkcc.errors import TkccError


class EngineDied(TkccError):
    """The actor's engine process exited: the actor cannot measure any more."""


_LOST = ("connection", "broken pipe", "socket", "has exited")  # how a call to an engine that died fails


class EngineActor:
    """Owns one engine process (``spawned_engine``) and its ``EngineEvaluator``; runs inside a Ray actor."""

    def __init__(self, name: str, model: str, device: str = "cpu", extra: tuple[str, ...] = (),
                 start_timeout_s: float = 900, env: dict | None = None):
        from tkcc.agents.engine_eval import spawned_engine

        self.name, self.proc, self.ev = name, None, None
        self.stack = ExitStack()
        self.client = self.stack.enter_context(
            spawned_engine(model, device, extra=tuple(extra), start_timeout_s=start_timeout_s, env=env,
                           on_start=self._started))

    def _started(self, proc) -> None:
        self.proc = proc

    def status(self) -> dict:
        return self.client.status()

    def set_workload(self, workload, reps: int, pass_modules: list[str] = ()) -> dict:
        """Make the evaluator for the campaign's workload; returns what the driver needs to know of it."""
        from tkcc.agents.engine_eval import EngineEvaluator

        self.ev = EngineEvaluator(self.client, workload, pass_modules=list(pass_modules), reps=reps)
        return self.info()

    def info(self) -> dict:
        import socket

        return {"name": self.name, "pid": self.proc.pid if self.proc else None, "host": socket.gethostname(),
                "compiles_ahead": self.ev.compiles_ahead,
                "device": self.ev.device, "device_type": self.ev.device_type, "model": self.ev.model, "conditions": self.ev.conditions(),
                "validation": self.ev.validation, "tier_scale": self.ev.tier_scale}

    def _alive(self, failure: str = "") -> None:
        """Raise EngineDied if the engine exited. After a call that lost its connection, wait a moment for
        the exit: a killed engine resets its connection before its exit status can be read, and that failure
        is the engine's death, not the candidate's (a candidate that merely fails costs no wait)."""
        if self.proc is not None and any(w in failure.lower() for w in _LOST):
            import subprocess

            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None and self.proc.poll() is not None:
            raise EngineDied(f"{self.name}: its engine (pid {self.proc.pid}) exited with {self.proc.returncode}")

    def prepare(self, cand: Candidate, tier: str) -> dict | None:
        """Queue the candidate's kernel compiles in this engine's pool (their cache serves every engine that
        shares it: the engines of one node)."""
        return self.ev.prepare(cand, tier)

    def cancel(self, cand: Candidate) -> None:
        self.ev.cancel(cand)

    def build(self, cand: Candidate, tier: str) -> str:
        try:
            key = self.ev.build(cand, tier)
        except BaseException as e:
            self._alive(str(e))
            raise
        self._alive()
        return key

    def measure(self, key: str, tier: str) -> EvalResult:
        res = self.ev.measure(key, tier)
        # an engine killed mid-measurement reads as a crash: say it is the engine's death
        self._alive(str(res.reason or "") if res.verdict != "measured" else "")
        return res

    def evaluate(self, cand: Candidate, tier: str) -> tuple[str | None, EvalResult, float]:
        """Build and measure one candidate: (artifact hash or None, result, seconds)."""
        t0 = time.monotonic()
        try:
            key = self.build(cand, tier)
        except EngineDied:
            raise
        except TkccError as e:
            return None, EvalResult("invalid", reason=f"build failed: {e}"), time.monotonic() - t0
        return key, self.measure(key, tier), time.monotonic() - t0

    def ship(self, key: str) -> None:
        try:
            self.ev.ship(key)
        except BaseException as e:
            self._alive(str(e))
            raise
        self._alive()

    def stop(self) -> None:
        self.stack.close()


def init_ray(address: str | None, num_cpus: int) -> bool:
    """Connect to the Ray cluster at ``address``, or start a local one (loopback only, no dashboard).
    Returns whether this call started it (then ``ray.shutdown()`` is ours to call)."""
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 configure_logging=False)
    return True


class RayEvaluator:
    """The campaign's Evaluator over a pool of engine actors (see the module docstring)."""

    def __init__(self, model: str, engines: int, workload_for, *, device: str = "cpu", extra: tuple[str, ...] = (),
                 reps: int = 30, pass_modules: list[str] = (), gpus_per_engine: float = 0.0,
                 start_timeout_s: float = 900, out=None):
        """``workload_for(client)``: the campaign's workload from an object with the engine's ``status()``."""
        import ray

        if engines < 1:
            raise TkccError(f"--engines must be at least 1, got {engines}")
        self._ray = ray
        self._actor_cls = ray.remote(num_cpus=1, num_gpus=gpus_per_engine, max_restarts=0)(EngineActor)
        self._args = dict(model=model, device=device, extra=tuple(extra), start_timeout_s=start_timeout_s)
        self.reps, self.pass_modules, self.out = reps, list(pass_modules), out
        self.deaths: list[dict] = []  # {engine, why, time}
        self._handles: dict[str, object] = {}
        self._info: dict[str, dict] = {}
        self._refs: dict[tuple[str, str, str], float] = {}  # (engine, tier, serving key) -> its reference
        self._starting: dict[object, str] = {}  # set_workload future -> engine name (replacements)
        self._restarts = 0
        self._built: dict[str, tuple[Candidate, str]] = {}  # artifact hash -> what built it (to rebuild elsewhere)
        self._screen: dict[str, tuple[str, float]] = {}  # tier -> (serving key, the home engine's reference)
        self.on_dispatch = None  # callable(engine, candidate, kind): told when a screening job is sent
        names = [f"engine-{i}" for i in range(engines)]
        for n in names:
            self._handles[n] = self._actor_cls.remote(n, **self._args)
        try:
            first = self._handles[names[0]]
            self.workload = workload_for(_StatusOf(ray, first))
            infos = ray.get([self._handles[n].set_workload.remote(self.workload, reps, self.pass_modules)
                             for n in names])
        except BaseException:
            self.close()
            raise
        self._info = {i["name"]: i for i in infos}
        self.engine = names[0]  # the home engine: serving reference, A/A pairs, confirmations, ships
        home = self._info[self.engine]
        self.model, self.device, self.device_type = home["model"], home["device"], home["device_type"]
        self.validation, self.tier_scale = home["validation"], home["tier_scale"]

    # ---- the Evaluator protocol -------------------------------------------------------------------------
    @property
    def compiles_ahead(self) -> bool:
        return bool(self._info.get(self.engine, {}).get("compiles_ahead"))

    def prepare(self, cand: Candidate, tier: str) -> dict | None:
        """Queue a candidate's kernel compiles ahead, on the engines in turn (not waited for: an engine takes
        it between its experiments); kernels land in the engine's node's cache, which its engines share."""
        names = list(self._info)
        if not names or not self.compiles_ahead:
            return None
        self._next_prepare = (getattr(self, "_next_prepare", -1) + 1) % len(names)
        self._handles[names[self._next_prepare]].prepare.remote(cand, tier)
        return {"queued_on": names[self._next_prepare]}

    def cancel(self, cand: Candidate) -> None:
        for h in self._handles.values():
            h.cancel.remote(cand)

    def workload_fingerprint(self) -> str:
        return self.workload.fingerprint()

    def conditions(self) -> dict:
        """The home engine's conditions (what the A/A pairs and ship decisions were measured under)."""
        return {**self._info[self.engine]["conditions"], "pool": "ray"}

    @property
    def parallel(self) -> int:
        return len(self._info)

    def engines(self) -> dict[str, dict]:
        """The live engines: name -> {pid, host, device, conditions, ...}."""
        return {n: dict(i) for n, i in self._info.items()}

    def build(self, cand: Candidate, tier: str) -> str:
        key = self._home_call("build", cand, tier)
        self._built[key] = (cand, tier)
        return key

    def measure(self, key: str, tier: str) -> EvalResult:
        return self._home_call("measure", key, tier)

    def ship(self, key: str) -> None:
        self._home_call("ship", key)

    def _home_call(self, method: str, *args):
        """A sequential step on the home engine; if it dies, the step moves to another engine once."""
        for attempt in range(2):
            name = self.engine
            try:
                return self._ray.get(getattr(self._handles[name], method).remote(*args))
            except Exception as e:  # noqa: BLE001 - only an engine's death is handled here
                why = _death(self._ray, e)
                if why is None:
                    raise
                self._retire(name, why)
                if not self._info or attempt:
                    raise TkccError(f"the home engine {name} died ({why}) and no engine is left to take its "
                                    f"steps") from None
                self.engine = next(iter(self._info))
                self._say(f"home engine {name} died ({why}); its steps move to {self.engine} (the A/A pairs "
                          f"measured so far were {name}'s)")
                if method in ("measure", "ship"):  # an artifact hash is the same on every engine of one model
                    self._ray.get(self._handles[self.engine].build.remote(*self._built[args[0]]))
        raise AssertionError("unreachable")

    # ---- parallel screening -------------------------------------------------------------------------------
    def measure_batch(self, cands: list[Candidate], tier: str, reference: Candidate, reference_objective: float):
        """Screen ``cands`` one per engine at once; yields ``BatchResult`` as each finishes (with the engines'
        own reference measurements first where they need one). A candidate whose engine dies is retried once
        on another engine."""
        ray = self._ray
        self._poll_starting()
        self._screen[tier] = (reference.key, float(reference_objective))
        todo: list[tuple[Candidate, dict | None]] = [(c, None) for c in cands]
        busy: dict[object, tuple[str, Candidate, str, dict | None]] = {}  # future -> (engine, cand, kind, retry)
        while todo or busy:
            for name in [n for n in self._info if n not in {b[0] for b in busy.values()}]:
                rkey = (name, tier, reference.key)
                if name != self.engine and rkey not in self._refs:
                    job = (name, reference, "reference", None)
                elif todo:
                    cand, retry = todo.pop(0)
                    job = (name, cand, "candidate", retry)
                else:
                    continue
                busy[self._handles[name].evaluate.remote(job[1], tier)] = job
                if self.on_dispatch is not None:
                    self.on_dispatch(*job[:3])
            if not busy:
                raise TkccError(f"no engine is left to measure on ({len(self.deaths)} died: "
                                f"{'; '.join(d['why'] for d in self.deaths)})")
            done, _ = ray.wait(list(busy), num_returns=1)
            name, cand, kind, retry = busy.pop(done[0])
            try:
                key, res, seconds = ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - only an engine's death is handled here
                why = _death(ray, e)
                if why is None:
                    raise
                self._retire(name, why)
                if kind == "candidate" and retry is None:
                    todo.insert(0, (cand, {"engine": name, "why": why}))
                elif kind == "candidate":
                    yield BatchResult(cand, None, EvalResult("crashed", reason=f"{name} died ({why}) on the retry "
                                      f"after {retry['engine']} died ({retry['why']})"), name, 0.0)
                continue
            if kind == "reference":
                yield self._reference_result(name, cand, key, res, seconds, tier, reference_objective)
                continue
            yield self._candidate_result(name, cand, key, res, seconds, tier, retry)

    def _reference_result(self, name, cand, key, res, seconds, tier, home_ref) -> BatchResult:
        ok = res.verdict == "measured" and res.objective
        if ok:
            self._refs[(name, tier, cand.key)] = float(res.objective)
            note = (f"{name}'s reference for screening: the serving candidate measures {res.objective:.4g} there "
                    f"vs {home_ref:.4g} on {self.engine} (its candidates are scaled by {home_ref / res.objective:.4f})")
        else:
            self._retire(name, f"the serving candidate failed there: {res.verdict}: {res.reason}", kill=True)
            note = f"{name} cannot screen: the serving candidate did not measure there"
        return BatchResult(cand, key, res, name, seconds, proposer="engine-reference", note=note)

    def _candidate_result(self, name, cand, key, res, seconds, tier, retry) -> BatchResult:
        note = f"retried on {name} after {retry['engine']} died ({retry['why']})" if retry else ""
        if res.verdict == "measured" and res.objective is not None and name != self.engine:
            serving, home = self._screen.get(tier, (None, None))
            ref = self._refs.get((name, tier, serving))
            if ref and home:
                scale = home / ref
                m = {**(res.measurement or {}), "raw_objective": res.objective, "engine_reference": ref,
                     "home_reference": home, "scale": scale}
                res = EvalResult("measured", res.objective * scale, m, res.reason)
        m = {**(res.measurement or {}), "engine": name, "engine_conditions": self._conditions_of(name)}
        if retry:
            m["retry"] = retry
        return BatchResult(cand, key, EvalResult(res.verdict, res.objective, m, res.reason), name, seconds, note=note)

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def _conditions_of(self, name: str) -> dict:
        return (self._info.get(name) or {}).get("conditions") or {}

    def _retire(self, name: str, why: str, kill: bool = True) -> None:
        """Drop a dead engine from the pool and start a replacement (it joins when Ray has placed it)."""
        if name not in self._info:
            return
        self.deaths.append({"engine": name, "why": why, "time": time.time()})
        self._info.pop(name)
        handle = self._handles.pop(name)
        if kill:
            try:
                self._ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - it is already gone
                pass
        self._say(f"engine {name} retired: {why}")
        self._restarts += 1
        new = f"{name.split('#')[0]}#{self._restarts + 1}"
        self._handles[new] = self._actor_cls.remote(new, **self._args)
        self._starting[self._handles[new].set_workload.remote(self.workload, self.reps, self.pass_modules)] = new

    def _poll_starting(self) -> None:
        if not self._starting:
            return
        ready, _ = self._ray.wait(list(self._starting), num_returns=len(self._starting), timeout=0)
        for f in ready:
            name = self._starting.pop(f)
            try:
                self._info[name] = self._ray.get(f)
                self._say(f"engine {name} joined the pool")
            except Exception as e:  # noqa: BLE001 - a replacement that cannot start is said, not fatal
                self._handles.pop(name, None)
                self.deaths.append({"engine": name, "why": f"did not start: {e}", "time": time.time()})

    def _say(self, msg: str) -> None:
        if self.out is not None:
            self.out(msg)

    def close(self) -> None:
        """Stop every engine (each actor stops its engine process), then the actors."""
        ray = self._ray
        stops = []
        for h in self._handles.values():
            try:
                stops.append(h.stop.remote())
            except Exception:  # noqa: BLE001 - stopping never raises
                pass
        try:
            ray.wait(stops, num_returns=len(stops), timeout=60)
        except Exception:  # noqa: BLE001
            pass
        for h in self._handles.values():
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self._handles.clear()


class _StatusOf:
    """An engine actor seen as a client with ``status()`` (what ``_workload_for`` reads)."""

    def __init__(self, ray, handle):
        self._ray, self._handle = ray, handle

    def status(self) -> dict:
        return self._ray.get(self._handle.status.remote())


def _death(ray, e: BaseException) -> str | None:
    """Why an engine is gone, if ``e`` says it is (the actor was lost, or its engine process exited)."""
    if isinstance(e, ray.exceptions.RayActorError):
        return f"the Ray actor died: {str(e).splitlines()[0][:200]}"
    cause = getattr(e, "cause", None)
    if isinstance(cause, EngineDied):
        return str(cause)
    return None
