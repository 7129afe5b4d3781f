"""Graceful shutdown: SIGTERM / SIGINT drains for at most `drain_timeout` seconds, then exits.

uvicorn's own shutdown closes the listening socket first (new clients get "connection refused"
instead of a 503) and then waits for open connections without a bound. Here the first signal
only starts a drain: the engine loop stops admitting (`/health` and new requests answer 503), the
requests in flight run on until they finish or `drain_timeout` passes, the rest are aborted
(finish_reason "abort", so a stream ends with a final chunk), and only then is uvicorn told to
exit, with a short bound on its own wait. A second signal exits at once.
"""
from __future__ import annotations

import logging
import signal
import socket
import time

import uvicorn

log = logging.getLogger("specdeploy.serving")
ABORT_GRACE_S = 2.0  # after aborting: for the final chunks to reach their clients
UVICORN_GRACE_S = 2.0  # uvicorn's wait for connections once we asked it to exit


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_loop, drain_timeout: float):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.drain_timeout = drain_timeout
        self.drain_started: float | None = None  # time.monotonic() of the first signal
        self._aborted_at: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_started is not None:  # second signal: stop waiting
            log.warning("second signal: exiting without waiting for the drain")
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        log.info("draining: %d requests in flight, at most %.1f s",
                 self.engine_loop.inflight, self.drain_timeout)
        self.engine_loop.accepting = False
        self.drain_started = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            self._drain_step(time.monotonic())
        return await super().on_tick(counter)

    def _drain_step(self, now: float) -> None:
        loop = self.engine_loop
        if loop.inflight == 0 or (self._aborted_at is not None
                                  and now - self._aborted_at > ABORT_GRACE_S):
            self.should_exit = True
        elif self._aborted_at is None and now - self.drain_started >= self.drain_timeout:
            log.warning("drain timeout: aborting %d requests still in flight", loop.inflight)
            loop.abort_all()
            self._aborted_at = now


def bind(host: str, port: int) -> socket.socket:
    """The server's listening address, bound before the model loads (as vLLM does): nothing
    this process starts meanwhile (tensor-parallel ranks' rendezvous and gloo ports, which the
    OS picks among free ones) can take it, and a port in use fails at once, by name. Listening
    starts when uvicorn serves; until then a client's connection is refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"port: cannot listen on {host}:{port} ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock


def run(app, *, host: str, port: int, log_level: str = "info",
        sock: socket.socket | None = None) -> None:
    """Serve `app` (from `create_app`) until a signal, then drain as above; on `sock` (from
    `bind`) when given."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=UVICORN_GRACE_S)
    DrainingServer(config, app.state.engine_loop, app.state.drain_timeout).run(
        sockets=None if sock is None else [sock])
