"""``ServerLink``: the node cache server's own link to the controller (docs/architecture.md section 15).

``kvlayer cache-server --controller-url URL`` starts one on the server's event loop. The server
sees only digests, while the controller computes keys from a namespace (model, fingerprint,
layout, TP rank, salt): so each engine client ``ANNOUNCE``s its namespace when it connects, and
the server registers once per namespace it has seen (at most ``MAX_NAMESPACES``), as instance
``<server id>/<model>-tp<rank>-<hash>`` of role ``cache-server`` and address the socket path.
Each registration is an ``InstanceLink`` (the engine agent's stream, backoff and resync):

- tiers: the arena ``cache`` (shared id ``shared_tiers.cache_server_shared_id``, hosted), the
  lower tiers (NVMe: hosted under the arena's id plus ``-nvme``; Redis: the id every instance of
  that Redis reports). Engine clients register their ``cache`` tier under the same shared id, so
  the controller knows which instances reach the server's arena (routing); and the registry
  empties a hosted pool when the server's last registration goes down.
- snapshot: the arena's committed digests and each lower tier's; then the index's and the lower
  tiers' admissions and evictions (``ChunkIndex.listener``, the backends' ``TierListener``), the
  same for every registration (the registry keeps a pool's digests once).
- heartbeat: per-tier counters; commands: ``controller_commands.ServerTiers``.

Nothing here blocks the loop for long or raises into the server: a bad namespace is logged
once and ignored; a controller away is retried with backoff.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import socket
from collections.abc import Sequence

from kvlayer.cacheserver.controller_commands import ARENA, ServerTiers
from kvlayer.cacheserver.server import CacheServer
from kvlayer.config import KVLayerConfig
from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.auth import bearer
from kvlayer.controller.channel import parse_target
from kvlayer.controller.events import EventBuffer
from kvlayer.controller.instance_link import MAX_BUFFERED, InstanceLink
from kvlayer.controller.shared_tiers import SHARED_TIERS, cache_server_shared_id
from kvlayer.controller.wire import CACHE_SERVER_ROLE, namespace_from_wire
from kvlayer.keys import ChunkKey, chunk_keys

log = logging.getLogger(__name__)

MAX_NAMESPACES = 64
"""Namespaces registered at most (a misbehaving client cannot make the server register more)."""
LISTING_TIMEOUT_S = 30.0
"""How long a lower tier's listing (a Redis scan) may take before the snapshot leaves it empty."""


class ServerLink:
    """Registers the ``server``'s tiers with the controller at ``url`` under every namespace its
    clients announce (see the module docstring). ``start()`` and ``close()`` run on the server's
    loop. ``ValueError`` for a malformed ``url``."""

    def __init__(self, server: CacheServer, url: str, token: str | None = None, *,
                 config: KVLayerConfig | None = None, server_id: str | None = None,
                 backoff_s: tuple[float, float] = (0.2, 5.0)) -> None:
        self.server = server
        self.config = config or KVLayerConfig()
        self._target = parse_target(url)
        self._metadata = bearer(token)
        self._backoff = backoff_s
        self.shared_id = cache_server_shared_id(server.socket_path)
        self.server_id = server_id or f"{socket.gethostname()}-{self.shared_id}"
        self.tiers = ServerTiers(server.index, server.lower)
        self.registrations: dict[bytes, Registration] = {}
        """Announced namespace (its wire bytes) -> its registration."""
        self.refused = 0
        """Announcements not registered: malformed, or past ``MAX_NAMESPACES``."""
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Listen to the arena, the lower tiers and the clients' announcements."""
        self.server.index.listener = self._on_index
        for backend in self.tiers.lower.values():
            backend.set_listener(self)
        self.server.on_announce = self.announce

    async def close(self) -> None:
        """Stop listening, end every registration's stream and undo the arena pins."""
        self.server.on_announce = None
        self.server.index.listener = None
        for backend in self.tiers.lower.values():
            backend.set_listener(None)
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.tiers.release_pins()

    @property
    def connected(self) -> int:
        """How many registrations are streaming now."""
        return sum(r.link.connected for r in self.registrations.values())

    # --- namespaces ---------------------------------------------------------------------
    def announce(self, raw: bytes) -> None:
        """A client announced namespace ``raw``: register it, the first time (never raises)."""
        if raw in self.registrations:
            return
        try:
            if len(self.registrations) >= MAX_NAMESPACES:
                raise ValueError(f"this server registers at most {MAX_NAMESPACES} namespaces")
            msg = pb.ModelNamespace.FromString(raw)
            namespace_from_wire(msg)  # RequestError (a ValueError-like) for a bad one
            registration = Registration(self, msg)
        except Exception as e:  # a client's bad namespace costs only its own registration
            self.refused += 1
            log.log(logging.DEBUG if self.refused > 1 else logging.WARNING,
                    "cache-server: an announced namespace is not registered: %s", getattr(e, "message", e))
            return
        self.registrations[raw] = registration
        self._tasks.append(asyncio.ensure_future(registration.link.run(self._stop)))
        log.info("cache-server: registering namespace %s with the controller as %s", msg.model_name,
                 registration.instance_id)

    # --- listeners (on the server's loop: cheap, never raise) ---------------------------------
    def _on_index(self, admitted: bool, digests: Sequence[bytes]) -> None:
        for r in self.registrations.values():
            r.events.add(ARENA, admitted, digests)

    def on_admit(self, tier: str, digests: Sequence[bytes]) -> None:
        """``TierListener``: chunks entered lower tier ``tier``."""
        for r in self.registrations.values():
            r.events.add(tier, True, digests)

    def on_evict(self, tier: str, digests: Sequence[bytes]) -> None:
        """``TierListener``: chunks left lower tier ``tier``."""
        for r in self.registrations.values():
            r.events.add(tier, False, digests)

    # --- what every registration sends ------------------------------------------------------
    def tier_infos(self) -> list[pb.TierInfo]:
        """The server's tiers as it registers them (see the module docstring)."""
        pinnable = self.tiers.pinnable()
        out = [pb.TierInfo(name=ARENA, rank=10, in_memory=True, shared_id=self.shared_id, hosted=True)]
        for name, backend in self.tiers.lower.items():
            shared = SHARED_TIERS.get(name)
            out.append(pb.TierInfo(name=name, rank=backend.rank, in_memory=backend.in_memory,
                                   shared_id=shared(self.config) if shared else f"{self.shared_id}-{name}",
                                   hosted=shared is None, cannot_pin=name not in pinnable))
        return out

    async def snapshot(self) -> dict[str, list[bytes]]:
        """The digests of the arena and of each lower tier (a listing that fails is left empty, logged)."""
        out = {ARENA: self.server.index.committed()}
        for name, backend in self.tiers.lower.items():
            try:
                out[name] = list(backend.keys() if backend.in_memory else await asyncio.wait_for(
                    asyncio.to_thread(backend.keys), LISTING_TIMEOUT_S))
            except Exception as e:
                log.warning("cache-server: listing tier %s for the controller failed: %r", name, e)
                out[name] = []
        return out

    def heartbeat(self) -> pb.Heartbeat:
        """Per-tier counters: the arena's from its index, each lower tier's from its backend."""
        index = self.server.index
        answers = index.answers
        tiers = [pb.TierStats(tier=ARENA, healthy=True, used_bytes=index.used, capacity_bytes=index.capacity,
                              lookup_chunks=answers["lookup_hit"] + answers["lookup_miss"],
                              lookup_hit_chunks=answers["lookup_hit"], get_chunks=answers["lease_hit"],
                              evictions=index.evictions, errors=getattr(index, "checksum_errors", 0))]
        lower = {t.backend.name: t for t in self.server.lower.tiers} if self.server.lower else {}
        for name, backend in self.tiers.lower.items():
            used, capacity = backend.usage()
            stats = backend.stats()
            tiers.append(pb.TierStats(tier=name, healthy=lower[name].up, used_bytes=max(0, used),
                                      capacity_bytes=max(0, capacity),
                                      evictions=max(0, int(stats.get("evictions", 0))),
                                      errors=max(0, int(stats.get("errors", 0))),
                                      timeouts=max(0, int(stats.get("timeouts", 0)))))
        return pb.Heartbeat(tiers=tiers)


