"""The router's questions to the controller: which instances exist, and who caches a prefix.

Both are asyncio gRPC calls with a deadline. Neither raises for the controller's sake: a
controller that is down, slow or refusing answers None, and the router routes by load
(it never fails a request because the controller is away). An outage is logged once, when it
starts; ``failures`` counts every failed call and ``last_failure`` says what the last one was
(the router logs failed lookups itself, rate limited: routing_status.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller import controller_pb2_grpc as pb_grpc
from kvlayer.controller.auth import bearer
from kvlayer.controller.channel import aio_channel, parse_target

log = logging.getLogger(__name__)

_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""The controller's answers about one prompt (malformed, too long, a model it does not know):
it is up, and ``answering`` stays True."""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What one instance caches of a prompt: ``local`` leading tokens in its own tiers, and
    ``cached`` with the shared tiers (Redis) counted too."""

    cached: int
    local: int


class ControllerView:
    """Calls to the controller at ``url`` (``HOST:PORT``, ``grpc://``, ``grpcs://...?ca=``) with
    the admin ``token``. Make it inside the running event loop; ``close()`` when done."""

    def __init__(self, url: str, token: str | None, lookup_timeout_s: float, list_timeout_s: float = 2.0) -> None:
        self.url = url
        self._channel = aio_channel(parse_target(url))
        self._stub = pb_grpc.AdminServiceStub(self._channel)
        self._metadata = bearer(token)
        self.lookup_timeout_s = lookup_timeout_s
        self.list_timeout_s = list_timeout_s
        self.failures = 0
        self.last_failure = ""
        """The last failed call: its name, the gRPC status and the controller's message."""
        self._down = False

    @property
    def answering(self) -> bool:
        """False from a call the controller did not answer (down, slow or refusing) until one it did."""
        return not self._down

    async def instances(self) -> list[pb.InstanceInfo] | None:
        """Every instance the controller knows (any state), or None when it cannot answer."""
        try:
            answer = await self._stub.ListInstances(pb.ListInstancesRequest(), timeout=self.list_timeout_s,
                                                    metadata=self._metadata)
        except grpc.RpcError as e:
            self._failed("ListInstances", e)
            return None
        self._recovered()
        return list(answer.instances)

    async def lookup(self, model: str, token_ids: Sequence[int] | None, text: str | None,
                     cache_salt: str | None) -> dict[str, PrefixHit] | None:
        """Per instance id, what it caches of the prompt (token ids, or text the controller
        tokenizes), under ``cache_salt``; None past the deadline or when the controller is away."""
        prefix = pb.Prefix(token_ids=list(token_ids or ()), text=text or "", model=model)
        if cache_salt is not None:
            prefix.cache_salt = cache_salt
        try:
            answer = await self._stub.Lookup(pb.LookupRequest(prefix=prefix), timeout=self.lookup_timeout_s,
                                             metadata=self._metadata)
        except grpc.RpcError as e:
            self._failed("Lookup", e)
            return None
        self._recovered()
        return {m.instance_id: PrefixHit(m.cached_tokens, m.local_tokens) for m in answer.matches}

    async def close(self) -> None:
        await self._channel.close()

    def _failed(self, call: str, e: grpc.RpcError) -> None:
        self.failures += 1
        code = e.code() if hasattr(e, "code") else None
        name = code.name if code is not None else type(e).__name__
        details = " ".join(str(e.details() if hasattr(e, "details") else e).split())[:200]
        self.last_failure = f"{call} {name}: {details}"
        if code in _REFUSALS:
            return  # the controller is up: it cannot answer this prompt (e.g. text without a tokenizer)
        if not self._down:
            self._down = True
            log.warning("kvlayer router: the controller at %s did not answer %s (%s); routing by load until it "
                        "does", self.url, call, name)

    def _recovered(self) -> None:
        if self._down:
            self._down = False
            log.warning("kvlayer router: the controller at %s answers again", self.url)
