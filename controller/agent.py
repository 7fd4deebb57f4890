"""``ControllerAgent``: an engine instance's link to the controller, from a background thread.

The connector starts one when ``controller_url`` is set (``start_agent``). The agent runs its
own asyncio loop in a daemon thread: it connects (bearer token ``controller_token``),
registers the instance (id, address, role, served model name, key namespace, tiers), sends a
snapshot of the chunk digests each tier holds, then streams the tiers' admission and eviction
events (it is the backends' ``TierListener``) and a heartbeat with per-tier counters, and carries
out the commands the controller sends (``agent_commands``), answering each on the same stream.

When the controller is away the engine keeps serving: the agent retries with exponential
backoff (with jitter) and, once back, registers and snapshots again, so the controller's
registry is rebuilt. Nothing here blocks or raises into the engine: the listener callbacks
only append to a bounded buffer (past its bound the agent resynchronises with a new
snapshot), and every failure is logged and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import threading
import time
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

import grpc

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.config import KVLayerConfig
from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller import controller_pb2_grpc as pb_grpc
from kvlayer.controller.agent_commands import run_command
from kvlayer.controller.auth import bearer
from kvlayer.controller.channel import aio_channel, parse_target
from kvlayer.controller.events import EventBuffer
from kvlayer.controller.wire import STAT_FIELDS, namespace_to_wire

log = logging.getLogger(__name__)

BATCH = 8192
"""Digests per snapshot or event message (8192 x 34 bytes stays far below message limits)."""
EVENT_PERIOD_S = 0.05
"""How often buffered events are sent."""
MAX_BUFFERED = 1_000_000
"""Digests buffered before the agent gives up on events and resynchronises."""


def _redis_shared_id(config: KVLayerConfig) -> str:
    """The same Redis (and key prefix) gives the same id, whatever the credentials in the URL."""
    url = urlsplit(config.redis_url or "")
    place = f"{url.scheme}://{url.hostname}:{url.port}{url.path}|{config.redis_key_prefix}|{config.redis_cluster}"
    return "redis-" + hashlib.blake2b(place.encode(), digest_size=8).hexdigest()


SHARED_TIERS = {"redis": _redis_shared_id}
"""Tiers other instances reach too, by name -> the shared store's id for a configuration."""


class ResyncNeeded(Exception):
    """Events were lost (buffer bound reached): reconnect and send a new snapshot."""


