"""The engine's RPC server: a Unix socket (default) or loopback TCP, token-checked, bounded frames.

One thread per connection; the supervisor serialises work on the device.
Every reply is ``{"id", "ok", "result"|"error"}``; an unauthenticated or
oversized request gets an error and the connection is closed, a malformed
one gets an error and the connection stays usable. Nothing a client sends
stops the server except an authenticated ``shutdown``.
"""
from __future__ import annotations

import inspect
import os
import socket
import socketserver
import sys
import threading
import time

from tkcc.errors import EngineError, TkccError
from tkcc.runtime import protocol
from tkcc.runtime.supervisor import Supervisor


def _methods(sup: Supervisor, server: "EngineServer") -> dict:
    def ping() -> dict:
        return {"pong": True, "model": sup.cfg["model"], "device": sup.cfg["device"], "pid": os.getpid()}

    def status() -> dict:
        return sup.status()

    def load(candidate: dict, tiers="both", timeout_s: float | None = None, serving: bool = False) -> dict:
        return sup.load(candidate, tiers, timeout_s, serving=bool(serving))

    def prepare(candidate: dict, tiers="both", timeout_s: float | None = None) -> dict:
        return sup.prepare(candidate, tiers, timeout_s)

    def cancel(candidate: dict) -> dict:
        return sup.cancel(candidate)

    def validate(candidate: str, tier: str = "slow", workload=None, seed: int | None = None,
                 max_shapes: int = 4, timeout_s: float | None = None) -> dict:
        res = sup.call("validate", timeout_s, candidate=candidate, tier=tier, workload=workload, seed=seed,
                       max_shapes=max_shapes)
        sup.journal.append("validation", candidate=candidate, tier=tier, result=res)
        return res

    def swap(candidate: str, tier: str = "slow", workload=None, timeout_s: float | None = None) -> dict:
        return sup.swap(candidate, tier, workload, timeout_s)

    def revert(tier: str = "slow", workload=None, timeout_s: float | None = None) -> dict:
        return sup.revert(tier, workload, timeout_s)

    def measure(tier: str = "slow", workload=None, reps: int = 30, warmup: int = 5, rotations: int = 4,
                timeout_s: float | None = None) -> dict:
        t0 = time.perf_counter()
        m = sup.call("measure", timeout_s, tier=tier, workload=workload, reps=reps, warmup=warmup,
                     rotations=rotations)
        m["supervisor_wall_s"] = time.perf_counter() - t0
        m["timing_consistent"] = sum(sum(b["samples_s"]) for b in m["buckets"]) <= m["supervisor_wall_s"]
        sup.journal.append("measurement", measurement=m)
        return m

    def experiment(candidate: dict, tiers="both", workload=None, keep: bool = False, reps: int = 30,
                   warmup: int = 5, rotations: int = 4, timeout_s: float | None = None,
                   request_id: str | None = None, max_shapes: int = 4, measure: bool = True) -> dict:
        return sup.experiment(candidate, tiers, workload, keep, reps, warmup, rotations, timeout_s, request_id,
                              max_shapes, measure=bool(measure))

    def generate(prompt: list, n: int = 8, tier: str = "slow", timeout_s: float | None = None) -> dict:
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise EngineError("generate: 'prompt' must be a list of token ids (integers)")
        return sup.call("generate", timeout_s, prompt=prompt, n=int(n), tier=tier)

    def unload(candidate: str) -> dict:
        return sup.call("unload", None, candidate=candidate)

    def results(since: int = 0, request_id: str | None = None, kind: str | None = None, limit: int = 1000) -> dict:
        return sup.results(since, request_id, kind, limit)

    def shutdown() -> dict:
        threading.Thread(target=server.stop, name="tkcc-engine-stop", daemon=True).start()
        return {"stopping": True}

    return {f.__name__: f for f in (ping, status, load, prepare, cancel, validate, swap, revert, measure, experiment,
                                    generate, unload, results, shutdown)}


