"""``AdminServicer``: the operator's RPCs (``AdminService`` in ``controller.proto``).

``Lookup``, ``Stats`` and ``ListInstances`` answer from the registry. ``Pin``, ``Unpin``,
``Evict``, ``Move`` and ``Pins`` become commands on the target instances' streams; each RPC waits for
the replies (``command_timeout_s`` at most, or the caller's deadline if shorter). A command
aimed at one instance that fails fails the RPC (FAILED_PRECONDITION, DEADLINE_EXCEEDED or
UNAVAILABLE); one aimed at every instance reports each instance's outcome in its results.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller import controller_pb2_grpc as pb_grpc
from kvlayer.controller import wire
from kvlayer.controller.errors import RequestError, invalid, not_found, unavailable
from kvlayer.controller.move import MovePlanner
from kvlayer.controller.prefixes import PrefixReader
from kvlayer.controller.registry import Instance, Registry, State
from kvlayer.controller.session import Session
from kvlayer.controller.settings import ControllerSettings

log = logging.getLogger(__name__)

R = TypeVar("R")
_STATES = {State.SYNCING: pb.INSTANCE_STATE_SYNCING, State.UP: pb.INSTANCE_STATE_UP,
           State.DOWN: pb.INSTANCE_STATE_DOWN}
_MARGIN_S = 0.05
"""Left of the caller's deadline to send the answer back."""