class ControllerAgent:
    """Keeps the instance whose kvlayer is ``kv`` registered with the controller at ``url`` (see
    the module docstring).

    ``start()`` returns at once; ``close()`` stops the thread (call it before closing ``kv``).
    ``ValueError`` for a malformed ``url``.
    """

    def __init__(self, kv: KVCacheEngine, url: str, token: str | None = None, *, address: str = "",
                 backoff_s: tuple[float, float] = (0.2, 5.0)) -> None:
        self._kv = kv
        self._target = parse_target(url)
        self._metadata = bearer(token)
        self._address = address
        self._backoff = backoff_s
        self._events = EventBuffer(MAX_BUFFERED)
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread: threading.Thread | None = None
        self._connected = threading.Event()
        self._was_connected = False
        self.last_error: str | None = None
        """Why the last connection attempt failed or ended ("CODE: details"); None before any."""
        self.registrations = 0
        """How many times the agent has registered (and snapshotted); for tests and logs."""

    @property
    def instance_id(self) -> str:
        """The instance id (what it registers as)."""
        return self._kv.instance_id

    @property
    def connected(self) -> bool:
        """Whether the agent is registered and streaming right now."""
        return self._connected.is_set()

    def start(self) -> None:
        """Listen to the tiers and start connecting in the background (idempotent)."""
        if self._thread is not None:
            return
        for backend in self._kv.backends:
            backend.set_listener(self)
        self._thread = threading.Thread(target=self._main, name="kvlayer-controller-agent", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop listening and disconnect; waits up to ``timeout`` s for the thread (idempotent)."""
        for backend in self._kv.backends:
            backend.set_listener(None)
        self._events.record(False)
        if self._thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kvlayer agent: the controller link did not stop within %.1f s", timeout)

    # --- TierListener (called on the I/O loop thread: cheap, never raises) ---------------
    def on_admit(self, tier: str, digests: Sequence[bytes]) -> None:
        """``TierListener``: chunks entered ``tier``."""
        self._events.add(tier, True, digests)

    def on_evict(self, tier: str, digests: Sequence[bytes]) -> None:
        """``TierListener``: chunks left ``tier``."""
        self._events.add(tier, False, digests)

    # --- the background thread ------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._loop.run_until_complete(self._run())
            # A command may still run on a worker thread: ``close()`` returns after it, before
            # the engine it uses is closed.
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
        except Exception:
            log.exception("kvlayer agent: stopped by an unexpected error; the engine goes on without it")
        finally:
            self._loop.close()

    async def _run(self) -> None:
        delay, logged = self._backoff[0], None
        while not self._stop.is_set():
            error = await self._attempt()
            if self._stop.is_set():
                break
            if self._was_connected:
                delay, logged = self._backoff[0], None
            self.last_error = _describe(error) if error is not None else "the stream ended"
            if self.last_error != logged:  # one line per new reason, not one per retry
                log.warning("kvlayer agent: controller %s: %s; retrying with backoff",
                            self._target.address, self.last_error)
                logged = self.last_error
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self._backoff[1])

    async def _attempt(self) -> BaseException | None:
        """One connection, until it fails or the agent stops; returns its error."""
        session = asyncio.ensure_future(self._session())
        stopper = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({session, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        self._was_connected = self.connected
        self._connected.clear()
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
                await call.write(pb.InstanceMessage(register=self._registration()))
                first = await call.read()
                if first is grpc.aio.EOF or first.WhichOneof("body") != "registered":
                    raise ConnectionError("the controller did not acknowledge the registration")
                interval = min(max(first.registered.heartbeat_interval_ms / 1000, 0.05), 60.0)
                snapshot = await asyncio.to_thread(self._kv.snapshot)
                for part in _snapshot_parts(snapshot):
                    await call.write(pb.InstanceMessage(snapshot=part))
                self.registrations += 1
                self._connected.set()
                log.info("kvlayer agent: registered %s with the controller at %s", self.instance_id,
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
                beat = await asyncio.to_thread(self._heartbeat)
                await call.write(pb.InstanceMessage(heartbeat=beat))
                next_beat = time.monotonic() + interval

    async def _read_loop(self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[pb.InstanceMessage]) -> None:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                raise ConnectionError("the controller closed the stream")
            if message.WhichOneof("body") == "command":
                reply = await asyncio.to_thread(run_command, self._kv, message.command)
                outbox.put_nowait(pb.InstanceMessage(reply=reply))

    # --- messages -------------------------------------------------------------------------
    def _registration(self) -> pb.Register:
        kv = self._kv
        pinnable = kv.pinnable_tiers()
        tiers = []
        for backend in sorted(kv.backends, key=lambda b: b.rank):
            shared = SHARED_TIERS.get(backend.name)
            tiers.append(pb.TierInfo(name=backend.name, rank=backend.rank, in_memory=backend.in_memory,
                                     shared_id=shared(kv.config) if shared else "",
                                     cannot_pin=backend.name not in pinnable))
        return pb.Register(instance_id=self.instance_id, address=self._address, tiers=tiers,
                           role=kv.config.instance_role, served_model=kv.config.served_model_name,
                           namespace=namespace_to_wire(kv.namespace, kv.config.save_partial_chunks))

    def _heartbeat(self) -> pb.Heartbeat:
        """Per-tier counters from ``kv.stats()`` (runs on a worker thread)."""
        tiers = []
        for name, values in self._kv.stats().get("tiers", {}).items():
            counts = {k: max(0, int(values.get(k, 0))) for k in STAT_FIELDS}
            healthy = bool(values.get("health", {}).get("healthy", True))
            tiers.append(pb.TierStats(tier=name, healthy=healthy, **counts))
        return pb.Heartbeat(tiers=tiers)


def _snapshot_parts(snapshot: dict[str, list[bytes]]) -> Iterator[pb.SnapshotPart]:
    """The snapshot in parts of at most ``BATCH`` digests; the last one is ``final``."""
    parts = [pb.SnapshotPart(tier=tier, digests=digests[i : i + BATCH])
             for tier, digests in snapshot.items() for i in range(0, len(digests), BATCH)]
    if not parts:
        parts = [pb.SnapshotPart()]
    parts[-1].final = True
    yield from parts


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def start_agent(kv: KVCacheEngine, config: KVLayerConfig, address: str = "") -> ControllerAgent | None:
    """Start an agent for ``kv`` when ``config.controller_url`` is set; None otherwise, or
    (logged) when it cannot start: the engine never fails because of the controller."""
    if not config.controller_url:
        return None
    try:
        agent = ControllerAgent(kv, config.controller_url, config.controller_token, address=address)
        agent.start()
    except Exception:
        log.exception("kvlayer: cannot start the controller agent; running without a controller")
        return None
    return agent
