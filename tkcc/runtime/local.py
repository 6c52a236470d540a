"""The engine in this process, over a Program captured here: what ``tkcc.compile`` runs its loop on.

Why in-process: ``tkcc.compile`` takes a user's ``nn.Module`` object, which a
spawned worker cannot be handed (it would have to be pickled, and any class a
user defined in ``__main__`` does not import there). So the same
``EngineCore`` that a ``tkcc serve`` worker holds is built here, on the
Program ``tkcc.compile`` captured, sharing the model's weights.

The experiment sequence (load, validate, swap, measure, revert), its journal
and its bookkeeping are the supervisor's own (``Supervisor.experiment``):
``InProcessSupervisor`` only replaces the pipe to a worker process by a
direct call. What it cannot do is what a separate process buys: a candidate
that segfaults or hangs takes this process with it. The candidates
``tkcc.compile`` proposes are tkcc's own registered passes, validated before
they are measured; source candidates from an external agent belong in
``tkcc campaign``, whose engine is a separate process.

``LocalClient`` has the ``EngineClient`` methods the campaign's
``EngineEvaluator`` calls, so the campaign loop drives both engines the same
way.
"""
from __future__ import annotations

import os
import tempfile
import time

from tkcc.errors import EngineError, TkccError
from tkcc.runtime.journal import Journal
from tkcc.runtime.programs import check_device
from tkcc.runtime.supervisor import CandidateFailed, Supervisor, _check_validation


class InProcessSupervisor(Supervisor):
    """A Supervisor whose worker is an ``EngineCore`` in this process (see the module docstring)."""

    def __init__(self, cfg: dict, program, journal: Journal):
        cfg = dict(cfg)
        cfg["device"] = check_device(cfg["device"])
        cfg["validation"] = _check_validation(cfg.get("validation"))
        cfg.setdefault("model", str(program.meta.get("name") or program.meta.get("model_class") or "model"))
        self._setup(cfg, journal)
        self.program = program
        self.core = None
        self.max_rss = 0  # no worker process to watch: the memory limits are a spawned engine's

    def start(self) -> dict:
        from tkcc.runtime.engine import EngineCore

        t0 = time.perf_counter()
        try:
            self.core = EngineCore({**self.cfg, "program": self.program})
        except TkccError:
            raise
        except Exception as e:  # noqa: BLE001 - named, with the cause
            raise EngineError(f"the in-process engine could not start on {self.cfg['device']}: "
                              f"{type(e).__name__}: {e}") from e
        self.info = self.core.op_status()
        self.info["worker_start_s"] = time.perf_counter() - t0
        return self.info

    def stop(self) -> None:
        self.stopping = True
        self.close_pool()
        self.core = None

    def _kill(self) -> None:
        self.core = None

    def call(self, op: str, timeout: float | None = None, **params):
        """Run one engine operation here. Bad input -> EngineError; a candidate's failure -> CandidateFailed."""
        from tkcc.runtime.worker import _unhealthy

        with self.lock:
            if self.core is None:
                raise EngineError("the in-process engine is stopped")
            fn = getattr(self.core, f"op_{op}", None)
            if fn is None:
                raise EngineError(f"unknown operation {op!r}")
            try:
                result = fn(**params)
            except TkccError as e:
                raise EngineError(str(e)) from None
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - a candidate's failure, of any kind
                text = f"{type(e).__name__}: {e}"
                low = text.lower()
                kind = "memory" if ("outofmemory" in low or "memoryerror" in low or "out of memory" in low) \
                    else "raised"
                broken = _unhealthy(self.core, e)
                if broken:  # no fresh worker to start in-process: the engine cannot go on
                    self.core = None
                    raise TkccError(f"a candidate left this process's device or weights unusable ({broken}) "
                                    f"during {op}: {text}") from e
                raise CandidateFailed(kind, text) from None
            if isinstance(result, dict) and result.get("fatal"):
                self.core = None
                raise TkccError(f"the in-process engine cannot go on after {op}: {result.get('reason')}")
            return result

    def _recover(self, reason: str) -> dict:  # nothing to restart in-process: the failure was already raised
        rec = {"reason": reason, "recovery_s": 0.0, "restarts": self.restarts, "in_process": True}
        self.journal.append("recovery", **rec)
        return rec


class LocalClient:
    """The ``EngineClient`` calls the campaign uses, answered by an in-process engine."""

    def __init__(self, program, device: str, *, validation: str | None = None, state_dir: str | None = None,
                 **cfg):
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="tkcc-engine-")
        os.makedirs(self.state_dir, exist_ok=True)
        dtype = str(program.meta.get("dtype") or "float32")
        full = {"device": device, "dtype": dtype, "validation": validation,
                "work_dir": os.path.join(self.state_dir, "candidates"), "state_dir": self.state_dir, **cfg}
        self.supervisor = InProcessSupervisor(full, program, Journal(os.path.join(self.state_dir, "journal.jsonl")))
        self.supervisor.start()

    @property
    def core(self):
        return self.supervisor.core

    def status(self) -> dict:
        return self.supervisor.status()

    def load(self, candidate: dict, tiers="both", **kw) -> dict:
        return self.supervisor.load(candidate, tiers=tiers, **kw)

    def prepare(self, candidate: dict, tiers="both", **kw) -> dict:
        return self.supervisor.prepare(candidate, tiers=tiers, **kw)

    def cancel(self, candidate: dict) -> dict:
        return self.supervisor.cancel(candidate)

    def experiment(self, candidate: dict, tiers="both", workload=None, **kw) -> dict:
        from tkcc.runtime.client import _wl

        return self.supervisor.experiment(candidate, tiers=tiers, workload=_wl(workload), **kw)

    def shutdown(self) -> dict:
        self.supervisor.stop()
        return {"stopped": True}

    def close(self) -> None:
        self.supervisor.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
