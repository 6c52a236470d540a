"""EngineClient: the Python side of the engine's RPC (the CLI and the campaign use it).

    from tkcc.runtime import EngineClient
    with EngineClient() as eng:                       # default socket; token read from <socket>.token
        eng.status()
        res = eng.experiment({"plan": plan.to_json()}, workload=workload, tiers="both")

Each method sends one request and returns the result, or raises EngineError
with the engine's message. ``request_id`` makes an experiment's result
retrievable later (``results(request_id=...)``) even if the connection drops.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import socket

from tkcc.errors import EngineError
from tkcc.runtime import protocol


class EngineClient:
    def __init__(self, socket_path: str | None = None, host: str | None = None, port: int | None = None,
                 token: str | None = None, token_file: str | None = None, timeout_s: float | None = None):
        self.host, self.port = host, port
        self.socket_path = None if host else (socket_path or protocol.default_socket_path())
        if token is None:
            token_file = token_file or (protocol.token_path_for(self.socket_path) if self.socket_path else None)
            token = read_token(token_file, "the engine token", "a TCP engine needs --token or --token-file (printed "
                               "by tkcc serve)", "is an engine running there (tkcc serve)?", EngineError)
        self.token = token
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)

    # --------------------------------------------------------------- plumbing
    def _connect(self) -> socket.socket:
        if self._sock is None:
            try:
                if self.host:
                    s = socket.create_connection((self.host, int(self.port)), timeout=10)
                else:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(10)
                    s.connect(self.socket_path)
            except OSError as e:
                where = f"{self.host}:{self.port}" if self.host else self.socket_path
                raise EngineError(f"no engine at {where} ({e.strerror or e}); start one with tkcc serve") from None
            s.settimeout(self.timeout_s)
            self._sock = s
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def call(self, method: str, **params):
        rid = next(self._ids)
        sock = self._connect()
        try:
            protocol.send_frame(sock, {"token": self.token, "id": rid, "method": method, "params": params},
                                limit=protocol.MAX_REQUEST_BYTES)
            reply = protocol.recv_frame(sock, protocol.MAX_REPLY_BYTES)
        except (OSError, protocol.ConnectionClosed) as e:
            self.close()
            raise EngineError(f"the engine closed the connection during {method!r} ({e})") from None
        if not reply.get("ok"):
            err = reply.get("error") or {}
            if err.get("type") == "AuthError":
                self.close()
            raise EngineError(f"{err.get('type', 'error')}: {err.get('message', reply)}")
        return reply.get("result")

    # ---------------------------------------------------------------- methods
    def ping(self) -> dict:
        return self.call("ping")

    def status(self) -> dict:
        return self.call("status")

    def load(self, candidate: dict, tiers="both", **kw) -> dict:
        return self.call("load", candidate=with_hash(candidate), tiers=tiers, **kw)

    def prepare(self, candidate: dict, tiers="both", **kw) -> dict:
        """List the candidate's kernel compiles and queue them in the engine's compile pool (returns at once)."""
        return self.call("prepare", candidate=with_hash(candidate), tiers=tiers, **kw)

    def cancel(self, candidate: dict) -> dict:
        return self.call("cancel", candidate=with_hash(candidate))

    def validate(self, candidate: str, tier: str = "slow", workload=None, **kw) -> dict:
        return self.call("validate", candidate=candidate, tier=tier, workload=_wl(workload), **kw)

    def swap(self, candidate: str, tier: str = "slow", workload=None, **kw) -> dict:
        return self.call("swap", candidate=candidate, tier=tier, workload=_wl(workload), **kw)

    def revert(self, tier: str = "slow", workload=None, **kw) -> dict:
        return self.call("revert", tier=tier, workload=_wl(workload), **kw)

    def measure(self, tier: str = "slow", workload=None, **kw) -> dict:
        return self.call("measure", tier=tier, workload=_wl(workload), **kw)

    def experiment(self, candidate: dict, tiers="both", workload=None, **kw) -> dict:
        return self.call("experiment", candidate=with_hash(candidate), tiers=tiers, workload=_wl(workload), **kw)

    def generate(self, prompt: list[int], n: int = 8, tier: str = "slow") -> dict:
        return self.call("generate", prompt=list(prompt), n=n, tier=tier)

    def results(self, since: int = 0, request_id: str | None = None, kind: str | None = None) -> dict:
        return self.call("results", since=since, request_id=request_id, kind=kind)

    def shutdown(self) -> dict:
        return self.call("shutdown")


def read_token(path: str | None, what: str, missing: str, hint: str, error: type = EngineError) -> str:
    """The secret a server wrote to ``path`` (0600, ``protocol.write_secret``), or ``error`` saying why not:
    ``missing`` when no path was given, the OS's reason and ``hint`` when it cannot be read."""
    if path is None:
        raise error(missing)
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise error(f"cannot read {what} from {path!r} ({e.strerror}); {hint}") from None


def _wl(workload):
    if workload is None or isinstance(workload, dict):
        return workload
    from tkcc.runtime.workloads import workload_to_json

    return workload_to_json(workload)


def with_hash(candidate: dict) -> dict:
    """Source candidates travel as a path plus the sha256 of the file the client means (checked by the engine)."""
    if isinstance(candidate, dict) and "source" in candidate and "sha256" not in candidate:
        path = os.path.abspath(candidate["source"])
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError as e:
            raise EngineError(f"source candidate {path!r}: {e.strerror}") from None
        candidate = {**candidate, "source": path, "sha256": digest}
    for key in ("artifact", "pass_modules"):
        if isinstance(candidate, dict) and key in candidate:
            v = candidate[key]
            candidate = {**candidate, key: [os.path.abspath(p) for p in v] if isinstance(v, list)
                         else os.path.abspath(v)}
    return candidate
