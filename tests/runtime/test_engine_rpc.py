"""The RPC boundary: frames, tokens, limits, malformed requests; the engine keeps serving after each."""
from __future__ import annotations

import json
import os
import socket
import stat
import struct

import pytest

from tkcc.errors import EngineError
from tkcc.runtime import protocol

pytestmark = pytest.mark.timeout(120)


def _raw(eng, payload: bytes, read: bool = True):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(eng.socket)
    try:
        s.sendall(payload)
        return protocol.recv_frame(s, protocol.MAX_REPLY_BYTES) if read else None
    finally:
        s.close()


def _frame(obj) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def _serving(eng):
    with eng.client() as c:
        assert c.ping()["pong"]


def test_token_file_and_socket_are_private(blocks_engine):
    tok = blocks_engine.ready["token_file"]
    assert stat.S_IMODE(os.stat(tok).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(blocks_engine.socket).st_mode) == 0o600
    assert len(open(tok).read().strip()) == 64


@pytest.mark.parametrize("token", [None, "", "0" * 64, 12345, ["x"]])
def test_unauthenticated_requests_are_refused(blocks_engine, token):
    req = {"id": 1, "method": "status", "params": {}}
    if token is not None:
        req["token"] = token
    reply = _raw(blocks_engine, _frame(req))
    assert reply["ok"] is False and reply["error"]["type"] == "AuthError"
    assert "unauthenticated" in reply["error"]["message"]
    _serving(blocks_engine)


def test_wrong_token_through_the_client(blocks_engine):
    with blocks_engine.client(token="not-the-token") as c:
        with pytest.raises(EngineError, match="unauthenticated"):
            c.status()
    _serving(blocks_engine)


def test_oversized_request_is_refused_before_it_is_read(blocks_engine):
    # announces 2 GiB and sends none of it: refused on the header alone
    reply = _raw(blocks_engine, struct.pack(">I", 2**31))
    assert reply["ok"] is False and "exceeds the limit" in reply["error"]["message"]
    # a real over-limit body from a client with the right token
    with blocks_engine.client() as c:
        with pytest.raises(EngineError, match="exceeds the limit"):
            c.call("status", padding="x" * (protocol.MAX_REQUEST_BYTES + 10))
    _serving(blocks_engine)


@pytest.mark.parametrize("payload,words", [
    (b"\x00\x00\x00\x05hello", "not UTF-8 JSON"),
    (b"\x00\x00\x00\x02\xff\xfe", "not UTF-8 JSON"),
    (b"\x00\x00\x00\x02[]", "expected a JSON object"),
])
def test_malformed_frames_get_clear_errors(blocks_engine, payload, words):
    reply = _raw(blocks_engine, payload)
    assert reply["ok"] is False and words in reply["error"]["message"]
    _serving(blocks_engine)


def test_truncated_frame_does_not_hurt_the_server(blocks_engine):
    _raw(blocks_engine, b"\x00\x00\x01\x00{\"tok", read=False)  # promises 256 bytes, sends 6, hangs up
    _serving(blocks_engine)


@pytest.mark.parametrize("method,params,words", [
    ("launch_missiles", {}, "unknown method 'launch_missiles'"),
    ("status", {"verbose": True}, "unknown parameter(s) ['verbose']"),
    ("swap", {}, "missing parameter(s) ['candidate']"),
    ("experiment", {"candidate": "plan.json"}, "expected an object"),
    ("experiment", {"candidate": {"plan": [], "source": "x.py"}}, "exactly one of"),
    ("experiment", {"candidate": {"source": "/nonexistent.py", "sha256": "0" * 64}}, "does not exist"),
    ("experiment", {"candidate": {"source": __file__}}, "'sha256' (64 hex digits of the file) is required"),
    ("experiment", {"candidate": {"plan": [{"name": "no-such-pass"}]}}, "unknown pass 'no-such-pass'"),
    ("experiment", {"candidate": {"baseline": True}, "workload": {"buckets": []}}, "non-empty list 'buckets'"),
    ("swap", {"candidate": "never-loaded", "tier": "slow"}, "no candidate 'never-loaded' is loaded"),
    ("revert", {"tier": "fast"}, "nothing to revert"),
    ("generate", {"prompt": "hello"}, "list of token ids"),
])
def test_malformed_requests_get_clear_errors(blocks_engine, method, params, words):
    with blocks_engine.client() as c:
        try:
            res = c.call(method, **params)
        except EngineError as e:
            msg = str(e)
        else:
            assert isinstance(res, dict) and res.get("ok") is False, res
            msg = res["reason"]
        assert words in msg, msg
        assert c.ping()["pong"]


