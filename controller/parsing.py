"""``ParseInterceptor``: request bytes that are not the method's message are INVALID_ARGUMENT.

gRPC parses each request with the method's deserializer before any servicer code runs, and
answers UNKNOWN (with protobuf's exception text) when that raises. This interceptor wraps the
deserializer so that bytes protobuf cannot parse become a ``Malformed`` marker, and the
method's behavior refuses the call with INVALID_ARGUMENT for it: a unary call at once, a
stream at that message (a ``RequestError`` from the request iterator, which the servicer
turns into the status). Every handler of the server is async (grpc.aio), as this expects.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvlayer.controller.errors import invalid


@dataclass(frozen=True, slots=True)
class Malformed:
    """Request bytes that did not parse; ``message`` is the one-line refusal."""

    message: str


class ParseInterceptor(grpc.aio.ServerInterceptor):
    """Makes every method refuse unparsable request bytes with INVALID_ARGUMENT (see above)."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The call's handler, its request parsing checked."""
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _checked(handler)


def _checked(handler: Any) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def deserialize(data: bytes) -> object:
        try:
            return parse(data)
        except DecodeError:
            return Malformed(f"the request ({len(data)} bytes) is not a valid protobuf message for this method")

    kind = ("stream_" if handler.request_streaming else "unary_") + ("stream" if handler.response_streaming
                                                                     else "unary")
    original = getattr(handler, kind)

    async def prepare(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if handler.request_streaming:
            return _parsed(request)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return request

    if inspect.isasyncgenfunction(original):
        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async for answer in original(await prepare(request, context), context):
                yield answer
    else:
        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await original(await prepare(request, context), context)

    return handler._replace(request_deserializer=deserialize, **{kind: behavior})


async def _parsed(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``requests``, raising ``RequestError`` (INVALID_ARGUMENT) at a malformed one."""
    async for request in requests:
        if isinstance(request, Malformed):
            raise invalid(request.message)
        yield request
