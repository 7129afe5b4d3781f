"""A uvicorn server on 127.0.0.1 (free port, own thread) around an app, and small HTTP helpers."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest

KEY = "test-key"  # NOTE: tests/serving/test_*.py use the same literal


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, app):
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not stop"

    def client(self, key: str | None = KEY, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0,
                             timeout=kw.pop("timeout", 60), **kw)

    def metrics(self) -> dict[str, float]:
        from specdeploy.serving.metrics import parse_text

        r = httpx.get(self.url + "/metrics", timeout=10)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        return parse_text(r.text)

    def wait_idle(self, timeout: float = 20) -> dict[str, float]:
        """Poll /metrics until nothing runs, waits or holds a page (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["specdeploy_cache_pages_in_use"] == 0 and m["specdeploy_num_requests_running"]
                    == 0 and m["specdeploy_num_requests_waiting"] == 0):
                return m
            assert time.monotonic() < deadline, f"server not idle: {m}"
            time.sleep(0.05)


@contextlib.contextmanager
def running(app):
    srv = RunningServer(app).start()
    try:
        yield srv
    finally:
        if srv.thread.is_alive():
            srv.stop()


@pytest.fixture(scope="session")
def serve():
    """`with serve(app) as srv:` runs `app` on 127.0.0.1 for the block (a `RunningServer`)."""
    return running


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from specdeploy.models.registry import family_module

    return family_module("llama").make_tiny(tmp_path_factory.mktemp("serve_llama") / "ckpt",
                                            seed=0)