def _rpc(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Turn ``RequestError`` into the call's status; log and answer INTERNAL for anything else."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        """The RPC, its refusals as statuses."""
        try:
            return await method(self, request, context)
        except RequestError as e:
            await context.abort(e.code, e.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            log.exception("controller: %s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed inside the controller")
        raise AssertionError("unreachable")

    return wrapper


class AdminServicer(pb_grpc.AdminServiceServicer):
    """Admin RPCs over ``registry`` and the live ``sessions`` (shared with ``InstanceServicer``)."""

    def __init__(self, registry: Registry, sessions: dict[str, Session], settings: ControllerSettings) -> None:
        self._registry = registry
        self._sessions = sessions
        self._settings = settings
        self._prefixes = PrefixReader(settings.max_tokens, settings.tokenizers)
        self._mover = MovePlanner(self._prefix_for, self._tier, self._live)

    # --- queries ------------------------------------------------------------------------
    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        """Per live instance of ``prefix.model`` (best first) and tier: the prefix tokens cached.

        NOT_FOUND when no live instance serves the model; INVALID_ARGUMENT / RESOURCE_EXHAUSTED
        for a malformed or too long prefix.
        """
        prefix = request.prefix
        model = wire.check_text(prefix.model, "prefix.model", empty_ok=False)
        if request.limit < 0:
            raise invalid(f"limit must be >= 0, got {request.limit}")
        entries = self._registry.live(model)
        aliases = [name for e in entries for name in e.spec.model_names() if name != model]
        tokens = self._prefixes.tokens(prefix, model, aliases)  # a tokenizer under any name of the model
        salt = self._prefixes.salt(prefix)
        if not entries:
            raise not_found(f"no live instance serves model {model[:80]!r}")
        keys_of: dict[Any, list[Any]] = {}
        matches = []
        for entry in entries:
            signature = (entry.spec.namespace.with_salt(salt), entry.spec.save_partial_chunks)
            if signature not in keys_of:  # hashing may take a while: off the event loop
                keys_of[signature] = await asyncio.to_thread(entry.spec.keys, tokens, salt)
            matches.append(self._registry.match(entry, keys_of[signature]))
        matches.sort(key=lambda m: m.rank())
        if request.limit:
            matches = matches[: request.limit]
        return pb.LookupResponse(num_tokens=len(tokens), matches=[
            pb.InstanceMatch(instance_id=m.instance_id, address=m.address, cached_tokens=m.cached_tokens,
                             local_tokens=m.local_tokens, role=m.role,
                             tiers=[pb.TierMatch(tier=t, prefix_tokens=n) for t, n in m.per_tier.items()])
            for m in matches])

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        """Per instance (one, or all) and tier: the registry's chunk counts, the last heartbeat's counters
        and the hit rate they give (``wire.hit_rate``)."""
        entries = [self._known(request.instance_id)] if request.instance_id else self._registry.instances()
        out = []
        for entry in entries:
            tiers = []
            for t in entry.spec.tiers:
                values = entry.stats.get(t.name, {})
                tiers.append(pb.TierStats(tier=t.name, chunks=self._registry.chunk_count(entry, t.name),
                                          healthy=bool(values.get("healthy", 0)), hit_rate=wire.hit_rate(values),
                                          **{k: values.get(k, 0) for k in wire.STAT_FIELDS}))
            out.append(pb.InstanceStats(info=self._info(entry), tiers=tiers))
        return pb.StatsResponse(instances=out)

    @_rpc
    async def ListInstances(self, request: pb.ListInstancesRequest,
                            context: grpc.aio.ServicerContext) -> pb.ListInstancesResponse:
        """Every instance the registry knows, DOWN ones included, by id."""
        return pb.ListInstancesResponse(instances=[self._info(e) for e in self._registry.instances()])

    # --- commands -----------------------------------------------------------------------
    @_rpc
    async def Pin(self, request: pb.PinRequest, context: grpc.aio.ServicerContext) -> pb.CommandResponse:
        """Pin the prefix's chunks on one instance (``tier``, or every tier that can pin); pinned chunks
        are never evicted. A tier that cannot pin (Redis) is refused with INVALID_ARGUMENT."""
        return await self._pin(request, context, pb.ACTION_PIN)

    @_rpc
    async def Unpin(self, request: pb.PinRequest, context: grpc.aio.ServicerContext) -> pb.CommandResponse:
        """Undo one pin of each of the prefix's chunks on one instance."""
        return await self._pin(request, context, pb.ACTION_UNPIN)

    async def _pin(self, request: pb.PinRequest, context: grpc.aio.ServicerContext,
                   action: int) -> pb.CommandResponse:
        """One pin or unpin; INVALID_ARGUMENT when ``tier`` cannot pin (no tier: the pinnable ones pin)."""
        entry = self._live(request.instance_id)
        command = self._prefix_for(entry, request.prefix, action)
        command.tier = self._tier(entry, request.tier, "tier")
        spec = entry.spec.tier(command.tier) if command.tier else None
        if spec is not None and spec.cannot_pin:
            raise invalid(f"tier {spec.name!r} of instance {entry.instance_id!r} cannot pin (Redis evicts by its own "
                          f"maxmemory policy); tiers that can: {entry.spec.pinnable()}")
        return pb.CommandResponse(results=[await self.run_one(entry, command, context)])

    @_rpc
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.CommandResponse:
        """Remove a prefix's (or ``all``) unpinned chunks from one instance or every live one.

        On every instance (of ``prefix.model`` if set), each instance's outcome is a result;
        instances without ``tier`` are left alone.
        """
        prefix = request.prefix
        if request.all == (not PrefixReader.is_empty(prefix)):
            raise invalid("evict: give either a prefix (token_ids or text) or all")
        if prefix.token_ids:  # checked once here, so a bad list fails the call, not each instance
            wire.check_tokens(prefix.token_ids, self._settings.max_tokens)
        self._prefixes.salt(prefix)
        if request.instance_id:
            entry = self._live(request.instance_id)
            command = self._evict_command(entry, request)
            return pb.CommandResponse(results=[await self.run_one(entry, command, context)])
        model = wire.check_text(prefix.model, "prefix.model")
        if prefix.text:  # tokenized once, for the one model named
            if not model:
                raise invalid("evict: text on every instance needs prefix.model")
            self._prefixes.tokens(prefix, model)
        entries = self._registry.live(model or None)
        if request.tier:  # instances without that tier are left alone; a tier nobody has is an error
            entries = [e for e in entries if e.spec.tier(request.tier) is not None]
            if not entries:
                raise invalid(f"evict: no live instance has a tier {request.tier[:40]!r}")
        results = await asyncio.gather(*(self._evict_on(e, request, context) for e in entries))
        return pb.CommandResponse(results=results)

    def _evict_command(self, entry: Instance, request: pb.EvictRequest) -> pb.Command:
        if request.all:
            command = pb.Command(action=pb.ACTION_EVICT_ALL)
        else:
            command = self._prefix_for(entry, request.prefix, pb.ACTION_EVICT)
        command.tier = self._tier(entry, request.tier, "tier")
        return command

    async def _evict_on(self, entry: Instance, request: pb.EvictRequest,
                        context: grpc.aio.ServicerContext) -> pb.InstanceResult:
        """Evict on one of every instance: its failure is reported in its result, not raised."""
        try:
            return await self.run_one(entry, self._evict_command(entry, request), context)
        except RequestError as e:
            return pb.InstanceResult(instance_id=entry.instance_id, ok=False, error=f"{e.code.name}: {e.message}")

    @_rpc
    async def Move(self, request: pb.MoveRequest, context: grpc.aio.ServicerContext) -> pb.CommandResponse:
        """The plan's steps in order (``kvlayer.controller.move``); the first failure fails the call."""
        results: list[pb.InstanceResult] = []
        for step in self._mover.plan(request):
            if step.drops_source:  # evict only what every earlier step delivered
                delivered = min((r.tokens for r in results), default=0)
                if delivered == 0:
                    continue
                del step.command.token_ids[delivered:]
            results.append(await self.run_one(step.instance, step.command, context))
        return pb.CommandResponse(results=results)

    @_rpc
    async def Pins(self, request: pb.PinsRequest, context: grpc.aio.ServicerContext) -> pb.PinsResponse:
        """The pinned chunks and their pin counts, per live instance (one, or all) and tier; with a
        prefix, only its chunks. One instance's failure is reported in its entry, not raised."""
        with_prefix = not PrefixReader.is_empty(request.prefix)
        model = wire.check_text(request.prefix.model, "prefix.model")
        entries = [self._live(request.instance_id)] if request.instance_id else self._registry.live(model or None)

        async def one(entry: Instance) -> pb.InstancePins:
            try:
                command = (self._prefix_for(entry, request.prefix, pb.ACTION_LIST_PINS) if with_prefix
                           else pb.Command(action=pb.ACTION_LIST_PINS))
                command.tier = self._tier(entry, request.tier, "tier")
                reply = await self._reply(entry, command, context)
            except RequestError as e:
                if request.instance_id:
                    raise
                return pb.InstancePins(instance_id=entry.instance_id, ok=False, error=f"{e.code.name}: {e.message}")
            return pb.InstancePins(instance_id=entry.instance_id, ok=True, tiers=reply.pins)

        return pb.PinsResponse(instances=await asyncio.gather(*(one(e) for e in entries)))

    async def run_one(self, entry: Instance, command: pb.Command,
                      context: grpc.aio.ServicerContext) -> pb.InstanceResult:
        """Run ``command`` on ``entry``; a failure raises ``RequestError``."""
        reply = await self._reply(entry, command, context)
        return pb.InstanceResult(instance_id=entry.instance_id, ok=True, chunks=reply.chunks, tokens=reply.tokens,
                                 skipped_pinned=reply.skipped_pinned, missing=reply.missing,
                                 action=pb.Action.Name(command.action).removeprefix("ACTION_").lower())

    async def _reply(self, entry: Instance, command: pb.Command,
                     context: grpc.aio.ServicerContext) -> pb.CommandReply:
        """``entry``'s successful reply to ``command``; ``RequestError`` for a failure."""
        session = self._sessions.get(entry.instance_id)
        if session is None:
            raise unavailable(f"instance {entry.instance_id!r} is not connected")
        remaining = context.time_remaining()
        timeout = self._settings.command_timeout_s
        if remaining is not None:
            timeout = min(timeout, remaining - _MARGIN_S)
        reply = await session.request(command, timeout)
        if not reply.ok:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"instance {entry.instance_id!r}: {reply.error[:500]}")
        return reply

    # --- request pieces -----------------------------------------------------------------
    def _known(self, instance_id: str) -> Instance:
        entry = self._registry.get(wire.check_id(instance_id))
        if entry is None:
            raise not_found(f"no instance {instance_id!r}")
        return entry

    def _live(self, instance_id: str) -> Instance:
        entry = self._known(instance_id)
        if entry.state is State.DOWN:
            raise not_found(f"instance {instance_id!r} is down")
        return entry

    def _prefix_for(self, entry: Instance, prefix: pb.Prefix, action: int) -> pb.Command:
        """A command of ``action`` over ``prefix``, checked against ``entry``'s model (either name)."""
        names = entry.spec.model_names()
        if prefix.model and prefix.model not in names:
            raise invalid(f"instance {entry.instance_id!r} serves model {' or '.join(map(repr, names))}, "
                          f"not {prefix.model[:80]!r}")
        command = pb.Command(action=action, token_ids=self._prefixes.tokens(prefix, names[0], names[1:]))
        salt = self._prefixes.salt(prefix)
        if salt is not None:
            command.cache_salt = salt
        return command

    @staticmethod
    def _tier(entry: Instance, name: str, what: str, required: bool = False) -> str:
        """``name`` if ``entry`` has that tier ("" allowed unless ``required``); INVALID_ARGUMENT otherwise."""
        if not name and not required:
            return ""
        if entry.spec.tier(name) is None:
            names = [t.name for t in entry.spec.tiers]
            raise invalid(f"{what}: instance {entry.instance_id!r} has no tier {name[:40]!r} (tiers: {names})")
        return name

    def _info(self, entry: Instance) -> pb.InstanceInfo:
        spec = entry.spec
        return pb.InstanceInfo(
            instance_id=spec.instance_id, address=spec.address, state=_STATES[entry.state], role=spec.role,
            served_model=spec.served_model,
            namespace=wire.namespace_to_wire(spec.namespace, spec.save_partial_chunks),
            tiers=[wire.tier_to_wire(t) for t in spec.tiers], last_seen_s=self._registry.seen_ago(entry),
            chunks=sum(self._registry.chunk_count(entry, t.name) for t in spec.tiers))
