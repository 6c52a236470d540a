"""Supervisor: owns the worker process, runs experiments through it, survives whatever a candidate does.

The RPC server calls the supervisor; the supervisor sends one operation at a
time to the worker (``tkcc.runtime.worker``) and watches it: a worker that
exits (``os._exit``, a segfault, a fatal CUDA error), runs past the
operation's timeout, or grows past the memory limit is killed and replaced,
and the engine restores what each tier was serving before answering again.
The time that takes is measured and journaled (``recovery`` records). Every
experiment is journaled (fsync) before the client gets its answer.

With process isolation (``tkcc.runtime.trial``) a candidate's own process
dies instead, and the worker reports it as that candidate's failure; the
worker is replaced only if it fails itself. Memory limits are on by default:
the worker's is derived from its size after start-up and the model's (see
``_derived_worker_limit``), each trial's from the model (the worker enforces
it, idle or not), and on a GPU the device's (``tkcc.runtime.device_memory``:
an allocator cap derived from the device and the resident model, and what a
candidate leaves on the device charged to it). Between requests the watchdog
checks the worker's memory (the device's too: the worker's ``ping``) and
collects what the worker noticed meanwhile (``events``: a kept candidate's
process lost, an orphan killed), so the journal and ``serving`` say so before
the next request.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid

from tkcc.errors import EngineError, TkccError
from tkcc.runtime import procs
from tkcc.runtime.ahead import Ahead, configure
from tkcc.runtime.journal import Journal
from tkcc.runtime.programs import TIERS, check_device, check_model_name, check_tier

DEFAULT_TIMEOUT_S = 600.0
STARTUP_TIMEOUT_S = 1800.0
POLL_S = 0.05
GRACE_S = 30.0  # the worker enforces an operation's timeout on a trial; the supervisor waits this much longer
IDLE_PING_S = 2.0  # how often the watchdog asks an idle worker what it noticed


class CandidateFailed(EngineError):
    """The candidate raised, hung, crashed the worker or exhausted memory; ``failure`` says which."""

    def __init__(self, kind: str, message: str, details: dict | None = None):
        super().__init__(f"candidate failed ({kind}): {message}")
        self.kind, self.reason, self.details = kind, message, details or {}
        self.recovered = False  # True when the worker itself had to be replaced


def _rss(pid: int) -> int:
    return procs.rss(pid)


def _derived_worker_limit(info: dict) -> int:
    """The worker's memory limit when none is given: its size after start-up plus 2 GiB or 4x the model and
    its KV cache, whichever is more, never more than 3/4 of the machine."""
    mem = info.get("memory") or {}
    base = int(mem.get("rss_bytes") or 0)
    budget = max(2 << 30, 4 * (int(mem.get("model_bytes") or 0) + int(mem.get("cache_bytes") or 0)))
    total = procs.memory_total()
    limit = base + budget
    return min(limit, total * 3 // 4) if total else limit


RANK_LOST = 72  # tkcc.runtime.worker.RANK_LOST (not imported: the supervisor does not load torch)


def _signal_name(code: int | None, tp: int = 1) -> str:
    if code is None:
        return "still running"
    if code == RANK_LOST and tp > 1:
        return f"a rank of its tensor-parallel group died, exit code {code}"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Supervisor(Ahead):
    def __init__(self, cfg: dict, journal: Journal):
        check_model_name(cfg["model"])
        cfg["device"] = check_device(cfg["device"])
        cfg["validation"] = _check_validation(cfg.get("validation"))
        _check_isolation(cfg.get("isolation"), cfg["device"], int(cfg.get("tp") or 1))
        cfg["device_max_bytes"] = check_device_max(cfg.get("device_max_bytes"), cfg["device"])
        self._setup(cfg, journal)

    def _setup(self, cfg: dict, journal: Journal) -> None:
        """The supervisor's bookkeeping, once ``cfg`` has been checked (an in-process engine shares it)."""
        self.cfg = configure(cfg)
        self._ahead_setup()
        self.journal = journal
        self.lock = threading.RLock()
        self.proc = None
        self.conn = None
        self.info: dict = {}
        self.restarts = 0
        self.recoveries: list[dict] = []
        self.specs: dict[str, dict] = {"baseline": {"baseline": True}}
        self.serving = {t: {"current": "baseline", "history": []} for t in TIERS}
        self.started = time.time()
        self.default_timeout = float(cfg.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.max_rss_given = int(cfg.get("worker_max_rss_bytes", 0) or 0)
        self.max_rss = self.max_rss_given
        self.stopping = False
        self.trial: tuple[str, str] | None = None  # (tier, candidate) swapped in only to be measured
        self._watchdog: threading.Thread | None = None
        self.tp = int(cfg.get("tp") or 1)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> dict:
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_entry, args=(child, self.cfg), name="tkcc-engine-worker", daemon=True)
        proc.start()
        child.close()
        self.proc, self.conn = proc, parent
        reply = self._wait(STARTUP_TIMEOUT_S, what="worker start-up")
        if not reply.get("ok"):
            err = reply.get("error", {})
            self._kill()
            raise EngineError(f"the engine could not load model {self.cfg['model']!r} on {self.cfg['device']}: "
                              f"{err.get('type')}: {err.get('message')}")
        self.info = reply["result"]
        self.info["worker_start_s"] = time.perf_counter() - t0
        self.isolation = (self.info.get("isolation") or {}).get("mode", "inprocess")
        self.max_rss = self.max_rss_given or _derived_worker_limit(self.info)
        self.info["worker_max_rss_bytes"] = self.max_rss
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="tkcc-worker-watchdog", daemon=True)
            self._watchdog.start()
        return self.info

    def _watch(self) -> None:
        """Between requests: replace a worker that died (a killed rank, the OOM killer) or grew past its memory
        limit, and collect what the worker noticed meanwhile (a kept candidate's process lost), before the next
        request."""
        last_ping = time.monotonic()
        while not self.stopping:
            time.sleep(0.5)
            proc = self.proc
            if proc is None or self.stopping:
                continue
            if not self.lock.acquire(blocking=False):
                continue  # a request is running: its own call notices and recovers
            try:
                if self.proc is not proc or self.stopping:
                    continue
                if not proc.is_alive():
                    proc.join(5)
                    self._recover(f"the worker exited between requests ({_signal_name(proc.exitcode, self.tp)})")
                elif self.max_rss and _rss(proc.pid) > self.max_rss:
                    self._recover(f"the worker's memory passed the limit of {self.max_rss} bytes between requests")
                elif time.monotonic() - last_ping >= IDLE_PING_S:
                    last_ping = time.monotonic()
                    self.call("ping", timeout=30)
            except CandidateFailed as e:
                if not e.recovered:  # put back in place (a lifted device-memory cap): say so
                    self.journal.append("device_memory", reason=e.reason)
            except Exception as e:  # noqa: BLE001 - the next request retries the start and reports why
                self.journal.append("recovery_failed", reason=str(e))
                self._kill()  # no worker: not retried here in a loop; the next request tries again
            finally:
                self.lock.release()

    def device_max(self) -> int | None:
        """The worker's device-memory limit (bytes), as it reported at start-up; None on a CPU."""
        return ((self.info.get("memory") or {}).get("device_limit") or {}).get("limit_bytes")

    def stop(self) -> None:
        self.stopping = True
        self.close_pool()
        with self.lock:
            if self.proc is not None and self.proc.is_alive():
                try:
                    self.conn.send({"op": "exit"})
                    self.proc.join(10)
                except (OSError, BrokenPipeError):
                    pass
            self._kill()

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(30)
            self.proc = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _wait(self, timeout: float, what: str) -> dict:
        """Wait for the worker's reply, watching for death, timeout and the memory limit."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.conn.poll(POLL_S):
                    return self.conn.recv()
            except (EOFError, OSError):
                pass  # the worker died mid-reply: handled below
            if not self.proc.is_alive():
                self.proc.join(5)
                why = _signal_name(self.proc.exitcode, self.tp)
                raise CandidateFailed("crashed", f"the worker died during {what} ({why})")
            if self.max_rss and _rss(self.proc.pid) > self.max_rss:
                raise CandidateFailed("memory", f"the worker's memory passed the limit of {self.max_rss} bytes "
                                                f"during {what}")
            if time.monotonic() > deadline:
                raise CandidateFailed("timeout", f"{what} did not finish within {timeout:g} s")

    # ---------------------------------------------------------------- calls
    def call(self, op: str, timeout: float | None = None, **params):
        """Run one worker operation. Bad input -> EngineError; a candidate's failure -> CandidateFailed (after
        the worker has been replaced if it had to be)."""
        with self.lock:
            if self.proc is None:
                self._recover("the worker was not running")
            elif not self.proc.is_alive():
                self.proc.join(5)
                why = _signal_name(self.proc.exitcode, self.tp)
                self._recover(f"the worker exited between requests ({why})")
            timeout = self.default_timeout if timeout is None else float(timeout)
            # with process isolation the worker enforces the timeout on the candidate's process itself
            grace = GRACE_S if getattr(self, "isolation", "inprocess") == "process" else 0.0
            try:
                self.conn.send({"op": op, "params": params, "timeout_s": timeout})
                reply = self._wait(timeout + grace, what=op)
            except CandidateFailed as e:
                self._recover(e.reason)
                e.recovered = True
                raise
            except (BrokenPipeError, OSError) as e:
                self._recover(f"the pipe to the worker broke ({e})")
                err = CandidateFailed("crashed", f"the worker was gone during {op}")
                err.recovered = True
                raise err from None
            self._apply_events(reply.get("events") or [])
            if reply.get("fatal"):
                self.proc.join(10)
                err = reply.get("error") or {}
                reason = err.get("message") or (reply.get("result") or {}).get("reason") or "fatal"
                self._recover(f"the worker exited after a fatal failure during {op}: {reason}")
                result = reply.get("result") or {}
                if reply.get("ok") and isinstance(result, dict) and (result.get("tampered") or result.get("leaked")):
                    kind = "memory" if result.get("leaked") else "tampered"
                    failed = CandidateFailed(kind, result.get("leaked") or result["tampered"], result)
                    failed.recovered = True
                    raise failed
                if reply.get("ok"):
                    return reply["result"]
                failed = CandidateFailed(err.get("kind") or "corrupted", reason, err)
                failed.recovered = True
                raise failed
            if reply.get("ok"):
                result = reply["result"]
                if isinstance(result, dict) and result.get("tampered"):  # put back, but timed/checked under it
                    raise CandidateFailed("tampered", result["tampered"], result)
                if isinstance(result, dict) and result.get("leaked"):  # memory it kept, given back in place
                    raise CandidateFailed("memory", result["leaked"], result)
                return result
            err = reply.get("error") or {}
            if err.get("invalid"):
                raise CandidateFailed("invalid", err.get("message", "a sampled check failed"), err)
            if err.get("candidate_failure"):
                text = f"{err.get('type', '')} {err.get('message', '')}".lower()
                memory = ("outofmemory" in text or "memoryerror" in text or "out of memory" in text
                          or "can't allocate memory" in text)
                kind = err.get("kind") or ("memory" if memory else "raised")
                if err.get("type") == "TrialFailed":  # the candidate's own process died, hung or grew too big
                    raise CandidateFailed(kind, err.get("message", ""), err)
                raise CandidateFailed(kind, f"{err.get('type')}: {err.get('message')}", err)
            raise EngineError(err.get("message", "the worker refused the request"))

    def _apply_events(self, events: list) -> None:
        """What the worker noticed outside a request: journal it; mirror a tier that changed what it serves."""
        for ev in events:
            self.journal.append(ev.get("kind", "event"), **{k: v for k, v in ev.items() if k != "kind"})
            for tier, slot in (ev.get("slots") or {}).items():
                if tier in self.serving:
                    self.serving[tier] = {"current": slot["current"], "history": list(slot["history"])}

    def _recover(self, reason: str) -> dict:
        """Replace the worker and restore what each tier was serving; journaled with how long it took."""
        t0 = time.perf_counter()
        self._kill()
        self.restarts += 1
        self.start()
        t_worker = time.perf_counter() - t0
        restored, lost = {}, {}
        for tier, s in self.serving.items():
            if self.trial == (tier, s["current"]) and s["history"]:
                s["current"] = s["history"].pop()  # the candidate on trial is what failed: do not restore it
            cid = s["current"]
            if cid == "baseline":
                continue
            try:
                spec = self.specs[cid]
                self._call_raw("load", spec=spec, tier=tier, serving=True)  # it served before the restart
                v = self._call_raw("validate", candidate=cid, tier=tier)
                if not v.get("ok"):
                    raise EngineError(v.get("reason"))
                self._call_raw("swap", candidate=cid, tier=tier)
                restored[tier] = cid
            except Exception as e:  # noqa: BLE001 - serve the baseline rather than nothing
                lost[tier] = f"{cid}: {e}"
                s["current"] = "baseline"
        rec = {"reason": reason, "recovery_s": time.perf_counter() - t0, "worker_start_s": t_worker,
               "restored": restored, "not_restored": lost, "restarts": self.restarts}
        self.recoveries.append(rec)
        self.journal.append("recovery", **rec)
        return rec

    def _call_raw(self, op: str, **params):
        """A worker call during recovery: failures propagate, no nested recovery."""
        self.conn.send({"op": op, "params": params})
        reply = self._wait(self.default_timeout, what=f"recovery {op}")
        if not reply.get("ok"):
            raise EngineError((reply.get("error") or {}).get("message", "failed"))
        return reply["result"]

    # ---------------------------------------------------------- RPC methods
    def check_expectations(self, params: dict) -> None:
        """A request may say which model/device it expects; a wrong one is refused with the reason."""
        model = params.pop("model", None)
        device = params.pop("device", None)
        if model is not None:
            check_model_name(str(model))
            if model != self.cfg["model"]:
                raise EngineError(f"this engine serves model {self.cfg['model']!r}, not {model!r}; start another "
                                  f"engine (tkcc serve --model {model}) for it")
        if device is not None:
            dev = check_device(str(device))
            if dev != self.cfg["device"]:
                raise EngineError(f"this engine runs on {self.cfg['device']}, not {dev}")

    def status(self) -> dict:
        out = {"engine": {"model": self.cfg["model"], "device": self.cfg["device"], "tp": int(self.cfg.get("tp") or 1),
                          "pid": os.getpid(),
                          "uptime_s": time.time() - self.started, "restarts": self.restarts,
                          "recoveries": self.recoveries[-10:], "journal": self.journal.path,
                          "worker_pid": self.proc.pid if self.proc else None,
                          "isolation": getattr(self, "isolation", None), "worker_max_rss_bytes": self.max_rss,
                          "device_max_bytes": self.device_max(),
                          "compile": self.ahead_status()},
               "serving": self.serving}
        if self.lock.acquire(timeout=0.5):
            try:
                out["worker"] = self.call("status", timeout=60)
            except TkccError as e:
                out["worker_error"] = str(e)
            finally:
                self.lock.release()
        else:
            out["worker"] = self.info
            out["busy"] = True
        return out

    def load(self, candidate: dict, tiers=TIERS, timeout_s: float | None = None, serving: bool = False) -> dict:
        """Build ``candidate`` for each tier. ``serving``: it serves already (a watcher's reference), so the
        worker keeps what its first load warms (``tkcc.runtime.memory_ledger``) instead of charging it."""
        res = {}
        for tier in _tiers(tiers):
            kernels = self.kernels_for(candidate, tier, timeout_s)  # its compiles queued ahead, if any
            if kernels is not None and not kernels["ok"]:
                raise EngineError(f"the {tier} tier: {kernels['reason']}")
            r = self.call("load", timeout_s, spec=candidate, tier=tier, serving=serving)
            if kernels is not None:
                r["kernels"] = kernels
            self.specs[r["candidate"]] = candidate
            res[tier] = r
        return res

    def swap(self, candidate: str, tier: str, workload=None, timeout_s: float | None = None) -> dict:
        check_tier(tier)
        r = self.call("swap", timeout_s, candidate=candidate, tier=tier, workload=workload)
        self._note_swap(tier, candidate)
        self.journal.append("swap", tier=tier, candidate=candidate, previous=r.get("previous"),
                            swap_s=r.get("swap_s"), capture_s=r.get("capture_s"))
        return r

    def _note_swap(self, tier: str, cid: str) -> None:
        s = self.serving[tier]
        if s["current"] != cid:
            s["history"].append(s["current"])
            s["current"] = cid

    def revert(self, tier: str, workload=None, timeout_s: float | None = None) -> dict:
        check_tier(tier)
        r = self.call("revert", timeout_s, tier=tier, workload=workload)
        s = self.serving[tier]
        if s["history"]:
            s["current"] = s["history"].pop()
        self.journal.append("revert", tier=tier, reverted=r.get("reverted"), current=r.get("current"))
        return r

    def experiment(self, candidate: dict, tiers=("fast", "slow"), workload=None, keep: bool = False,
                   reps: int = 30, warmup: int = 5, rotations: int = 4, timeout_s: float | None = None,
                   request_id: str | None = None, max_shapes: int = 4, measure: bool = True) -> dict:
        """Load, validate, swap + capture, measure, (revert) on each tier; journaled before it returns.
        ``measure=False`` (a ship, ``keep``: the candidate was measured when it was confirmed) skips the
        measurement: validated on fresh inputs, swapped in and kept."""
        if not measure and not keep:
            raise EngineError("experiment(measure=False) only ships (keep=True): an experiment that keeps nothing "
                              "and measures nothing does nothing")
        request_id = request_id or uuid.uuid4().hex
        tiers = _tiers(tiers)
        self.journal.append("accepted", request_id=request_id, candidate=candidate, tiers=list(tiers))
        out = {"request_id": request_id, "candidate": None, "ok": True, "tiers": {}}
        for tier in tiers:
            t0 = time.perf_counter()
            step, cid, swapped = "load", None, False
            rec: dict = {"ok": False}
            try:
                kernels = self.kernels_for(candidate, tier, timeout_s)  # waits for this candidate's compiles only
                if kernels is not None:
                    rec["kernels"] = kernels
                    if not kernels["ok"]:
                        step = "compile"
                        rec.update(failure="compile", reason=f"during compile: {kernels['reason']}")
                        raise _Stop
                with self.lock:
                    r = self.call("load", timeout_s, spec=candidate, tier=tier)
                    cid = r["candidate"]
                    out["candidate"] = cid
                    self.specs[cid] = candidate
                    rec["load"] = r
                    step = "validate"
                    v = self.call("validate", timeout_s, candidate=cid, tier=tier, workload=workload,
                                  max_shapes=max_shapes)
                    rec["validation"] = v
                    if not v["ok"]:
                        rec.update(failure="invalid", reason=v["reason"])
                        raise _Stop
                    step = "swap"
                    self.trial = (tier, cid)
                    rec["swap"] = self.call("swap", timeout_s, candidate=cid, tier=tier, workload=workload)
                    self._note_swap(tier, cid)
                    swapped = True
                    if measure:
                        step = "measure"
                        w0 = time.perf_counter()
                        m = self.call("measure", timeout_s, tier=tier, workload=workload, reps=reps, warmup=warmup,
                                      rotations=rotations)
                        m["supervisor_wall_s"] = time.perf_counter() - w0
                        m["timing_consistent"] = sum(sum(b["samples_s"]) for b in m["buckets"]) <= \
                            m["supervisor_wall_s"]
                        rec["measurement"] = m
                    if keep or rec["swap"].get("previous") == cid:
                        self.trial = None  # kept, or it was already serving before this experiment
                    else:
                        step = "revert"
                        self._end_trial(tier, cid)
                    rec["ok"] = True
            except _Stop:
                pass
            except CandidateFailed as e:
                rec.update(failure=e.kind, reason=f"during {step}: {e.reason}")
                if e.details.get("pid"):
                    rec["trial"] = {"pid": e.details["pid"], "ended": "killed with its process group"}
                if getattr(e, "recovered", False) and self.recoveries:
                    rec["recovery"] = self.recoveries[-1]  # the worker itself had to be replaced
                elif swapped and rec["swap"].get("previous") != cid:
                    self._end_trial(tier, cid)
            except TkccError as e:
                rec.update(failure="refused", reason=f"during {step}: {e}")
                if swapped and rec["swap"].get("previous") != cid:
                    self._end_trial(tier, cid)
            finally:
                self.trial = None
            rec["seconds"] = time.perf_counter() - t0
            out["tiers"][tier] = rec
            if not rec["ok"]:
                out["ok"] = False
                out["reason"] = f"{tier} tier: {rec.get('reason')}"
                break  # a candidate that fails on one tier is not tried on the next
        if out["candidate"] and not keep:
            try:  # free its compiled forwards unless a tier still serves it (the worker checks)
                self.call("unload", None, candidate=out["candidate"])
            except CandidateFailed as e:  # in-process: memory it left behind is charged to it
                out.update(ok=False, reason=f"after unload: {e.reason}", unload={"failure": e.kind, "reason": e.reason})
            except TkccError:
                pass
        rec = self.journal.append("experiment", **out)
        out["seq"] = rec["seq"]
        return out

    def _end_trial(self, tier: str, cid: str) -> None:
        """Put back the forward that served before the candidate was swapped in to be measured."""
        s = self.serving[tier]
        if s["current"] != cid:
            return  # a recovery already restored the previous forward
        try:
            self.call("revert", None, tier=tier, workload=None, capture=False)
        except TkccError:
            return
        if s["history"]:
            s["current"] = s["history"].pop()

    def results(self, since: int = 0, request_id: str | None = None, kind: str | None = None,
                limit: int = 1000) -> dict:
        recs = self.journal.records(since=since, kind=kind, request_id=request_id)
        return {"records": recs[-int(limit):], "count": len(recs)}


class _Stop(Exception):
    pass


def _tiers(tiers) -> tuple:
    if isinstance(tiers, str):
        tiers = ("fast", "slow") if tiers == "both" else (tiers,)
    if not isinstance(tiers, (list, tuple)) or not tiers:
        raise EngineError(f"tiers: expected 'fast', 'slow', 'both' or a list of them, got {tiers!r}")
    for t in tiers:
        check_tier(t)
    return tuple(tiers)


def _check_validation(mode) -> str:
    """--validation: auto|exact|tolerance, checked before a worker starts (tkcc.runtime.determinism.MODES)."""
    m = "auto" if mode is None else str(mode)
    if m not in ("auto", "exact", "tolerance"):
        raise EngineError(f"--validation {mode!r}: must be one of ['auto', 'exact', 'tolerance']")
    return m


def _check_isolation(mode, device: str, tp: int) -> None:
    """--isolation, checked before a worker starts (the worker resolves it: tkcc.runtime.engine)."""
    if mode is None:
        return
    if mode not in ("auto", "process", "inprocess"):
        raise EngineError(f"--isolation {mode!r}: must be one of ['auto', 'process', 'inprocess']")
    if mode == "process" and (not str(device).startswith("cpu") or tp > 1):
        why = "a CUDA context does not survive fork" if not str(device).startswith("cpu") else \
            "--tp ranks share one group"
        raise EngineError(f"--isolation process needs a CPU engine with one rank ({why}); use --isolation auto or "
                          "inprocess")


def check_device_max(given, device: str) -> int:
    """``--device-max-mem`` (bytes; 0 or None: derived from the device and the model), checked before any worker
    starts: a negative size, or one for a CPU engine, is refused. Larger than the device is the worker's check
    (the supervisor does not touch CUDA): it runs before the model is built."""
    try:
        b = float(given or 0)
    except (TypeError, ValueError):
        raise EngineError(f"--device-max-mem {given!r}: expected a number of GiB") from None
    if not b >= 0:
        raise EngineError(f"--device-max-mem {b / 2**30:g} GiB: must be 0 (derived from the device and the model) "
                          "or a positive size")
    if b and not str(device).startswith("cuda"):
        raise EngineError(f"--device-max-mem applies to a CUDA device; this engine runs on {device}")
    return int(b)


def _worker_entry(conn, cfg):
    from tkcc.runtime.worker import worker_main

    worker_main(conn, cfg)
