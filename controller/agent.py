"""``ControllerAgent``: an engine instance's link to the controller, from a background thread.

The connector starts one when ``controller_url`` is set (``start_agent``). The agent runs its
own asyncio loop in a daemon thread: it connects (bearer token ``controller_token``),
registers the instance (id, address, role, served model name, key namespace, tiers), sends a
snapshot of the chunk digests each tier holds, then streams the tiers' admission and eviction
events (it is the backends' ``TierListener``) and a heartbeat with per-tier counters, and carries
out the commands the controller sends (``agent_commands``), answering each on the same stream.

When the controller is away the engine keeps serving: the agent retries with exponential
backoff (with jitter) and, once back, registers and snapshots again, so the controller's
registry is rebuilt (the stream itself is ``instance_link.InstanceLink``, shared with the node
cache server's link). A tier that another process reports (``shared_tiers.REPORTED_ELSEWHERE``:
the ``cache`` tier, which the cache server registers itself) is registered with its shared id,
but its chunks are left out of the snapshot and the events. Nothing here blocks or raises into
the engine: the listener callbacks only append to a bounded buffer (past its bound the agent
resynchronises with a new snapshot), and every failure is logged and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.config import KVLayerConfig
from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.agent_commands import run_command
from kvlayer.controller.auth import bearer
from kvlayer.controller.channel import parse_target
from kvlayer.controller.events import EventBuffer
from kvlayer.controller.instance_link import MAX_BUFFERED, InstanceLink
from kvlayer.controller.shared_tiers import REPORTED_ELSEWHERE, SHARED_TIERS
from kvlayer.controller.wire import STAT_FIELDS, namespace_to_wire

log = logging.getLogger(__name__)


class ControllerAgent:
    """Keeps the instance whose kvlayer is ``kv`` registered with the controller at ``url`` (see
    the module docstring).

    ``start()`` returns at once; ``close()`` stops the thread (call it before closing ``kv``).
    ``ValueError`` for a malformed ``url``.
    """

    def __init__(self, kv: KVCacheEngine, url: str, token: str | None = None, *, address: str = "",
                 backoff_s: tuple[float, float] = (0.2, 5.0)) -> None:
        self._kv = kv
        self._address = address
        self._events = EventBuffer(MAX_BUFFERED)
        self._link = InstanceLink(self, parse_target(url), bearer(token), self._events, backoff_s)
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread: threading.Thread | None = None

    @property
    def last_error(self) -> str | None:
        """Why the last connection attempt failed or ended ("CODE: details"); None before any."""
        return self._link.last_error

    @property
    def registrations(self) -> int:
        """How many times the agent has registered (and snapshotted); for tests and logs."""
        return self._link.registrations

    @property
    def instance_id(self) -> str:
        """The instance id (what it registers as)."""
        return self._kv.instance_id

    @property
    def connected(self) -> bool:
        """Whether the agent is registered and streaming right now."""
        return self._link.connected

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
        if tier not in REPORTED_ELSEWHERE:
            self._events.add(tier, True, digests)

    def on_evict(self, tier: str, digests: Sequence[bytes]) -> None:
        """``TierListener``: chunks left ``tier``."""
        if tier not in REPORTED_ELSEWHERE:
            self._events.add(tier, False, digests)

    # --- the background thread ------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._loop.run_until_complete(self._link.run(self._stop))
            # A command may still run on a worker thread: ``close()`` returns after it, before
            # the engine it uses is closed.
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
        except Exception:
            log.exception("kvlayer agent: stopped by an unexpected error; the engine goes on without it")
        finally:
            self._loop.close()

    # --- InstanceSource (on the agent's loop; the engine's calls run on worker threads) ---
    async def snapshot(self) -> dict[str, list[bytes]]:
        """``InstanceSource``: the engine's tiers' digests (not those another process reports)."""
        snapshot = await asyncio.to_thread(self._kv.snapshot)
        return {tier: digests for tier, digests in snapshot.items() if tier not in REPORTED_ELSEWHERE}

    async def heartbeat(self) -> pb.Heartbeat:
        """``InstanceSource``: per-tier counters from ``kv.stats()``."""
        return await asyncio.to_thread(self._heartbeat)

    async def command(self, command: pb.Command) -> pb.CommandReply:
        """``InstanceSource``: ``agent_commands.run_command`` on a worker thread."""
        return await asyncio.to_thread(run_command, self._kv, command)

    # --- messages -------------------------------------------------------------------------
    def registration(self) -> pb.Register:
        """``InstanceSource``: the instance, its namespace and its tiers (a shared one with its
        store's id, ``shared_tiers.SHARED_TIERS``)."""
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
