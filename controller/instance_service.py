"""``InstanceServicer``: the controller's side of each instance's ``Connect`` stream.

Protocol (``controller.proto``): the first message is ``Register``; the controller answers
``Registered`` (the heartbeat interval). Then the instance sends its snapshot parts, events,
heartbeats and command replies, in any order; the controller sends commands. Any message
counts as a heartbeat. A malformed message ends the stream with INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED past a bound); when the stream ends, for whatever reason, the instance
is marked down and its entries leave the registry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller import controller_pb2_grpc as pb_grpc
from kvlayer.controller import wire
from kvlayer.controller.errors import RequestError, exhausted, invalid, unavailable
from kvlayer.controller.registry import Instance, Registry, RegistryFull
from kvlayer.controller.session import Session
from kvlayer.controller.settings import ControllerSettings
from kvlayer.health import LogThrottle

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0
"""How long a new stream may take to send its ``Register``."""
BAD_MESSAGE_LOG_EVERY_S = 10.0
"""A misbehaving instance is logged at most this often (it could otherwise flood the log)."""

_Handler = Callable[[Instance, Session, object], None]


class InstanceServicer(pb_grpc.InstanceServiceServicer):
    """Serves ``Connect``; shares ``registry`` and ``sessions`` (id -> live session) with the admin side."""

    def __init__(self, registry: Registry, sessions: dict[str, Session], settings: ControllerSettings) -> None:
        self._registry = registry
        self._sessions = sessions
        self._settings = settings
        self._bad_log = LogThrottle(BAD_MESSAGE_LOG_EVERY_S)
        self._handlers: dict[str, _Handler] = {
            "snapshot": self._on_snapshot, "event": self._on_event,
            "heartbeat": self._on_heartbeat, "reply": self._on_reply,
        }

    async def Connect(self, request_iterator: AsyncIterator[pb.InstanceMessage],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ControllerMessage]:
        """One instance's stream, from its ``Register`` until either side ends it (protocol above)."""
        it = request_iterator.__aiter__()
        try:
            entry, session = await self._register(it)
        except RequestError as e:
            await context.abort(e.code, e.message)
        interval_ms = int(self._settings.heartbeat_interval_s * 1000)
        yield pb.ControllerMessage(registered=pb.Registered(heartbeat_interval_ms=interval_ms))
        reader = asyncio.ensure_future(self._read(it, entry, session))
        error: BaseException | None = None
        try:
            async for message in _outgoing(session, reader):
                yield message
            if reader.done() and not reader.cancelled():
                error = reader.exception()
            elif session.closed.is_set():  # the controller ended it: timeout, replaced, shutting down
                error = unavailable(session.close_reason)
        finally:
            reader.cancel()
            self._end(entry, session, "stream ended")
        if isinstance(error, RequestError):
            if error.code != grpc.StatusCode.UNAVAILABLE and self._bad_log.allow():
                log.warning("controller: instance %s sent a bad message: %s", entry.instance_id, error.message)
            await context.abort(error.code, error.message)
        elif error is not None:
            log.error("controller: stream of %s failed", entry.instance_id, exc_info=error)

    async def _register(self, it: AsyncIterator[pb.InstanceMessage]) -> tuple[Instance, Session]:
        try:
            first = await asyncio.wait_for(it.__anext__(), REGISTER_TIMEOUT_S)
        except (StopAsyncIteration, TimeoutError):
            raise invalid("the stream must open with a register message") from None
        if first.WhichOneof("body") != "register":
            raise invalid("the stream must open with a register message")
        spec = wire.spec_from_wire(first.register)
        try:
            entry = self._registry.register(spec)
        except RegistryFull as e:
            raise exhausted(str(e)) from None
        old = self._sessions.get(spec.instance_id)
        if old is not None:
            old.close("replaced by a new connection of the same instance")
        session = self._sessions[spec.instance_id] = Session(spec.instance_id)
        log.info("controller: instance %s registered (%s, role %s, tiers %s)", spec.instance_id,
                 spec.namespace.model_name, spec.role, ", ".join(t.name for t in spec.tiers))
        return entry, session

    async def _read(self, it: AsyncIterator[pb.InstanceMessage], entry: Instance, session: Session) -> None:
        async for message in it:
            self._registry.touch(entry)
            kind = message.WhichOneof("body")
            handler = self._handlers.get(kind or "")
            if handler is None:
                raise invalid(f"unexpected message {kind or 'with no body'} on a registered stream")
            try:
                handler(entry, session, getattr(message, kind))
            except KeyError as e:
                raise invalid(str(e.args[0])) from None
            except RegistryFull as e:
                raise exhausted(str(e)) from None

    def _end(self, entry: Instance, session: Session, reason: str) -> None:
        session.close(reason)
        if self._sessions.get(entry.instance_id) is session:
            del self._sessions[entry.instance_id]
        if self._registry.current(entry):
            log.info("controller: instance %s is down (%s)", entry.instance_id, session.close_reason or reason)
        self._registry.mark_down(entry)

    # --- message handlers -------------------------------------------------------------
    def _on_snapshot(self, entry: Instance, session: Session, part: object) -> None:
        assert isinstance(part, pb.SnapshotPart)
        digests = wire.check_digests(part.digests, "snapshot")
        if part.tier or digests:
            self._registry.admit(entry, part.tier, digests)
        if part.final:
            self._registry.mark_synced(entry)

    def _on_event(self, entry: Instance, session: Session, event: object) -> None:
        assert isinstance(event, pb.TierEvent)
        self._registry.admit(entry, event.tier, wire.check_digests(event.admitted, "event"))
        self._registry.evict(entry, event.tier, wire.check_digests(event.evicted, "event"))

    def _on_heartbeat(self, entry: Instance, session: Session, beat: object) -> None:
        assert isinstance(beat, pb.Heartbeat)
        self._registry.set_stats(entry, wire.stats_from_wire(beat, entry.spec))

    def _on_reply(self, entry: Instance, session: Session, reply: object) -> None:
        assert isinstance(reply, pb.CommandReply)
        if not session.resolve(reply):
            log.debug("controller: late or unknown reply %d from %s", reply.command_id, entry.instance_id)


async def _outgoing(session: Session, reader: asyncio.Future[None]) -> AsyncIterator[pb.ControllerMessage]:
    """The session's outgoing messages until it closes or the reader stops."""
    closer = asyncio.ensure_future(session.closed.wait())
    getter: asyncio.Future[pb.ControllerMessage] | None = None
    try:
        while True:
            getter = asyncio.ensure_future(session.outbox.get())
            done, _ = await asyncio.wait({getter, reader, closer}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                return
            yield getter.result()
    finally:
        for task in (closer, getter):
            if task is not None and not task.done():
                task.cancel()
