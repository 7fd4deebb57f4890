"""``RequestError``: a request the controller refuses, with the gRPC status it answers.

Validation raises it anywhere below the servicers; the servicers turn it into the status (and
log nothing: a refused request is the caller's problem, not the server's).
"""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """Refuse the current request with ``code`` and a one-line ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    """INVALID_ARGUMENT: the request is malformed."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> RequestError:
    """NOT_FOUND: it names what the controller does not know (or is down)."""
    return RequestError(grpc.StatusCode.NOT_FOUND, message)


def exhausted(message: str) -> RequestError:
    """RESOURCE_EXHAUSTED: past a bound."""
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> RequestError:
    """UNAVAILABLE: an instance cannot be reached now."""
    return RequestError(grpc.StatusCode.UNAVAILABLE, message)
