"""`specdeploy serve` as a process: binds 127.0.0.1, answers, checks the key, stops on SIGINT."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest


def test_serve_rejects_bad_flags_before_loading(capsys):
    from specdeploy.cli import main

    assert main(["serve", "--max-queue", "-1"]) == 2
    assert "max-queue" in capsys.readouterr().err


def test_serve_process_end_to_end(tiny_llama_dir, tmp_path):
    import socket

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
        deadline = time.monotonic() + 90
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
