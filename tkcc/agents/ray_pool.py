"""Campaigns on Ray: one persistent engine (``tkcc serve``) per Ray actor, fed by one proposer.

Why this shape: the engine stays the one validating and measuring process (same rules as a single-engine
campaign); Ray only places the engines, carries candidates to them and results back, and says when one
is lost. The driver keeps the proposer, the ship rule and the SQLite store, so every row is written on one
machine as it arrives (``tkcc.agents.campaign._record_pool_result``).

* **Every engine takes any job.** The campaign loop (``tkcc.agents.campaign._search_pool``) gives each
  free engine its next job (``RayEvaluator.run_jobs``): a proposal to screen, an A/A measurement, a
  confirmation on the slow tier or a ship, so no engine waits while another decides. A/A pairs,
  confirmations and ships go to engines of the home engine's device model only.
* **Each engine is compared with itself.** Before an engine's first job on a tier it measures what serves
  there (recorded, ``proposer="engine-reference"``); its candidates' objectives are scaled by what serves
  (in the campaign's units) over its own measurements of it, so a slower GPU (or a busier CPU) neither wins
  nor loses by its speed; an A/A pair is two measurements on one engine. The raw objective and the scale
  are in each row's measurement.
* **Tensor-parallel engines** (``tp`` > 1): each engine is ``tkcc serve --tp N``, its actor in a placement
  group of N bundles (``STRICT_PACK``: one node), the other bundles' GPUs held by ``RankSlot`` actors and
  given to the engine's ranks; plans are sharded N ways first (``EngineActor._laid_out``).
* **Faults.** An actor whose engine died (or that Ray lost) is retired; its in-flight job is retried once
  on another engine (the row says so) and a replacement actor is started (a tensor-parallel one in the same
  placement group); the campaign goes on with the rest.
"""
from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import replace

from tkcc.agents.campaign import BatchResult, EvalResult
from tkcc.agents.proposer import Candidate
from tkcc.errors import TkccError


class EngineDied(TkccError):
    """The actor's engine process exited: the actor cannot measure any more."""


_LOST = ("connection", "broken pipe", "socket", "has exited")  # how a call to an engine that died fails


class EngineActor:
    """Owns one engine process (``spawned_engine``) and its ``EngineEvaluator``; runs inside a Ray actor."""

    def __init__(self, name: str, model: str, device: str = "cpu", extra: tuple[str, ...] = (),
                 start_timeout_s: float = 900, env: dict | None = None, tp: int = 1, rank_slots: tuple = ()):
        """``tp`` > 1: the engine is ``tkcc serve --tp N``; on a GPU its ranks use this actor's GPU and those
        held by ``rank_slots`` (actors of the same placement group, so on this node)."""
        from tkcc.agents.engine_eval import spawned_engine

        self.name, self.proc, self.ev, self.tp = name, None, None, tp
        self.placement = _placement(rank_slots)
        if tp > 1:
            extra = ("--tp", str(tp), *extra)
            if self.placement["gpus"]:
                env = {**(env or {}), "CUDA_VISIBLE_DEVICES": ",".join(self.placement["gpus"])}
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
                "validation": self.ev.validation, "tier_scale": self.ev.tier_scale, "tp": self.tp,
                "placement": self.placement}

    def _laid_out(self, cand: Candidate) -> Candidate:
        """The candidate as this engine runs it: on a ``--tp N`` engine a plan shards the model N ways first
        (the engine refuses a plan without that step; the baseline is the sharded model already)."""
        if self.tp == 1 or not cand.plan.steps or any(s.name == "sharding" for s in cand.plan.steps):
            return cand
        from tkcc.passes.plan import PassPlan, PassStep

        shard = PassStep("sharding", {"degree": self.tp, "strategy": "tp"})
        return replace(cand, plan=PassPlan((shard, *cand.plan.steps)))

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
        return self.ev.prepare(self._laid_out(cand), tier)

    def cancel(self, cand: Candidate) -> None:
        self.ev.cancel(self._laid_out(cand))

    def build(self, cand: Candidate, tier: str) -> str:
        try:
            key = self.ev.build(self._laid_out(cand), tier)
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

    def ship_candidate(self, cand: Candidate) -> tuple[str | None, EvalResult, float]:
        """Build ``cand`` for the slow tier and swap it into serving (the engine validates it again first)."""
        t0 = time.monotonic()
        try:
            key = self.build(cand, "slow")
            self.ship(key)
        except EngineDied:
            raise
        except TkccError as e:
            return None, EvalResult("refused", reason=str(e)), time.monotonic() - t0
        return key, EvalResult("shipped"), time.monotonic() - t0

    def stop(self) -> None:
        self.stack.close()


