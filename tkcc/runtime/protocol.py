"""Wire format of the engine's RPC: length-prefixed JSON frames, bounded, token-authenticated.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8
JSON. A request is ``{"token", "method", "params", "id"}``; a reply is
``{"id", "ok": true, "result"}`` or ``{"id", "ok": false, "error": {"type",
"message"}}``. The length is checked *before* the body is read, so an
oversized message costs the server four bytes, not memory. The token is
compared with ``hmac.compare_digest`` (constant time).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
import socket
import struct

from tkcc.errors import EngineError

HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 1 << 20          # requests carry plans, paths and workloads, never tensors
MAX_REPLY_BYTES = 64 << 20           # replies carry measurements (samples) and journals
READ_TIMEOUT_S = 60.0                # a client that stalls mid-frame is dropped


class FrameTooLarge(EngineError):
    """A frame announced more bytes than the receiver accepts."""


class ConnectionClosed(EngineError):
    """The peer closed the connection (cleanly, between frames)."""


def send_frame(sock: socket.socket, obj: dict, limit: int = MAX_REPLY_BYTES) -> None:
    body = json.dumps(obj, default=_json_default, allow_nan=True).encode()
    if len(body) > limit:
        raise FrameTooLarge(f"message of {len(body)} bytes exceeds the limit of {limit} bytes")
    sock.sendall(HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket, limit: int) -> dict:
    """Read one frame; raises FrameTooLarge (body left unread), ConnectionClosed, or EngineError (malformed)."""
    head = _recv_exact(sock, HEADER.size, allow_eof=True)
    if head is None:
        raise ConnectionClosed("connection closed")
    (n,) = HEADER.unpack(head)
    if n > limit:
        raise FrameTooLarge(f"message of {n} bytes exceeds the limit of {limit} bytes")
    body = _recv_exact(sock, n, allow_eof=False)
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineError(f"malformed request: body is not UTF-8 JSON ({e})") from None
    if not isinstance(obj, dict):
        raise EngineError(f"malformed request: expected a JSON object, got {type(obj).__name__}")
    return obj


def _recv_exact(sock: socket.socket, n: int, allow_eof: bool) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if allow_eof and not buf:
                return None
            raise EngineError(f"malformed request: connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _json_default(o):
    if hasattr(o, "to_json"):
        return o.to_json()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def token_ok(given, expected: str) -> bool:
    """Constant-time token check; anything that is not a string fails."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def default_socket_path() -> str:
    """$TKCC_ENGINE_SOCKET, else /tmp/tkcc-<uid>/engine.sock (the folder is made 0700 by the server)."""
    env = os.environ.get("TKCC_ENGINE_SOCKET")
    if env:
        return env
    return os.path.join(f"/tmp/tkcc-{os.getuid()}", "engine.sock")


def token_path_for(socket_path: str) -> str:
    return socket_path + ".token"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def write_secret(path: str, text: str) -> None:
    """Write ``text`` to a new file readable by its owner only (0600), replacing any old one."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