class Registration:
    """One namespace's registration: an ``InstanceSource`` over the server's ``ServerLink``."""

    def __init__(self, owner: ServerLink, namespace: pb.ModelNamespace) -> None:
        self._owner = owner
        self._wire = namespace
        self._namespace, self._partial = namespace_from_wire(namespace)
        self.instance_id = _instance_id(owner.server_id, namespace)
        self.events = EventBuffer(MAX_BUFFERED)
        self.link = InstanceLink(self, owner._target, owner._metadata, self.events, owner._backoff,
                                 name="cache-server")

    def keys(self, token_ids: list[int], salt: str | None) -> list[ChunkKey]:
        """The chunk keys of ``token_ids`` in this namespace (``salt`` None: its default)."""
        return chunk_keys(self._namespace.with_salt(salt), token_ids, self._partial)

    def registration(self) -> pb.Register:
        """``InstanceSource``: the server under this namespace."""
        return pb.Register(instance_id=self.instance_id, address=self._owner.server.socket_path,
                           namespace=self._wire, tiers=self._owner.tier_infos(), role=CACHE_SERVER_ROLE)

    async def snapshot(self) -> dict[str, list[bytes]]:
        """``InstanceSource``: every tier's digests."""
        return await self._owner.snapshot()

    async def heartbeat(self) -> pb.Heartbeat:
        """``InstanceSource``: the server's counters."""
        return self._owner.heartbeat()

    async def command(self, command: pb.Command) -> pb.CommandReply:
        """``InstanceSource``: ``ServerTiers.run`` with this namespace's keys."""
        return await self._owner.tiers.run(command, self.keys)


def _instance_id(server_id: str, ns: pb.ModelNamespace) -> str:
    """``<server id>/<model>-tp<rank>-<hash of the namespace>``, within the controller's 128 characters."""
    tag = hashlib.blake2b(ns.SerializeToString(deterministic=True), digest_size=4).hexdigest()
    model = re.sub(r"[^A-Za-z0-9._-]", "_", ns.model_name)[:40]
    return f"{server_id[:64]}/{model}-tp{ns.tp_rank}-{tag}"


def start_link(server: CacheServer, config: KVLayerConfig, url: str, token: str | None) -> ServerLink | None:
    """A started ``ServerLink`` (on the running loop), or None, logged, when it cannot start: the
    server never fails because of the controller."""
    try:
        link = ServerLink(server, url, token, config=config, server_id=config.instance_id)
        link.start()
    except Exception:
        log.exception("cache-server: cannot start the controller link; serving without a controller")
        return None
    log.info("cache-server: linked to the controller at %s as %s", url, link.server_id)
    return link
