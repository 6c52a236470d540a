"""`tkcc serve --http` as a user starts it: a subprocess, its ready line, a request, SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import openai
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tkcc(*args, **kw):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tkcc.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=kw.get("cwd"))


def _ready_line(proc, timeout_s=120.0) -> dict:
    out = {}
    t = threading.Thread(target=lambda: out.update(line=proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    line = out.get("line") or ""
    if not line:
        proc.kill()
        pytest.fail(f"no ready line: {proc.stderr.read()[-3000:]}")
    return json.loads(line)


def test_serve_http_starts_answers_and_stops(tmp_path):
    proc = _tkcc("serve", "--http", "127.0.0.1:0", "--model", "llama-tiny", "--max-cache-len", "128", "--json",
                 "--trace-out", str(tmp_path / "traffic"), "--max-queue", "2", cwd=tmp_path)
    try:
        ready = _ready_line(proc)
        assert ready["ready"] and ready["model"] == "llama-tiny" and ready["url"].startswith("http://127.0.0.1:")
        c = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="llama-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage.completion_tokens == 4 and r.system_fingerprint == f"tkcc-{ready['forward']}"
        assert oct(os.stat(ready["admin_token_file"]).st_mode & 0o777) == "0o600"
        from tkcc.serve.swap import AdminClient

        status = AdminClient(ready["url"], token_file=ready["admin_token_file"]).status()
        assert status["served"] == 1 and status["trace"] == ready["trace"]
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        from tkcc.traffic.loaders import load_trace

        tr = load_trace(ready["trace"])
        assert tr.output_tokens.tolist() == [4] and tr.meta["model"] == "llama-tiny"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()


def test_serve_http_refuses_a_public_address_without_allow_remote():
    proc = _tkcc("serve", "--http", "0.0.0.0:8000", "--model", "llama-tiny")
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and "--allow-remote" in err
