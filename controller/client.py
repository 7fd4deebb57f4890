"""``AdminClient``: the controller's admin API from Python; ``best_instance`` for KV-aware routing.

Blocking calls over one channel; each answers the RPC's protobuf message
(``controller.proto``) or raises ``ControllerError`` with the status the controller gave::

    with AdminClient("127.0.0.1:50051", token=TOKEN) as admin:
        ranked = admin.lookup([1, 2, 3], model="llama").matches
        admin.pin("engine-0", [1, 2, 3], tier="cpu")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import grpc

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller import controller_pb2_grpc as pb_grpc
from kvlayer.controller.auth import bearer
from kvlayer.controller.channel import parse_target, sync_channel

DEFAULT_ADDRESS = "127.0.0.1:50051"
M = TypeVar("M")


class ControllerError(Exception):
    """The controller refused or failed a call: ``code`` is the gRPC status name (e.g. "NOT_FOUND")."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Route(NamedTuple):
    """Where to send a request: the instance, its address and how many prompt tokens it caches."""

    instance_id: str
    address: str
    cached_tokens: int


def prefix(token_ids: Sequence[int] | None = None, text: str | None = None, model: str = "",
           cache_salt: str | None = None) -> pb.Prefix:
    """A ``Prefix`` message: token ids or text (not both), for ``model``, under ``cache_salt``."""
    msg = pb.Prefix(token_ids=list(token_ids or ()), text=text or "", model=model)
    if cache_salt is not None:
        msg.cache_salt = cache_salt
    return msg


class AdminClient:
    """Admin calls to the controller at ``address`` (``HOST:PORT``, ``grpc://``, ``grpcs://...?ca=``).

    ``token``: the admin bearer token; ``tls_ca``: a CA file (implies TLS); ``timeout``: the
    deadline of each call in seconds. ``ValueError`` for a malformed address.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None, *, tls_ca: str | None = None,
                 timeout: float = 30.0) -> None:
        self._channel = sync_channel(parse_target(address, tls_ca))
        self._stub = pb_grpc.AdminServiceStub(self._channel)
        self._metadata = bearer(token)
        self.timeout = timeout

    # --- queries ------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int] | None = None, model: str = "", *, text: str | None = None,
               cache_salt: str | None = None, limit: int = 0) -> pb.LookupResponse:
        """Per instance (best first) and tier, how many leading tokens are cached."""
        request = pb.LookupRequest(prefix=prefix(token_ids, text, model, cache_salt), limit=limit)
        return self._call(self._stub.Lookup, request)

    def stats(self, instance_id: str = "") -> pb.StatsResponse:
        """Per instance (``instance_id``, or all) and tier: chunks, bytes, counters, health."""
        return self._call(self._stub.Stats, pb.StatsRequest(instance_id=instance_id))

    def list_instances(self) -> pb.ListInstancesResponse:
        """Every instance the controller knows, with its state, model and tiers."""
        return self._call(self._stub.ListInstances, pb.ListInstancesRequest())

    def health(self, service: str = "") -> str:
        """The standard health check's answer ("SERVING", "NOT_SERVING", ...)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        answer = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)

    # --- commands -----------------------------------------------------------------------
    def pin(self, instance_id: str, token_ids: Sequence[int] | None = None, *, tier: str = "",
            text: str | None = None, model: str = "", cache_salt: str | None = None) -> pb.CommandResponse:
        """Pin the prefix's chunks on ``instance_id`` (in ``tier``, or every tier)."""
        request = pb.PinRequest(instance_id=instance_id, prefix=prefix(token_ids, text, model, cache_salt), tier=tier)
        return self._call(self._stub.Pin, request)

    def unpin(self, instance_id: str, token_ids: Sequence[int] | None = None, *, tier: str = "",
              text: str | None = None, model: str = "", cache_salt: str | None = None) -> pb.CommandResponse:
        """Undo one pin of each of the prefix's chunks on ``instance_id``."""
        request = pb.PinRequest(instance_id=instance_id, prefix=prefix(token_ids, text, model, cache_salt), tier=tier)
        return self._call(self._stub.Unpin, request)

    def evict(self, instance_id: str = "", token_ids: Sequence[int] | None = None, *, all: bool = False,
              tier: str = "", text: str | None = None, model: str = "",
              cache_salt: str | None = None) -> pb.CommandResponse:
        """Evict a prefix (or ``all``) from ``instance_id`` (every instance if "") and ``tier`` (every tier if "")."""
        request = pb.EvictRequest(instance_id=instance_id, prefix=prefix(token_ids, text, model, cache_salt),
                                  all=all, tier=tier)
        return self._call(self._stub.Evict, request)

    def move(self, instance_id: str, token_ids: Sequence[int] | None = None, *, dst_tier: str, src_tier: str = "",
             dst_instance_id: str = "", via_tier: str = "", keep_source: bool = False, text: str | None = None,
             model: str = "", cache_salt: str | None = None) -> pb.CommandResponse:
        """Move a prefix between tiers of ``instance_id``, or to ``dst_instance_id`` through a shared tier."""
        request = pb.MoveRequest(instance_id=instance_id, prefix=prefix(token_ids, text, model, cache_salt),
                                 src_tier=src_tier, dst_tier=dst_tier, dst_instance_id=dst_instance_id,
                                 via_tier=via_tier, keep_source=keep_source)
        return self._call(self._stub.Move, request)

    def pins(self, instance_id: str = "", token_ids: Sequence[int] | None = None, *, tier: str = "",
             text: str | None = None, model: str = "", cache_salt: str | None = None) -> pb.PinsResponse:
        """The pinned chunks and their pin counts per instance (``instance_id``, or every live one)
        and tier (``tier``, or every tier); with a prefix (token ids or text), only its chunks."""
        request = pb.PinsRequest(instance_id=instance_id, tier=tier)
        if token_ids or text:
            request.prefix.CopyFrom(prefix(token_ids, text, model, cache_salt))
        elif model:
            request.prefix.model = model
        return self._call(self._stub.Pins, request)

    # --- plumbing -----------------------------------------------------------------------
    def _call(self, method: Callable[..., M], request: Any) -> M:
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
            details = e.details() if callable(getattr(e, "details", None)) else str(e)
            raise ControllerError(code.name, details or code.name) from None

    def close(self) -> None:
        """Close the channel (idempotent)."""
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def best_instance(token_ids: Sequence[int], model: str, *, client: AdminClient | None = None,
                  cache_salt: str | None = None, **client_options: Any) -> Route | None:
    """The instance caching the longest prefix of ``token_ids`` for ``model`` (ties: the one holding
    more of it in its own tiers rather than a shared one, then the lowest id).

    None when no live instance serves ``model``. Uses ``client`` or one made from
    ``client_options`` (``AdminClient``'s arguments). ``ControllerError`` for other refusals.
    """
    own = client is None
    admin = client or AdminClient(**client_options)
    try:
        answer = admin.lookup(token_ids, model, cache_salt=cache_salt, limit=1)
    except ControllerError as e:
        if e.code == "NOT_FOUND":
            return None
        raise
    finally:
        if own:
            admin.close()
    if not answer.matches:
        return None
    top = answer.matches[0]
    return Route(top.instance_id, top.address, top.cached_tokens)
