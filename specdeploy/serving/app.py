"""The FastAPI app: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/v1/responses`,
`/tokenize`, `/detokenize`, `/version`, `/health`, `/metrics`. `create_app(llm)` serves an `LLM`
(its engine then belongs to the app's engine thread: do not call `llm.generate` while the app
runs)."""
from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdeploy.serving import protocol as P
from specdeploy.serving import responses as R
from specdeploy.serving import responses_api as RA
from specdeploy.serving import responses_stream as RS
from specdeploy.serving import tokenize as T
from specdeploy.serving.body import parse_json
from specdeploy.serving.chat import parse_chat
from specdeploy.serving.engine_loop import EngineLoop
from specdeploy.serving.metrics import CONTENT_TYPE, ServerMetrics
from specdeploy.serving.reasoning import PARSERS
from specdeploy.serving.replies import collect, stream
from specdeploy.serving.responses_store import ResponseStore
from specdeploy.serving.tools import PARSERS as TOOL_PARSERS
from specdeploy.version import version

MAX_BODY_BYTES = 16 * 2**20
MAX_HEADER_BYTES = 16 * 2**10  # as h11's default limit on an incomplete request head
log = logging.getLogger("specdeploy.serving")
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses",
             "/tokenize", "/detokenize", "/version", "/health", "/metrics")


def default_model_name(llm) -> str:
    p = Path(llm.model_path)
    return p.stem if p.suffix == ".gguf" else p.name


def max_token_chars(tokenizer) -> int | None:
    """The longest vocabulary entry in characters (byte-level / sentencepiece entries spell at
    least as many characters as they cover); None when the tokenizer does not say."""
    backend = getattr(tokenizer, "backend", None)
    try:
        vocab = backend.get_vocab(with_added_tokens=True)
    except Exception:  # not a `tokenizers.Tokenizer`: no cheap bound, tokenize and check
        return None
    return max(16, max((len(t) for t in vocab), default=0))


