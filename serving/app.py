"""The ASGI application of ``kvlayer serve``: routes, API keys, the body limit, errors.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (these
three need the API key when keys are set), ``GET /health`` (200 while the engine loop runs,
503 otherwise) and ``GET /metrics`` (Prometheus text). Every error is OpenAI's error JSON
with a one-line message: bad JSON or fields 400, a missing or wrong key 401, an unknown model
or route 404, a body over ``max_body_bytes`` 413, a full queue or a draining server 503, an
engine failure 500 (the traceback goes to the log, never to the client). The body limit, the
key check, the JSON checks and the error handlers are serving/http.py's, shared with the
router. A large body is decoded and validated on a worker thread, and a prompt tokenized on
one (serving/completions.py), so the event loop answers ``/health`` meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvlayer.serving.completions import ServerState, chat_completions, completions
from kvlayer.serving.http import (
    DEFAULT_MAX_BODY_BYTES,
    OFF_LOOP_BYTES,
    BodyLimit,
    check_api_key,
    decode_object,
    install_error_handlers,
)
from kvlayer.serving.metrics import CONTENT_TYPE
from kvlayer.serving.protocol import (
    MAX_MODEL_LEN,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_message,
)


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
        return await completions(state, await _parse(request, CompletionRequest, state.max_model_len), request)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Response:
        authorize(request)
        return await chat_completions(state, await _parse(request, ChatCompletionRequest, state.max_model_len),
                                      request)

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


async def _parse(request: Request, model: type[BaseModel], max_model_len: int) -> Any:
    raw = await request.body()
    if len(raw) < OFF_LOOP_BYTES:
        return _validated(raw, model, max_model_len, yielding=False)
    return await asyncio.to_thread(_validated, raw, model, max_model_len, True)


def _validated(raw: bytes, model: type[BaseModel], max_model_len: int, yielding: bool) -> Any:
    data = decode_object(raw, yielding)
    try:
        return model.model_validate(data, context={MAX_MODEL_LEN: max_model_len})
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise APIError(400, message, param) from None