class RankSlot:
    """Holds one GPU of a tensor-parallel engine's placement group for one of its ranks (the ranks are the
    engine's own processes, which Ray does not know); says which GPU, on which node, it was given."""

    def where(self) -> dict:
        return _here()


def _here() -> dict:
    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "gpus": [str(g) for g in ray.get_gpu_ids()]}


def _placement(rank_slots) -> dict:
    """Where an engine's ranks are: the actor's own node and GPUs, then its rank slots' (in bundle order)."""
    import ray

    here = [_here()] + (ray.get([s.where.remote() for s in rank_slots]) if rank_slots else [])
    return {"nodes": [h["node"] for h in here], "gpus": [g for h in here for g in h["gpus"]]}


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
                 reps: int = 30, pass_modules: list[str] = (), gpus_per_engine: float = 0.0, tp: int = 1,
                 start_timeout_s: float = 900, out=None):
        """``workload_for(client)``: the campaign's workload from an object with the engine's ``status()``.
        ``tp`` > 1: each engine is ``tkcc serve --tp N`` in a placement group of N bundles (one per rank:
        a GPU and a CPU, or a CPU on a CPU engine) packed onto one node (``STRICT_PACK``)."""
        import ray

        if engines < 1:
            raise TkccError(f"--engines must be at least 1, got {engines}")
        if tp < 1:
            raise TkccError(f"--tp must be at least 1, got {tp}")
        if tp > 1:
            _check_placeable(ray, tp, "GPU" if gpus_per_engine > 0 else "CPU")
        self._init_pool(ray, tp, gpus_per_engine, dict(model=model, device=device, extra=tuple(extra),
                                                       start_timeout_s=start_timeout_s, tp=tp),
                        reps, pass_modules, out)
        names = [f"engine-{i}" + (f"-tp{tp}" if tp > 1 else "") for i in range(engines)]
        try:
            for n in names:
                self._handles[n] = self._start_actor(n)
            first = self._handles[names[0]]
            self.workload = workload_for(_StatusOf(ray, first))
            infos = ray.get([self._handles[n].set_workload.remote(self.workload, reps, self.pass_modules)
                             for n in names])
        except BaseException:
            self.close()
            raise
        self._adopt(infos)

    def _init_pool(self, ray, tp: int, gpus_per_engine: float, args: dict, reps: int, pass_modules, out) -> None:
        """The pool's bookkeeping, before any engine has started."""
        self._ray, self.tp, self._gpu = ray, tp, gpus_per_engine > 0
        self._actor_cls = ray.remote(num_cpus=1, num_gpus=gpus_per_engine, max_restarts=0)(EngineActor)
        self._args = args
        self.reps, self.pass_modules, self.out = reps, list(pass_modules), out
        self.deaths: list[dict] = []  # {engine, why, time}
        self._handles: dict[str, object] = {}
        self._groups: dict[str, tuple] = {}  # engine -> (placement group, its rank slots): tensor-parallel engines
        self._info: dict[str, dict] = {}
        self._refs: dict[tuple[str, str, str], list[float]] = {}  # (engine, tier, serving key) -> its raw measurements
        self._serving: dict[str, tuple[Candidate, float | None]] = {}  # tier -> (what serves, its objective)
        self._starting: dict[object, str] = {}  # set_workload future -> engine name (replacements)
        self._restarts = 0
        self._built: dict[str, tuple[Candidate, str]] = {}  # artifact hash -> what built it (to rebuild elsewhere)

    def _adopt(self, infos: list[dict]) -> None:
        """The started engines (their ``info()``): the first is the home engine, whose device model decides."""
        self._info = {i["name"]: i for i in infos}
        self.engine = infos[0]["name"]
        home = self._info[self.engine]
        self.model, self.device, self.device_type = home["model"], home["device"], home["device_type"]
        self.validation, self.tier_scale = home["validation"], home["tier_scale"]

    def _start_actor(self, name: str, group: tuple | None = None):
        """An engine actor; a tensor-parallel one in its placement group (made here, or the lost engine's)."""
        if self.tp == 1:
            return self._actor_cls.remote(name, **self._args)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if group is None:
            bundle = {"CPU": 1, "GPU": 1} if self._gpu else {"CPU": 1}
            pg = placement_group([dict(bundle) for _ in range(self.tp)], strategy="STRICT_PACK", name=name)
            slot = self._ray.remote(num_cpus=0, num_gpus=1)(RankSlot) if self._gpu else None
            slots = tuple(slot.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i)).remote() for i in range(1, self.tp)) if slot else ()
            group = (pg, slots)
        self._groups[name] = group
        pg, slots = group
        return self._actor_cls.options(num_gpus=1 if self._gpu else 0, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))).remote(
            name, **self._args, rank_slots=slots)

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
        """The home engine's conditions (the campaign's first measurements were taken under them)."""
        return {**self._info[self.engine]["conditions"], "pool": "ray", **({"tp": self.tp} if self.tp > 1 else {})}

    @property
    def parallel(self) -> int:
        return len(self._info)

    def engines(self) -> dict[str, dict]:
        """The live engines: name -> {pid, host, device, conditions, placement, ...}."""
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
                self._say(f"home engine {name} died ({why}); its steps move to {self.engine}")
                if method in ("measure", "ship"):  # an artifact hash is the same on every engine of one model
                    self._ray.get(self._handles[self.engine].build.remote(*self._built[args[0]]))
        raise AssertionError("unreachable")

    # ---- the pool: what serves, each engine's references of it ------------------------------------------
    def set_serving(self, tier: str, cand: Candidate, objective: float | None,
                    measured: dict[str, float] | None = None) -> None:
        """What serves on ``tier`` and its objective in the campaign's units (None: the first engine to measure
        it sets them); ``measured``: raw measurements of it already taken, engine -> objective."""
        self._serving[tier] = (cand, objective)
        for name, raw in (measured or {}).items():
            self._refs.setdefault((name, tier, cand.key), []).append(float(raw))

    def has_reference(self, engine: str, tier: str) -> bool:
        """Has ``engine`` measured what serves on ``tier`` (so a job there starts at once)?"""
        cand, _ = self._serving.get(tier, (None, None))
        return cand is not None and bool(self._refs.get((engine, tier, cand.key)))

    def can_decide(self, engine: str) -> bool:
        """May ``engine`` take A/A pairs, confirmations and ships: is it the home engine's device model?"""
        info = self._info.get(engine) or {}
        return info.get("device") == self.device

    def run_jobs(self, next_job):
        """Run the campaign's jobs on every engine at once: ``next_job(engine)`` -> ``Job`` or None is asked
        whenever an engine is free; yields a ``BatchResult`` as each finishes, with the engines' reference
        measurements (``proposer="engine-reference"``) that a job needed first. A job whose engine dies is
        retried once on another engine. Returns when no engine is busy and none is given a job."""
        ray = self._ray
        held: dict[str, object] = {}  # engine -> its job, waiting for that engine's reference
        retry: list = []  # jobs whose engine died, for the next engine free (that may take them)
        busy: dict[object, tuple] = {}  # future -> (engine, job, kind, scale)
        while True:
            self._poll_starting()
            for name in [n for n in self._info if n not in {b[0] for b in busy.values()}]:
                job = held.pop(name, None)
                if job is None:
                    job = next((j for j in retry if j.kind == "screen" or self.can_decide(name)), None)
                    if job is not None:
                        retry.remove(job)
                if job is None:
                    job = next_job(name)
                if job is None:
                    continue
                if job.kind != "ship" and not self.has_reference(name, job.tier):
                    held[name] = job
                    sent, kind = self._serving[job.tier][0], "reference"
                    call = self._handles[name].evaluate.remote(sent, job.tier)
                elif job.kind == "ship":
                    sent, kind = job.candidate, "ship"
                    call = self._handles[name].ship_candidate.remote(sent)
                else:
                    sent, kind = job.candidate, "job"
                    call = self._handles[name].evaluate.remote(sent, job.tier)
                busy[call] = (name, job, kind, self._scale(name, job.tier))
                if self.on_dispatch is not None:
                    self.on_dispatch(name, sent, job.kind if kind == "job" else kind)
            if not busy:
                for job in retry:  # no engine is left that may take them
                    yield BatchResult(job.candidate, None, EvalResult("crashed", reason=(
                        f"{job.retry['engine']} died ({job.retry['why']}) and no engine is left to retry it on")),
                        job.retry["engine"], 0.0, job=job)
                return
            done, _ = ray.wait(list(busy), num_returns=1)
            name, job, kind, scale = busy.pop(done[0])
            try:
                key, res, seconds = ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - only an engine's death is handled here
                why = _death(ray, e)
                if why is None:
                    raise
                self._retire(name, why)
                job = held.pop(name, job)
                if job.retry is None:
                    retry.insert(0, replace(job, retry={"engine": name, "why": why}))
                else:
                    yield BatchResult(job.candidate, None, EvalResult("crashed", reason=(
                        f"{name} died ({why}) on the retry after {job.retry['engine']} died ({job.retry['why']})")),
                        name, 0.0, job=job)
                continue
            if kind == "reference":
                r = self._reference_result(name, job, key, res, seconds)
                if name not in self._info:  # the reference failed there: that engine cannot take the job
                    retry.insert(0, held.pop(name))
                yield r
                continue
            yield self._job_result(name, job, key, res, seconds, scale)

    on_dispatch = None  # callable(engine, candidate, kind): told when a job is sent to an engine

    def _scale(self, name: str, tier: str) -> float | None:
        """Campaign units per raw objective on ``name``: what serves, in the campaign's units, over the
        engine's own measurements of it (so each engine's candidates are compared with that engine)."""
        cand, objective = self._serving.get(tier, (None, None))
        refs = self._refs.get((name, tier, cand.key)) if cand is not None else None
        if not refs or not objective:
            return None
        return objective / statistics.median(refs)

    def _reference_result(self, name, job, key, res, seconds) -> BatchResult:
        """What serves, measured on ``name`` before its first ``job`` on that tier: the engine's reference."""
        tier = job.tier
        cand, objective = self._serving[tier]
        if res.verdict == "measured" and res.objective:
            self._refs.setdefault((name, tier, cand.key), []).append(float(res.objective))
            if objective is None:  # the first measurement of it on this tier sets the campaign's units
                self._serving[tier] = (cand, float(res.objective))
            note = (f"{name}'s reference on the {tier} tier: what serves measures {res.objective:.4g} there "
                    f"(its candidates are scaled by {self._scale(name, tier):.4f})")
        else:
            self._retire(name, f"the serving candidate failed there: {res.verdict}: {res.reason}", kill=True)
            note = f"{name} cannot measure: the serving candidate did not measure there"
        m = {**(res.measurement or {}), "engine": name, "engine_conditions": self._conditions_of(name)}
        return BatchResult(cand, key, EvalResult(res.verdict, res.objective, m, res.reason), name, seconds,
                           proposer="engine-reference", note=note, job=job)

    def _job_result(self, name, job, key, res, seconds, scale) -> BatchResult:
        note = f"retried on {name} after {job.retry['engine']} died ({job.retry['why']})" if job.retry else ""
        m = {**(res.measurement or {}), "engine": name, "engine_conditions": self._conditions_of(name)}
        if job.retry:
            m["retry"] = job.retry
        measured = res.verdict == "measured" and res.objective is not None
        if measured and job.kind == "aa":  # paired with this engine's previous measurement of what serves
            refs = self._refs[(name, job.tier, self._serving[job.tier][0].key)]
            m.update(aa_pair=res.objective / refs[-1] - 1.0, a=refs[-1], b=res.objective)
            refs.append(float(res.objective))
        elif measured and job.kind in ("screen", "confirm") and scale is not None:
            m.update(raw_objective=res.objective, scale=scale)
            res = EvalResult("measured", res.objective * scale, m, res.reason, res.timing)
        if key is not None and job.kind != "ship":
            self._built[key] = (job.candidate, job.tier)
        return BatchResult(job.candidate, key, EvalResult(res.verdict, res.objective, m, res.reason, res.timing),
                           name, seconds, note=note, job=job)

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def _conditions_of(self, name: str) -> dict:
        return (self._info.get(name) or {}).get("conditions") or {}

    def _retire(self, name: str, why: str, kill: bool = True) -> None:
        """Drop a dead engine from the pool and start a replacement (it joins when Ray has placed it; a
        tensor-parallel engine's replacement goes into the same placement group)."""
        if name not in self._info:
            return
        self.deaths.append({"engine": name, "why": why, "time": time.time()})
        self._info.pop(name)
        handle = self._handles.pop(name)
        if name == self.engine and self._info:  # the home engine's role (naming the units) moves on
            self.engine = next(iter(self._info))
        if kill:
            try:
                self._ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - it is already gone
                pass
        self._say(f"engine {name} retired: {why}")
        self._restarts += 1
        new = f"{name.split('#')[0]}#{self._restarts + 1}"
        self._handles[new] = self._start_actor(new, self._groups.pop(name, None))
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
        """Stop every engine (each actor stops its engine process), then the actors and placement groups."""
        ray = self._ray
        stops = []
        starting = set(self._starting.values())  # still starting: killed below (its engine dies with it)
        for n, h in self._handles.items():
            if n in starting:
                continue
            try:
                stops.append(h.stop.remote())
            except Exception:  # noqa: BLE001 - stopping never raises
                pass
        try:
            ray.wait(stops, num_returns=len(stops), timeout=60)
        except Exception:  # noqa: BLE001
            pass
        for h in [*self._handles.values(), *(s for _, slots in self._groups.values() for s in slots)]:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        for pg, _ in self._groups.values():
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self._handles.clear()
        self._groups.clear()
        self._starting.clear()


class _StatusOf:
    """An engine actor seen as a client with ``status()`` (what ``_workload_for`` reads)."""

    def __init__(self, ray, handle):
        self._ray, self._handle = ray, handle

    def status(self) -> dict:
        return self._ray.get(self._handle.status.remote())


def _check_placeable(ray, tp: int, kind: str) -> None:
    """A tensor-parallel engine's N bundles must fit on one node: say so now, not by waiting for ever."""
    most = max((n.get("Resources", {}).get(kind, 0) for n in ray.nodes() if n.get("Alive")), default=0)
    if most < tp:
        raise TkccError(f"--tp {tp}: no node of the Ray cluster has {tp} {kind}s (the most is {most:g}); a "
                        f"tensor-parallel engine's ranks are placed together on one node")


def _death(ray, e: BaseException) -> str | None:
    """Why an engine is gone, if ``e`` says it is (the actor was lost, or its engine process exited)."""
    if isinstance(e, ray.exceptions.RayActorError):
        return f"the Ray actor died: {str(e).splitlines()[0][:200]}"
    cause = getattr(e, "cause", None)
    if isinstance(cause, EngineDied):
        return str(cause)
    return None