def create_app(llm, *, model_name: str | None = None, api_key: str | None = None,
               max_queue: int = 256, drain_timeout: float = 30.0,
               max_body_bytes: int = MAX_BODY_BYTES,
               stats_log_interval: float | None = None,
               reasoning_parser: str | None = None, enable_auto_tool_choice: bool = False,
               tool_call_parser: str | None = None,
               return_tokens_as_token_ids: bool = False, responses_store: int = 0) -> FastAPI:
    """Args:
        model_name: the id clients pass as `model` (default: the checkpoint's name).
        api_key: when set, `/v1/*` needs `Authorization: Bearer <api_key>` (else 401).
        max_queue: requests that may wait for a place in the batch beyond it (else 429).
        drain_timeout: seconds shutdown waits for in-flight requests before aborting them.
        max_body_bytes: larger request bodies get 413, however they are sent (chunked too).
        stats_log_interval: seconds between speculative-decoding log lines (None: none).
        reasoning_parser: "deepseek_r1", "qwen3", "nemotron_v3", "glm45" or "openai_gptoss"
            (vLLM's `--reasoning-parser`): a chat reply's thinking goes to `reasoning` /
            `reasoning_content` (serving/reasoning.py).
        enable_auto_tool_choice, tool_call_parser: vLLM's flags; with both (parser "hermes")
            `tool_choice: "auto"` parses calls out of replies (serving/tools.py).
        return_tokens_as_token_ids: the default of the request field of that name (vLLM's
            flag): logprobs name tokens "token_id:<id>" (serving/token_fields.py).
        responses_store: /v1/responses kept in memory (the last N; 0: none), for
            `GET /v1/responses/{id}` and `previous_response_id` (serving/responses_store.py).
    """
    if reasoning_parser is not None and reasoning_parser not in PARSERS:
        raise ValueError(f"reasoning_parser: must be one of {', '.join(PARSERS)}, got "
                         f"{reasoning_parser!r}")
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: must be one of {', '.join(TOOL_PARSERS)}, got "
                         f"{tool_call_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice: needs a tool_call_parser")
    if max_queue < 0:
        raise ValueError(f"max_queue: must be >= 0, got {max_queue}")
    engine = llm.engine
    blocks = engine.blocks
    tokenizer = llm.tokenizer
    limits = P.Limits(
        model_name=model_name or default_model_name(llm), max_seq_len=engine.max_seq_len,
        kv_capacity=blocks.num_pages * blocks.page_size - engine.scheduler.lookahead,
        vocab_size=engine.deployed.vocab_size, max_token_chars=max_token_chars(tokenizer),
        vision=engine.deployed if hasattr(engine.deployed, "image_features") else None,
        grammar=lambda key: engine.grammar_compiler().compile_key(key),
        sampling_defaults=dict(getattr(llm, "sampling_defaults", {}) or {}),
        reasoning_parser=reasoning_parser,
        tool_parser=tool_call_parser if enable_auto_tool_choice else None,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        priority_scheduling=engine.scheduler.policy == "priority")
    metrics = ServerMetrics(limits.model_name)
    store = ResponseStore(responses_store) if responses_store else None
    loop = EngineLoop(engine, metrics, max_batch_size=engine.scheduler.max_batch_size,
                      max_queue=max_queue)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        stats = None
        if stats_log_interval:
            from specdeploy.serving.stats_log import run_periodically

            stats = asyncio.ensure_future(run_periodically(lambda: loop.snapshot,
                                                           stats_log_interval))
        yield
        if stats is not None:
            stats.cancel()
        # NOTE: a server that drained already (serving/shutdown.py) left nothing to wait for
        await asyncio.to_thread(loop.shutdown, drain_timeout if loop.accepting else 0.0)

    app = FastAPI(title="specdeploy", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine_loop = loop
    app.state.limits = limits
    app.state.drain_timeout = drain_timeout
    app.add_middleware(_Guard)
    app.add_middleware(_CountResponses, metrics=metrics)

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(P.APIError(e.status_code, str(e.detail)).body(),
                            status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(P.bad(None, str(e)).body(), status_code=400)

    def auth(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 api_key.encode()):
            raise P.APIError(401, "Incorrect or missing API key (send `Authorization: Bearer "
                             "<key>`)", None, "invalid_api_key")

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if not loop.accepting:  # a load balancer must stop sending work while we drain
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(loop.snapshot, loop.queue_length()),
                        media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        auth(request)
        return {"object": "list", "data": [{
            "id": limits.model_name, "object": "model", "created": 0, "owned_by": "specdeploy",
            "max_model_len": limits.max_seq_len}]}

    @app.get("/version")
    async def version_route():
        return {"version": version()}

    async def tokenizer_call(request: Request, fn):
        auth(request)
        raw = await _read_body(request, max_body_bytes)
        return await asyncio.to_thread(lambda: fn(parse_json(raw), tokenizer, limits))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenizer_call(request, T.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokenizer_call(request, T.detokenize)

    async def generate(request: Request, parse, responses: bool = False):
        auth(request)
        if not loop.accepting:  # before reading the body: nothing will run it
            raise P.APIError(503, "the server is shutting down", None, "shutting_down")
        raw = await _read_body(request, max_body_bytes)
        # NOTE: off the event loop: walking a big body and tokenizing a long prompt must not
        # stall other streams
        body = await asyncio.to_thread(parse_json, raw)
        req = await asyncio.to_thread(lambda: parse(body, tokenizer, limits))
        handle = loop.submit(req.prompts, req.params, req.mm, req.priority)
        try:
            await handle.accepted()
        except BaseException:
            loop.abort(handle)
            raise
        on_close = lambda: None if handle.done else loop.abort(handle)  # noqa: E731
        if responses:  # /v1/responses: its own shapes (responses_api.py)
            ids = RA.new_ids()
            if req.stream:
                return _SSEResponse(RS.stream(req, body, handle, ids, store), on_close=on_close)
            return await collect(request, req, handle, ids["resp"], ids["created"], loop,
                                 render=RS.render(body, ids, store))
        rid, created = R.new_id(req.chat), R.now()
        if req.stream:
            return _SSEResponse(stream(req, handle, rid, created), on_close=on_close)
        return await collect(request, req, handle, rid, created, loop)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, P.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, parse_chat)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await generate(request, lambda b, t, lim: RA.parse_responses(b, t, lim, store),
                              responses=True)

    @app.get("/v1/responses/{rid}")
    async def stored_response(request: Request, rid: str):
        auth(request)
        found = store.get(rid) if store is not None else None
        if found is None:
            raise P.APIError(404, f"response {rid!r} not found" + (
                "" if store is not None else " (this server stores none: serve "
                "--responses-store N)"), None, "not_found")
        return found[0]

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes `limit`, whatever Content-Length says: a
    chunked body has none, and a lying one must not make us read more."""
    size = request.headers.get("content-length", "0")
    if not size.isdigit() or int(size) > limit:
        raise _too_large(limit) if size.isdigit() else P.bad(None, "invalid Content-Length")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> P.APIError:
    return P.APIError(413, f"request body over {limit} bytes", None, "request_too_large")


class _SSEResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the stream ends (finished, client gone,
    cancelled), so an abandoned request is always aborted and its pages freed."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Guard:
    """Pure ASGI middleware: an unexpected exception becomes a 500 for that request alone.

    Starlette's own handler re-raises after answering, which makes uvicorn drop the keep-alive
    connection; here the exception stops, so the connection stays usable. A 413 (unread body
    left on the wire) closes the connection cleanly instead of desyncing it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(k) + len(v) for k, v in scope.get("headers", ())) > MAX_HEADER_BYTES:
            # NOTE: h11 refuses such headers only when they arrive in pieces (its limit is on
            # unparsed bytes); one large read would pass. Refuse them the same way always.
            err = P.APIError(400, f"request headers over {MAX_HEADER_BYTES} bytes", None,
                             "request_header_fields_too_large")
            resp = JSONResponse(err.body(), status_code=400, headers={"connection": "close"})
            return await resp(scope, receive, send)
        started = False

        async def guarded_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] == 413:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except ClientDisconnect:  # gone while we read its body: nobody to answer
            return
        except Exception as e:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:  # mid-stream: nothing valid can follow; the server closes it
                raise
            body = JSONResponse(P.APIError(500, f"internal server error: {type(e).__name__}")
                                .body(), status_code=500)
            await body(scope, receive, guarded_send)


class _CountResponses:
    """Pure ASGI middleware counting responses by endpoint and status (does not buffer
    streams, unlike `BaseHTTPMiddleware`)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_response(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
