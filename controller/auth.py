"""Who may call the controller: bearer tokens (checked in constant time) and TLS credentials.

Admin calls (``kvlayer.v1.AdminService``) need ``authorization: Bearer <admin token>`` when
an admin token is configured; instance streams (``kvlayer.v1.InstanceService``) need the
instance token when one is configured (instances send their ``controller_token``). Other
services (the standard health check) are open. A refused call gets UNAUTHENTICATED before
its request is even parsed.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

ADMIN_SERVICE = "/kvlayer.v1.AdminService/"
INSTANCE_SERVICE = "/kvlayer.v1.InstanceService/"
ADMIN_TOKEN_ENV = "KVLAYER_ADMIN_TOKEN"
INSTANCE_TOKEN_ENV = "KVLAYER_CONTROLLER_TOKEN"
"""The variable instances read their ``controller_token`` from; the controller accepts it too."""


def read_token(path: str | None, env_var: str, env: Mapping[str, str] | None = None) -> str | None:
    """The token in file ``path`` (surrounding whitespace stripped), else ``$env_var``, else None.

    ``ValueError`` for an empty file, or a token containing whitespace; ``OSError`` if unreadable.
    """
    if path is not None:
        token = Path(path).read_text().strip()
        source = path
    else:
        token = (os.environ if env is None else env).get(env_var, "").strip()
        source = env_var
        if not token:
            return None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"the token in {source} is empty or contains whitespace")
    return token


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (none for None)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def authorized(metadata: Sequence[tuple[str, Any]] | None, token: str) -> bool:
    """Whether ``metadata`` carries exactly ``Bearer <token>`` (constant-time comparison)."""
    expected = f"Bearer {token}".encode()
    given = [v for k, v in metadata or () if k == "authorization"]
    if len(given) != 1:
        return False
    value = given[0].encode() if isinstance(given[0], str) else bytes(given[0])
    return hmac.compare_digest(value, expected)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right bearer token for their service (see the module docstring)."""

    def __init__(self, admin_token: str | None, instance_token: str | None) -> None:
        self._tokens = {ADMIN_SERVICE: admin_token, INSTANCE_SERVICE: instance_token}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The call's handler, or one that refuses it with UNAUTHENTICATED."""
        service = next((s for s in self._tokens if details.method.startswith(s)), None)
        token = self._tokens.get(service) if service else None
        handler = await continuation(details)
        if token is None or handler is None or authorized(details.invocation_metadata, token):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED (the request stays unparsed)."""
    message = "missing or wrong bearer token"

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> None:
        """Refuse a call with a single request."""
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(requests: Any, context: grpc.aio.ServicerContext) -> None:
        """Refuse a call with a request stream."""
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(unary)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(stream)
    return grpc.stream_stream_rpc_method_handler(stream)


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS for the server from PEM files; with ``client_ca``, clients must present a certificate it signed."""
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)
