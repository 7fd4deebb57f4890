"""The HTTP plumbing ``kvlayer serve`` and ``kvlayer router`` share: body limit, API keys, errors.

``BodyLimit`` wraps an ASGI app and refuses (413) bodies over a limit; ``check_api_key``
checks the bearer key; ``json_object`` reads a body as a JSON object; ``install_error_handlers``
makes every error OpenAI's error JSON (serving/protocol.py). This module imports starlette and
pydantic only, never the engine or torch, so the router (a proxy that holds no KV) runs
without them.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Sequence
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvlayer.serving.protocol import APIError, error_body

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024**2
"""The largest request body both servers accept unless told otherwise (``--max-body-bytes``)."""


def install_error_handlers(app: Any, name: str) -> None:
    """Every error of ``app`` (a FastAPI app) as OpenAI's error JSON: ``APIError``, unknown
    routes and methods, and any other exception (500, the traceback logged under ``name``,
    never sent)."""

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
