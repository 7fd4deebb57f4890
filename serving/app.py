"""The ASGI application of ``kvlayer serve``: routes, API keys, the body limit, errors.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (these
three need the API key when keys are set), ``GET /health`` (200 while the engine loop runs,
503 otherwise) and ``GET /metrics`` (Prometheus text). Every error is OpenAI's error JSON
with a one-line message: bad JSON or fields 400, a missing or wrong key 401, an unknown model
or route 404, a body over ``max_body_bytes`` 413, a full queue or a draining server 503, an
engine failure 500 (the traceback goes to the log, never to the client).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvlayer.serving.completions import ServerState, chat_completions, completions
from kvlayer.serving.metrics import CONTENT_TYPE
from kvlayer.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body, validation_message

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024**2


def build_app(state: ServerState, api_keys: Sequence[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Any:
    """The application over ``state``; it starts the engine loop on start-up and drains it on
    shutdown (``AsyncEngine.shutdown``: running requests finish, kvlayer's writes are flushed)."""
    keys = [k.encode() for k in api_keys]
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        state.engine.start()
        yield
        await state.engine.shutdown()

    app = FastAPI(title="kvlayer serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def authorize(request: Request) -> None:
        check_api_key(request, keys)

    @app.post("/v1/completions")
    async def _completions(request: Request) -> Response:
        authorize(request)
        return await completions(state, await _parse(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Response:
        authorize(request)
        return await chat_completions(state, await _parse(request, ChatCompletionRequest), request)

    @app.get("/v1/models")
    async def _models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": created, "owned_by": "kvlayer",
            "root": state.model_name, "max_model_len": state.max_model_len}]})

    @app.get("/health")
    async def _health() -> Response:
        if state.engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(503, "the engine loop is not running"), status_code=503)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(state.metrics.render(state.engine.engine), media_type=CONTENT_TYPE)

    install_error_handlers(app, "kvlayer serve")
    return BodyLimit(app, max_body_bytes)


def install_error_handlers(app: Any, name: str) -> None:
    """Every error of ``app`` as OpenAI's error JSON: ``APIError``, unknown routes and methods,
    and any other exception (500, the traceback logged under ``name``, never sent)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> Response:
        message = {404: "no such route", 405: "method not allowed on this route"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> Response:
        log.exception("%s: %s %s failed", name, request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)


def check_api_key(request: Request, keys: Sequence[bytes]) -> None:
    """``APIError`` 401 unless ``keys`` is empty or the request carries ``Authorization: Bearer
    KEY`` with one of them; every key is compared, each in constant time."""
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token.strip().encode(), key)
    if scheme.lower() != "bearer" or not ok:
        raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'")


async def json_object(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object, or ``APIError`` 400 naming what is wrong."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    return data


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    data = await json_object(request)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise APIError(400, message, param) from None


class BodyLimit:
    """Refuses (413) an HTTP request whose body is over ``limit`` bytes, by its Content-Length
    or as it arrives; the body read is replayed to the app, and later ``receive`` calls (the
    disconnect) reach the server as before."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"the body limit must be positive, got {limit}")
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _too_large(send, self.limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await _too_large(send, self.limit)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps(error_body(413, f"the request body is over the limit of {limit} bytes")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
