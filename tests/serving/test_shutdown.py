"""Graceful shutdown (serving/shutdown.py): a signal drains for at most `drain_timeout`.

The engine's forward is slowed so a long request outlasts the drain: the test measures the
exit time, sees 503 from `/health` and new requests while draining, a short request that
finishes inside the drain keep its full answer and the long one end with finish_reason abort.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from specdeploy import LLM, SamplingParams
from tests.serving.conftest import free_port

DRAIN = 1.5
STEP_S = 0.02  # per forward: a 400-token request takes ~8 s, far past the drain
SHORT = "Short prompt"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", max_batch_size=4, max_seq_len=512)


def _start(app, drain: float):
    import uvicorn

    from specdeploy.serving.shutdown import UVICORN_GRACE_S, DrainingServer

    port = free_port()
    cfg = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                         timeout_graceful_shutdown=UVICORN_GRACE_S)
    server = DrainingServer(cfg, app.state.engine_loop, drain)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def _stream(url: str, prompt: str, max_tokens: int, out: dict) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, reason = "", None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
                out["started"] = True
    out.update(text=text, reason=reason)


def test_signal_drains_then_aborts_within_drain_timeout(llm, monkeypatch):
    from specdeploy.serving.app import create_app

    short_ref = llm.generate(SHORT, SamplingParams(max_tokens=20, ignore_eos=True))[0]
    real = llm.deployed.forward

    def slow(meta):
        time.sleep(STEP_S)
        return real(meta)

    monkeypatch.setattr(llm.deployed, "forward", slow)
    app = create_app(llm, drain_timeout=DRAIN)
    server, thread, url = _start(app, DRAIN)
    long_out: dict = {}
    long_t = threading.Thread(target=_stream, args=(url, "A long one", 400, long_out))
    long_t.start()
    deadline = time.monotonic() + 30
    while not long_out.get("started"):
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.02)
    short_out: dict = {}
    short_t = threading.Thread(target=_stream, args=(url, SHORT, 20, short_out))
    short_t.start()
    while not short_out.get("started"):
        assert time.monotonic() < deadline, "the short request never started"
        time.sleep(0.02)

    t0 = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
    h = httpx.get(url + "/health", timeout=5)
    assert h.status_code == 503 and h.json() == {"status": "draining"}
    r = httpx.post(url + "/v1/completions", json={"prompt": "new", "max_tokens": 2}, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    thread.join(DRAIN + 10)
    exit_s = time.monotonic() - t0
    assert not thread.is_alive(), "server did not exit"
    long_t.join(5)
    short_t.join(5)
    print(f"exit {exit_s:.2f} s after the signal (drain_timeout {DRAIN} s)")
    assert DRAIN - 0.2 <= exit_s <= DRAIN + 3.0, exit_s  # waited the drain, not much longer
    assert short_out["reason"] == "length" and short_out["text"] == short_ref.text
    assert long_out["reason"] == "abort" and long_out["text"]


def test_idle_server_exits_at_once(llm):
    from specdeploy.serving.app import create_app

    app = create_app(llm, drain_timeout=30)
    server, thread, url = _start(app, 30)
    assert httpx.get(url + "/health").status_code == 200
    t0 = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - t0 < 3.0


@pytest.mark.skipif(not os.environ.get("SPECDEPLOY_SERVE_PROCESS"),
                    reason="slow: a fresh process imports torch (15-70 s on a busy machine)")
def test_sigterm_process_exit_time(tiny_llama_dir, tmp_path):
    """The real signal on the real command: in-flight streams past --drain-timeout are
    aborted and the process exits 0 within the drain timeout plus a few seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    drain = 2.0
    cmd = [sys.executable, "-m", "specdeploy.cli", "serve", "--model", str(tiny_llama_dir),
           "--backend", "eager", "--max-seq-len", "4096", "--max-batch-size", "8", "--port",
           str(port), "--drain-timeout", str(drain), "--log-level", "warning"]
    log = open(tmp_path / "serve.log", "w+")
    # NOTE: streams longer than the tiny model's 512 positions, to be cut by the drain
    env = {**os.environ, "SPECDEPLOY_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
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
        outs = [{} for _ in range(8)]
        threads = [threading.Thread(target=_stream, args=(url, f"p{i}", 4000, o), daemon=True)
                   for i, o in enumerate(outs)]
        for t in threads:
            t.start()
        while not all(o.get("started") for o in outs):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert httpx.get(url + "/health", timeout=5).status_code == 503
        rc = proc.wait(drain + 15)
        exit_s = time.monotonic() - t0
        for t in threads:
            t.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.seek(0)
        out = log.read()
        log.close()
    print(f"process exit {exit_s:.2f} s after SIGTERM (--drain-timeout {drain}),",
          [o.get("reason") for o in outs])
    assert rc == 0, out
    assert drain - 0.2 <= exit_s <= drain + 5, exit_s
    assert all(o["reason"] in ("abort", "length") for o in outs), outs
