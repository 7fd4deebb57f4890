"""The HTTP plumbing ``kvlayer serve`` and ``kvlayer router`` share: body limit, API keys, errors.

``BodyLimit`` wraps an ASGI app and refuses (413) bodies over a limit before anything parses
them; ``check_api_key`` checks the bearer key; ``json_object`` reads a body as a JSON object
(``decode_object``: its nesting and size checked on the raw bytes first, a large one decoded on
a worker thread); ``install_error_handlers`` makes every error OpenAI's error JSON
(serving/protocol.py). This module imports starlette and pydantic only, never the engine or
torch, so the router (a proxy that holds no KV) runs without them.
"""

from __future__ import annotations

import asyncio
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
MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a body may have (a request needs 4)."""
MAX_JSON_CONTAINERS = 100_000
"""The most arrays and objects a body may hold: millions of them take seconds to build."""
MAX_JSON_STRINGS = 200_000
"""The most strings (keys included) a body may hold."""
OFF_LOOP_BYTES = 256 * 1024
"""Bodies at least this large are decoded on a worker thread, not on the event loop."""


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
    """The request's body as a JSON object, or ``APIError`` 400 naming what is wrong (see
    ``decode_object``); a body of ``OFF_LOOP_BYTES`` or more is decoded on a worker thread."""
    raw = await request.body()
    if len(raw) < OFF_LOOP_BYTES:
        return decode_object(raw)
    return await asyncio.to_thread(decode_object, raw, True)


def decode_object(raw: bytes, yielding: bool = False) -> dict[str, Any]:
    """``raw`` as a JSON object, or ``APIError`` 400 (param null: the body is not one field) for
    malformed JSON, a body that is not an object, or one nesting deeper than ``MAX_JSON_DEPTH``
    or holding more than ``MAX_JSON_CONTAINERS`` arrays and objects or ``MAX_JSON_STRINGS``
    strings (counted on the raw bytes, before parsing). With ``yielding`` numbers are converted
    by Python functions, so that a worker thread decoding millions of them gives the GIL back
    to the event loop every switch interval (the C decoder alone keeps it throughout)."""
    try:
        encoding = json.detect_encoding(raw)
        if encoding not in ("utf-8", "utf-8-sig"):  # the shape check reads UTF-8 bytes
            raw = raw.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
        _check_shape(raw)
        data = json.loads(raw, parse_int=_int, parse_float=_float) if yielding else json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeError) as e:
        raise APIError(400, f"malformed JSON body: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    return data


_NOT_MARKS = bytes(b for b in range(256) if b not in b'[]{}"')
_OPENERS = frozenset(b"[{")
_SPLIT_QUOTES = 2 * MAX_JSON_STRINGS


def _check_shape(raw: bytes) -> None:
    """``APIError`` 400 when ``raw`` nests too deep or holds too many arrays, objects or strings.

    C-speed byte operations do the work: escaped backslashes and quotes are removed (in JSON a
    backslash only occurs inside a string), so every quote left opens or closes a string; the
    strings are then cut out and only the brackets outside them walked, stopping at a limit.
    """
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH and raw.count(b'"') <= _SPLIT_QUOTES:
        return  # a common body: it can be neither too deep nor too large
    marks = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_MARKS)
    if marks.count(b'"') > _SPLIT_QUOTES:
        raise APIError(400, f"the JSON body holds more than {MAX_JSON_STRINGS} strings")
    marks = b"".join(marks.split(b'"')[::2])
    depth = containers = 0
    for c in marks:
        if c in _OPENERS:
            depth += 1
            containers += 1
            if depth > MAX_JSON_DEPTH:
                raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
            if containers > MAX_JSON_CONTAINERS:
                raise APIError(400, f"the JSON body holds more than {MAX_JSON_CONTAINERS} arrays and objects")
        else:
            depth -= 1
            if depth < 0:
                return  # a closing bracket too many: json.loads says where


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


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