def test_source_whose_bytes_do_not_match_the_hash_is_not_run(blocks_engine, tmp_path):
    marker = tmp_path / "ran"
    path = blocks_engine.source("tampered", f"open({str(marker)!r}, 'w').write('x')\ndef build(p): return {{}}\n")
    with blocks_engine.client() as c:
        res = c.experiment({"source": path, "sha256": "a" * 64}, tiers="fast", reps=3)
    assert not res["ok"] and "does not match the expected" in res["reason"]
    assert not marker.exists()


def test_source_over_the_size_limit_is_refused(blocks_engine, tmp_path):
    path = tmp_path / "big.py"
    path.write_text("# " + "x" * (2 << 20) + "\n")  # the fixture's engine takes at most 1 MiB
    with blocks_engine.client() as c:
        res = c.experiment({"source": str(path)}, tiers="fast", reps=3)
    assert not res["ok"] and "over the engine's limit" in res["reason"]


def test_remote_bind_needs_the_flag(tmp_path):
    from tkcc.runtime.server import EngineServer

    with pytest.raises(EngineError, match="--allow-remote"):
        EngineServer(supervisor=None, token="t", host="0.0.0.0", port=0)


def test_tcp_loopback_server_with_token(tmp_path):
    """The TCP listener (no worker needed for ping): token checked, shutdown over RPC stops it."""
    import threading

    from engine_helpers import BLOCKS_MODEL
    from tkcc.runtime import EngineClient
    from tkcc.runtime.journal import Journal
    from tkcc.runtime.server import EngineServer
    from tkcc.runtime.supervisor import Supervisor

    sup = Supervisor({"model": BLOCKS_MODEL, "device": "cpu"}, Journal(str(tmp_path / "j.jsonl")))
    server = EngineServer(sup, "s3cret", host="127.0.0.1", port=0)
    port = server.address["port"]
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    with EngineClient(host="127.0.0.1", port=port, token="s3cret") as c:
        assert c.ping()["pong"]
    with EngineClient(host="127.0.0.1", port=port, token="wrong") as c:
        with pytest.raises(EngineError, match="unauthenticated"):
            c.ping()
    with EngineClient(host="127.0.0.1", port=port, token="s3cret") as c:
        assert c.shutdown()["stopping"]
    t.join(30)
    assert not t.is_alive()


@pytest.mark.parametrize("argv,words", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--model", "olmoe-tiny", "--device", "cuda:7"], "cuda:7"),
    (["--model", "olmoe-tiny", "--device", "npu"], "not a valid torch device"),
    (["--model", "olmoe-tiny", "--host", "0.0.0.0", "--port", "0"], "--allow-remote"),
    (["--model", "olmoe-tiny", "--port", "5000"], "--port needs --host"),
    (["--model", "/nonexistent/factory.py:make"], "does not exist"),
])
def test_serve_refuses_bad_arguments_before_starting(tmp_path, capsys, argv, words):
    from tkcc.cli import main

    rc = main(["serve", *argv, "--socket", str(tmp_path / "e.sock"), "--json"])
    out = capsys.readouterr()
    assert rc == 2 and words in out.err
    assert json.loads(out.out.strip().splitlines()[-1])["type"] == "EngineError"
    assert not (tmp_path / "e.sock").exists()


def test_cli_submit_status_results_revert(blocks_engine, capsys, tmp_path):
    from tkcc.cli import main

    sock = ["--socket", blocks_engine.socket]
    src = blocks_engine.source("cli_good", "def build(program):\n    return {'forward': program.graphs['forward']}\n")
    assert main(["submit", "--source", src, "--tier", "fast", "--reps", "5", "--keep", "--request-id", "cli-1",
                 "--json", *sock]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] and res["tiers"]["fast"]["measurement"]["buckets"][0]["reps"] == 5
    assert main(["engine", "status", "--json", *sock]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["worker"]["tiers"]["fast"]["current"] == res["candidate"]
    assert main(["engine", "results", "--request-id", "cli-1", "--json", *sock]) == 0
    recs = json.loads(capsys.readouterr().out)["records"]
    assert [r["kind"] for r in recs] == ["accepted", "experiment"]
    assert main(["engine", "revert", "--tier", "fast", *sock]) == 0
    assert "now serving baseline" in capsys.readouterr().out
    # a bad plan file: clear error, exit code 2
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    assert main(["submit", "--plan", str(bad), *sock]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    # no engine at that socket
    assert main(["engine", "status", "--socket", str(tmp_path / "none.sock")]) == 2
    assert "cannot read the engine token" in capsys.readouterr().err
