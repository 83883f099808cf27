"""The FastAPI app: OpenAI-compatible routes, /health, /metrics, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import InvalidRequestError
from specdec.server.engine_loop import EngineLoop, EngineUnavailable, InThread
from specdec.server.engine_process import EngineProcess, EngineSpec, EngineStartError
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from specdec.server.request_body import parse_request
from specdec.server.serving import Serving

log = logging.getLogger("specdec.server")

MAX_BODY_BYTES = 4 << 20
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
# request fields a SamplingParams / engine message can start with, reported as the error's "param"
PARAMS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
          "logprobs": "logprobs", "seed": "seed", "stop": "stop", "prompt": "prompt", "token": "prompt"}


def create_app(engine, served_model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """An app serving `engine`: an EngineSpec (the arguments of an LLM, built and stepped in an engine process
    of its own), an EngineProcess (launched already, or not), or an LLM already built here (stepped on a thread of this process).  The engine starts with
    the app (lifespan; the app does not serve until the engine is ready) and stops with it."""
    if isinstance(engine, EngineSpec):
        engine = EngineProcess(engine)
    if isinstance(engine, EngineProcess):
        llm, transport, model_name = None, engine, served_model_name or engine.spec.model
    else:
        llm, transport = engine, InThread(engine)
        model_name = served_model_name or str(getattr(llm, "model_dir", "model"))
    engine_loop = EngineLoop(transport)
    metrics = ServerMetrics(engine_loop)
    serving = Serving(engine_loop, metrics, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await engine_loop.start()
        except EngineStartError as exc:
            log.error("%s", exc)
            raise
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.shutdown)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.llm, app.state.engine_loop, app.state.metrics = llm, engine_loop, metrics
    app.add_middleware(Gate, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    _install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(await _parsed(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat(await _parsed(request, ChatCompletionRequest), request)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            return JSONResponse(error_body("the engine is not running", "server_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _parsed(request: Request, model):
    """The body as `model`; an APIError (4xx) naming what was wrong otherwise (`request_body`)."""
    return parse_request(await request.body(), request.headers.get("content-type"), model)


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_, exc: InvalidRequestError):
        message = str(exc)
        first = message.split(" ", 1)[0]
        return _error(400, message, param=PARAMS.get(first))

    @app.exception_handler(RequestValidationError)  # routes parse their own bodies; kept for any other route
    async def validation_error(_, exc: RequestValidationError):
        errors = exc.errors()
        loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
        message = errors[0].get("msg", "invalid value") if errors else "invalid request"
        return _error(400, f"{'.'.join(loc) or 'the request'}: {message}", param=loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(EngineUnavailable)
    async def engine_unavailable(_, exc: EngineUnavailable):
        return _error(503, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        log.exception("unhandled error")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


class Gate:
    """ASGI middleware in front of every route: API key, body size limit, request count and latency."""

    def __init__(self, app, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.metrics = metrics
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        start = time.perf_counter()
        state = {"status": None, "done": False}

        def record(status: str) -> None:
            if not state["done"]:
                state["done"] = True
                self.metrics.requests.labels(endpoint, status).inc()
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record(str(state["status"]))

        try:
            if self.api_key and path.startswith("/v1") and not self._authorized(scope):
                response = _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
                return await response(scope, receive, tracked_send)
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(scope, receive)
                if body is None:
                    response = _error(413, f"the request body is larger than {self.max_body_bytes} bytes",
                                      code="request_too_large")
                    return await response(scope, receive, tracked_send)
                receive = _replay(body, receive)
            await self.app(scope, receive, tracked_send)
        finally:
            # no final byte sent: an unhandled error before the response, or the client left mid-stream
            record("499" if state["status"] is not None else "500")

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        return False

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole body, or None when it exceeds the limit (the rest is read and dropped)."""
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await _drain(receive)
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                if message.get("more_body", False):
                    await _drain(receive)
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


async def _drain(receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
