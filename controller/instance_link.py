"""``InstanceLink``: one registration's ``Connect`` stream to the controller, kept up with backoff.

Shared by the engine's agent (``kvlayer.controller.agent``) and the node cache server's link
(``kvlayer.cacheserver.controller_link``). A link runs on whatever asyncio loop awaits ``run``:
it connects (bearer metadata), registers what its ``InstanceSource`` describes, sends the
source's snapshot, then streams the events its ``EventBuffer`` collects, a heartbeat every
interval the controller asks for, and the source's reply to each command; until either side
fails. Then it retries with exponential backoff (with jitter) and, once back, registers and
snapshots again, so the controller's registry is rebuilt. A failure is logged once per new
reason and never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Iterator
from typing import Protocol

import grpc

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller import controller_pb2_grpc as pb_grpc
from kvlayer.controller.channel import Target, aio_channel
from kvlayer.controller.events import EventBuffer

log = logging.getLogger(__name__)

BATCH = 8192
"""Digests per snapshot or event message (8192 x 34 bytes stays far below message limits)."""
EVENT_PERIOD_S = 0.05
"""How often buffered events are sent."""
MAX_BUFFERED = 1_000_000
"""Digests buffered before a link gives up on events and resynchronises."""


class InstanceSource(Protocol):
    """What a link registers and answers with; each coroutine may take a while (it must not
    block the loop: hand blocking work to a thread)."""

    def registration(self) -> pb.Register:
        """The ``Register`` message (instance id, address, namespace, tiers, role)."""
        ...

    async def snapshot(self) -> dict[str, list[bytes]]:
        """The digests each tier holds now, by tier name."""
        ...

    async def heartbeat(self) -> pb.Heartbeat:
        """Per-tier counters."""
        ...

    async def command(self, command: pb.Command) -> pb.CommandReply:
        """Carry out ``command``; never raises (a failure is a reply with ``ok`` false)."""
        ...


class ResyncNeeded(Exception):
    """Events were lost (buffer bound reached): reconnect and send a new snapshot."""


class InstanceLink:
    """Keeps ``source`` registered with the controller at ``target`` (see the module docstring).

    ``events`` is where the source's tiers report admissions and evictions; the link records
    from just before each snapshot. ``run(stop)`` returns once ``stop`` is set.
    """

    def __init__(self, source: InstanceSource, target: Target, metadata: tuple[tuple[str, str], ...],
                 events: EventBuffer, backoff_s: tuple[float, float] = (0.2, 5.0), name: str = "kvlayer agent") -> None:
        self._source = source
        self._target = target
        self._metadata = metadata
        self._events = events
        self._backoff = backoff_s
        self._name = name
        self._connected = False
        self._was_connected = False
        self.last_error: str | None = None
        """Why the last connection attempt failed or ended ("CODE: details"); None before any."""
        self.registrations = 0
        """How many times the link has registered (and snapshotted); for tests and logs."""

    @property
    def connected(self) -> bool:
        """Whether the link is registered and streaming right now."""
        return self._connected

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, stream, and reconnect with backoff until ``stop`` is set."""
        delay, logged = self._backoff[0], None
        while not stop.is_set():
            error = await self._attempt(stop)
            if stop.is_set():
                break
            if self._was_connected:
                delay, logged = self._backoff[0], None
            self.last_error = describe(error) if error is not None else "the stream ended"
            if self.last_error != logged:  # one line per new reason, not one per retry
                log.warning("%s: controller %s: %s; retrying with backoff", self._name, self._target.address,
                            self.last_error)
                logged = self.last_error
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self._backoff[1])

    async def _attempt(self, stop: asyncio.Event) -> BaseException | None:
        """One connection, until it fails or ``stop`` is set; returns its error."""
        session = asyncio.ensure_future(self._session())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({session, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        self._was_connected = self._connected
        self._connected = False
        self._events.record(False)
        session.cancel()
        try:
            await session
        except asyncio.CancelledError:
            return None
        except Exception as e:
            return e
        return None

    async def _session(self) -> None:
        async with aio_channel(self._target) as channel:
            call = pb_grpc.InstanceServiceStub(channel).Connect(metadata=self._metadata)
            try:
                self._events.record(True)  # before the snapshot: nothing falls between the two
                register = self._source.registration()
                await call.write(pb.InstanceMessage(register=register))
                first = await call.read()
                if first is grpc.aio.EOF or first.WhichOneof("body") != "registered":
                    raise ConnectionError("the controller did not acknowledge the registration")
                interval = min(max(first.registered.heartbeat_interval_ms / 1000, 0.05), 60.0)
                for part in snapshot_parts(await self._source.snapshot()):
                    await call.write(pb.InstanceMessage(snapshot=part))
                self.registrations += 1
                self._connected = True
                log.info("%s: registered %s with the controller at %s", self._name, register.instance_id,
                         self._target.address)
                await self._exchange(call, interval)
            finally:
                call.cancel()

    async def _exchange(self, call: grpc.aio.StreamStreamCall, interval: float) -> None:
        """Events, heartbeats and command replies out; commands in; until either side fails."""
        outbox: asyncio.Queue[pb.InstanceMessage] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._write_loop(call, outbox, interval)),
                 asyncio.ensure_future(self._read_loop(call, outbox))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _write_loop(self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[pb.InstanceMessage],
                          interval: float) -> None:
        next_beat = 0.0
        while True:
            message = None
            with contextlib.suppress(TimeoutError):
                message = await asyncio.wait_for(outbox.get(), EVENT_PERIOD_S)
            if self._events.overflowed:
                raise ResyncNeeded("too many events buffered; resynchronising")
            # Events first: a command's own admissions and evictions reach the registry before
            # its reply, so the registry is current when the admin call returns.
            for event in self._events.drain(BATCH):
                await call.write(pb.InstanceMessage(event=event))
            if message is not None:
                await call.write(message)
            if time.monotonic() >= next_beat:
                await call.write(pb.InstanceMessage(heartbeat=await self._source.heartbeat()))
                next_beat = time.monotonic() + interval

    async def _read_loop(self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[pb.InstanceMessage]) -> None:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                raise ConnectionError("the controller closed the stream")
            if message.WhichOneof("body") == "command":
                outbox.put_nowait(pb.InstanceMessage(reply=await self._source.command(message.command)))


def snapshot_parts(snapshot: dict[str, list[bytes]]) -> Iterator[pb.SnapshotPart]:
    """The snapshot in parts of at most ``BATCH`` digests; the last one is ``final``."""
    parts = [pb.SnapshotPart(tier=tier, digests=digests[i : i + BATCH])
             for tier, digests in snapshot.items() for i in range(0, len(digests), BATCH)]
    if not parts:
        parts = [pb.SnapshotPart()]
    parts[-1].final = True
    yield from parts


def describe(error: BaseException) -> str:
    """An error as one line: "CODE: details" for a gRPC error, "Type: text" otherwise."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