def _call(fn, params: dict):
    sig = inspect.signature(fn)
    unknown = sorted(set(params) - set(sig.parameters))
    if unknown:
        raise EngineError(f"method {fn.__name__!r}: unknown parameter(s) {unknown}; it takes "
                          f"{sorted(sig.parameters) or 'none'}")
    missing = [n for n, p in sig.parameters.items() if p.default is inspect.Parameter.empty and n not in params]
    if missing:
        raise EngineError(f"method {fn.__name__!r}: missing parameter(s) {missing}")
    return fn(**params)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: EngineServer = self.server.engine  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        sock.settimeout(protocol.READ_TIMEOUT_S)
        while not srv.stopped.is_set():
            rid = None
            try:
                req = protocol.recv_frame(sock, srv.max_request_bytes)
                rid = req.get("id")
                if not protocol.token_ok(req.get("token"), srv.token):
                    self._reply(sock, rid, error=("AuthError", "unauthenticated: missing or wrong token"))
                    return
                method = req.get("method")
                params = req.get("params", {})
                if not isinstance(method, str) or method not in srv.methods:
                    raise EngineError(f"malformed request: unknown method {method!r}; methods: "
                                      f"{sorted(srv.methods)}")
                if not isinstance(params, dict):
                    raise EngineError(f"malformed request: 'params' must be an object, got {type(params).__name__}")
                params = dict(params)
                srv.supervisor.check_expectations(params)
                result = _call(srv.methods[method], params)
                self._reply(sock, rid, result=result)
            except protocol.ConnectionClosed:
                return
            except protocol.FrameTooLarge as e:
                self._reply(sock, rid, error=("EngineError", f"request refused: {e}"))
                return
            except (socket.timeout, ConnectionError, OSError):
                return
            except TkccError as e:
                self._reply(sock, rid, error=(type(e).__name__, str(e)))
            except Exception as e:  # noqa: BLE001 - a bug must not take the server down
                self._reply(sock, rid, error=("InternalError", f"{type(e).__name__}: {e}"))

    def _reply(self, sock, rid, result=None, error=None) -> None:
        if error is None:
            msg = {"id": rid, "ok": True, "result": result}
        else:
            msg = {"id": rid, "ok": False, "error": {"type": error[0], "message": error[1]}}
        try:
            protocol.send_frame(sock, msg)
        except protocol.FrameTooLarge as e:
            protocol.send_frame(sock, {"id": rid, "ok": False, "error": {"type": "EngineError",
                                                                          "message": f"reply too large: {e}"}})
        except OSError:
            pass


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class EngineServer:
    def __init__(self, supervisor: Supervisor, token: str, socket_path: str | None = None, host: str | None = None,
                 port: int | None = None, allow_remote: bool = False,
                 max_request_bytes: int = protocol.MAX_REQUEST_BYTES):
        self.supervisor = supervisor
        self.token = token
        self.max_request_bytes = int(max_request_bytes)
        self.stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._stop_done = False
        self._serving = False
        self.methods = _methods(supervisor, self)
        self.socket_path = None
        if host is not None:
            if not protocol.is_loopback(host):
                if not allow_remote:
                    raise EngineError(f"--host {host} is not a loopback address; binding to another interface "
                                      "exposes the engine to the network: pass --allow-remote to do it anyway")
                print(f"tkcc serve: WARNING: listening on {host}:{port}, reachable from other machines; anyone "
                      "with the token can run code in this engine", file=sys.stderr, flush=True)
            self.server = _TCPServer((host, int(port or 0)), _Handler, bind_and_activate=True)
            self.address = {"host": host, "port": self.server.server_address[1]}
        else:
            path = socket_path or protocol.default_socket_path()
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, mode=0o700, exist_ok=True)
            if os.path.exists(path):
                if _socket_alive(path):
                    raise EngineError(f"an engine is already listening on {path}; stop it (tkcc engine stop "
                                      f"--socket {path}) or pick another --socket")
                os.unlink(path)
            old = os.umask(0o177)
            try:
                self.server = _UnixServer(path, _Handler, bind_and_activate=True)
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
            self.socket_path = path
            self.address = {"socket": path}
        self.server.engine = self

    def serve_forever(self) -> None:
        self._serving = True
        try:
            self.server.serve_forever(poll_interval=0.2)
        finally:
            self._serving = False

    def stop(self) -> None:
        """Stop serving, stop the worker, remove the socket and token; a second caller waits for the first."""
        with self._stop_lock:
            if self._stop_done:
                return
            self.stopped.set()
            if self._serving:
                self.server.shutdown()
            self.server.server_close()
            self.supervisor.stop()
            self._remove_files()
            self._stop_done = True

    def _remove_files(self) -> None:
        if self.socket_path:
            for p in (self.socket_path, protocol.token_path_for(self.socket_path)):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass


def _socket_alive(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()
