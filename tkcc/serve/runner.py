"""uvicorn for the app: on a socket the caller binds, in the main thread (the CLI) or a background one.

``bind(host, port)`` refuses a non-loopback address unless asked, and port 0
picks a free port, so tests and benchmarks never collide. ``ServerThread``
runs uvicorn in a thread (tests, notebooks) and stops it on exit, bounded.
"""
from __future__ import annotations

import socket
import threading
import time

from tkcc.errors import TkccError


def is_loopback(host: str) -> bool:
    from tkcc.runtime.protocol import is_loopback as _lo

    return _lo(host.strip("[]"))


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT``, ``:PORT`` or ``PORT`` -> (host, port); the host defaults to 127.0.0.1."""
    s = str(text).strip()
    host, port = "127.0.0.1", s
    if s.startswith("["):
        end = s.find("]")
        if end < 0 or not s[end + 1:].startswith(":"):
            raise TkccError(f"--http {text!r}: write an IPv6 address as [ADDR]:PORT")
        host, port = s[1:end], s[end + 2:]
    elif ":" in s:
        host, port = s.rsplit(":", 1)
        host = host or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise TkccError(f"--http {text!r}: the port must be a number in 0..65535")
    return host, int(port)


def bind(host: str, port: int, allow_remote: bool = False) -> socket.socket:
    if not is_loopback(host) and not allow_remote:
        raise TkccError(f"--http {host}:{port} is not a loopback address; the server listens on another address "
                        "only with --allow-remote (and then give it an --api-key)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise TkccError(f"--http {host}:{port}: cannot listen there: {e}") from None
    sock.listen(2048)
    return sock


def uvicorn_server(app, *, log_level: str = "warning", max_connections: int | None = None,
                   access_log: bool = False):
    import uvicorn

    cfg = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="off",
                         limit_concurrency=max_connections, timeout_graceful_shutdown=5, timeout_keep_alive=30)
    return uvicorn.Server(cfg)


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port by default) in a daemon thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0,
                 max_connections: int | None = None):
        self.sock = bind(host, port)
        h, p = self.sock.getsockname()[:2]
        self.url = f"http://{h if ':' not in h else f'[{h}]'}:{p}"
        self.server = uvicorn_server(app, max_connections=max_connections)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="tkcc-serve-http", daemon=True)
        self._start_timeout_s = start_timeout_s

    def start(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise TkccError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
