"""One thread owns the engine; every HTTP request talks to it through commands and queues.

The engine is not thread-safe and a step blocks for a whole forward, so it runs on its own thread:
handlers append commands (add / abort) to a deque and wake the thread; between steps the thread
applies them, so requests from all connections join the same continuous batch. Each step's outputs
are routed to the asyncio queue of the HTTP request that owns them (`call_soon_threadsafe`).

Admission is decided on the event loop (not the engine thread) so a full server answers 429 at
once: at most `max_batch_size + max_queue` engine requests are in flight, i.e. `max_queue` may wait
for a place in the batch.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field

from specdeploy.engine import RequestOutput, SamplingParams
from specdeploy.serving.metrics import ServerMetrics
from specdeploy.serving.protocol import APIError

log = logging.getLogger("specdeploy.serving")


@dataclass
class Event:
    """What a handler receives: the output of prompt `index`, an acceptance, or an error."""

    index: int
    output: RequestOutput | None = None
    error: str | None = None
    status: int = 500


@dataclass
class Handle:
    """One HTTP request: its engine request ids (one per prompt) and its event queue."""

    ids: list[str]
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    finished: int = 0  # engine requests done (engine thread only)

    async def accepted(self) -> None:
        """Wait until the engine took the request; an engine-side rejection becomes a 400."""
        ev = await self.queue.get()
        if ev.error is not None and ev.status == 400:  # engine messages start with the field
            param = ev.error.split(":", 1)[0] if ":" in ev.error else None
            raise APIError(400, ev.error, param, "invalid_value")
        if ev.error is not None:
            raise APIError(500, ev.error)

    @property
    def done(self) -> bool:
        return self.finished == len(self.ids)


@dataclass
class _Route:
    handle: Handle
    index: int
    seen_tokens: int = 0


class EngineLoop:
    def __init__(self, engine, metrics: ServerMetrics, *, max_batch_size: int, max_queue: int):
        self.engine = engine
        self.metrics = metrics
        self.capacity = max_batch_size + max_queue
        self._cmds: deque[tuple] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._inflight = 0  # admitted engine requests not finished yet
        self._routes: dict[str, _Route] = {}  # engine thread only
        self._stop = False
        self._thread: threading.Thread | None = None
        self.accepting = True
        self.failures = 0
        self.snapshot = engine.stats_dict()

    # ---- event-loop side ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specdeploy-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def inflight(self) -> int:
        return self._inflight

    def queue_length(self) -> int:
        return max(0, self._inflight - self.snapshot.get("num_running", 0))

    def submit(self, prompts: list[list[int]], params: list[SamplingParams],
               mm: list | None = None, priority: int = 0) -> Handle:
        """Admit a request (429 when full, 503 when shutting down); call on the event loop."""
        if not self.accepting or not self.alive:
            raise APIError(503, "the server is shutting down", None, "shutting_down",
                           "server_error")
        with self._lock:
            if self._inflight + len(prompts) > self.capacity:
                raise APIError(429, f"the server is at capacity ({self._inflight} requests in "
                               "flight); retry later", None, "rate_limit_exceeded")
            self._inflight += len(prompts)
        handle = Handle([uuid.uuid4().hex for _ in prompts], asyncio.Queue(),
                        asyncio.get_running_loop())
        self._command("add", handle, prompts, params, mm or [None] * len(prompts), priority)
        return handle

    def abort(self, handle: Handle) -> None:
        """Abort what is still running of `handle` (idempotent; pages are freed by the engine)."""
        self._command("abort", handle)

    def abort_all(self) -> None:
        """Abort every request in flight (the end of a drain); each gets finish_reason abort."""
        self._command("abort_all", None)

    def _command(self, *cmd) -> None:
        self._cmds.append(cmd)
        self._wake.set()

    def shutdown(self, drain_timeout: float = 30.0) -> bool:
        """Stop admitting, let in-flight requests finish (up to `drain_timeout` s), abort the
        rest and stop the thread. Returns whether everything drained. Blocking."""
        self.accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._inflight and self.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        drained = self._inflight == 0
        if not drained:
            log.warning("shutdown: aborting %d requests still in flight", self._inflight)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        return drained

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            try:
                self._apply_commands()
                if self._stop:
                    self._abort_all()
                if eng.has_unfinished():
                    self._dispatch(eng.step())
                    self.snapshot = eng.stats_dict()
                    continue
            except Exception:  # keep serving: fail what was in flight, not the server
                self._fail_all(traceback.format_exc())
                continue
            self.snapshot = eng.stats_dict()
            if self._stop:
                return
            self._wake.wait(timeout=1.0)
            self._wake.clear()  # NOTE: before the next `_apply_commands`, so no wake-up is lost

    def _apply_commands(self) -> None:
        while self._cmds:
            kind, handle, *args = self._cmds.popleft()
            if kind == "add":
                self._add(handle, *args)
            elif kind == "abort_all":
                self._abort_all()
            else:
                for rid in handle.ids:
                    if rid in self._routes:
                        self.engine.abort(rid)

    def _add(self, handle: Handle, prompts, params, mm, priority: int) -> None:
        added = []
        try:
            for i, (rid, p, sp, m) in enumerate(zip(handle.ids, prompts, params, mm)):
                self.engine.add_request(p, sp, rid, mm=m, priority=priority)
                self._routes[rid] = _Route(handle, i)
                added.append(rid)
                self.metrics.request_added(len(p))
        except Exception as e:  # all or nothing (protocol.py should have caught a ValueError)
            for rid in added:
                self.engine.abort(rid)
            with self._lock:
                self._inflight -= len(handle.ids) - len(added)
            bad_input = isinstance(e, ValueError)
            self._push(handle, Event(-1, error=str(e) if bad_input else "internal engine error",
                                     status=400 if bad_input else 500))
            return
        self._push(handle, Event(-1))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            times = out.metrics.token_times
            n_new = len(times) - route.seen_tokens
            if n_new > 0:
                first = route.seen_tokens == 0
                start = max(route.seen_tokens - 1, 0)
                itls = [b - a for a, b in zip(times[start:], times[start + 1:])]
                ttft = out.metrics.first_token_time - route.handle.arrival if first else None
                self.metrics.tokens(n_new, ttft, itls)
                route.seen_tokens = len(times)
            # NOTE: "error" is this request's failure alone (engine.fail); the others go on
            err = f"request failed: {out.error}" if out.finish_reason == "error" else None
            self._push(route.handle, Event(route.index, out, error=err))
            if out.finished:
                del self._routes[out.request_id]
                route.handle.finished += 1
                with self._lock:
                    self._inflight -= 1
                self.metrics.request_finished(out.finish_reason, now - route.handle.arrival)

    def _push(self, handle: Handle, ev: Event) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, ev)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass

    def _abort_all(self) -> None:
        for rid in list(self._routes):
            self.engine.abort(rid)

    def _fail_all(self, tb: str) -> None:
        self.failures += 1
        log.error("engine step failed; failing %d requests:\n%s", len(self._routes), tb)
        for rid, route in list(self._routes.items()):
            self.engine.abort(rid)
            self._push(route.handle, Event(route.index, error="internal engine error"))
            del self._routes[rid]
            with self._lock:
                self._inflight -= 1
        time.sleep(0.05)  # NOTE: a step that keeps failing must not spin the CPU
