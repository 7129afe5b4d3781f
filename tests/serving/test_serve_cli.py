"""`specdeploy serve`: flags → LLM → app → uvicorn on 127.0.0.1 (in process, with `shutdown.run`
swapped for a thread we control); the real process with SIGINT is opt-in (slow to import)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from specdeploy.cli import main


def test_serve_rejects_bad_flags_before_loading(capsys):
    assert main(["serve", "--max-queue", "-1"]) == 2
    assert "max-queue" in capsys.readouterr().err
    assert main(["serve", "--spec", "mtp", "--num-draft-tokens", "0"]) == 2
    assert "num_draft_tokens" in capsys.readouterr().err


def test_serve_fails_at_once_on_a_port_in_use(capsys):
    """The listening address is bound before the model loads (a model path that does not exist
    is never read): a busy port is the one error, by name; and nothing the server starts while
    loading (tensor-parallel ranks' rendezvous ports) can take its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--model", "/nonexistent/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port: cannot listen on 127.0.0.1:{port}" in err and "nonexistent" not in err


def test_serve_command(tiny_llama_dir, monkeypatch, serve):
    from specdeploy.serving import shutdown

    seen = {}

    def fake_run(app, *, host, port, **kw):
        seen.update(host=host, port=port)
        with serve(app) as srv:  # NOTE: on a free port, not the (fixed) one asked for
            body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
            assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30,
                           headers={"Authorization": "Bearer sekret"})
            assert r.status_code == 200, r.text
            seen.update(usage=r.json()["usage"], model=r.json()["model"])

    monkeypatch.setattr(shutdown, "run", fake_run)
    assert main(["serve", "--model", str(tiny_llama_dir), "--backend", "eager", "--max-seq-len",
                 "64", "--max-batch-size", "2", "--api-key", "sekret", "--served-model-name",
                 "tiny", "--port", "8123"]) == 0
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8123
    assert seen["model"] == "tiny" and seen["usage"]["completion_tokens"] == 3


@pytest.mark.skipif(not os.environ.get("SPECDEPLOY_SERVE_PROCESS"),
                    reason="slow: a fresh process imports torch (15-70 s on a busy machine)")
def test_serve_process_end_to_end(tiny_llama_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specdeploy.cli", "serve", "--model", str(tiny_llama_dir),
           "--backend", "eager", "--max-seq-len", "64", "--max-batch-size", "2", "--port",
           str(port), "--api-key", "sekret", "--log-level", "warning"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "server exited early"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, timeout=30,
                       headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("server did not stop on SIGINT")
        log.seek(0)
        out = log.read()
        log.close()
    assert rc == 0, out
