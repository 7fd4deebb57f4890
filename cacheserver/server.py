"""``CacheServer``: the Unix-socket server in front of one shared arena (docs/architecture.md section 15).

One asyncio loop serves every connection; each is a ``Session`` of the ``ChunkIndex``, ended
(its leases and reservations given back) when the connection closes for any reason. Every
count, size and digest a client sends is checked here or in the index: a frame that breaks the
format (``kvlayer.cacheserver.protocol``) gets an ``ERROR`` reply and closes that connection
only. The socket is created mode 0600 (0660 and the group's, with ``socket_group``, as is the
arena file); with a token, ``HELLO`` must carry it. Each tenant (a chunk's salt tag) holds at
most ``salt_quota`` bytes (``ChunkIndex``); ``metrics`` serves the accounting for Prometheus.
The server verifies its own arena (``Scrubber``): every commit is hashed and sealed, and sealed
chunks are hashed again at ``scrub_rate`` bytes per second.

Run it with ``kvlayer cache-server`` (``kvlayer.cacheserver.cli``).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import hmac
import logging
import os
import socket
import stat
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.arena import ArenaFile
from kvlayer.cacheserver.index import ChunkIndex, Session
from kvlayer.cacheserver.protocol import ErrorCode, Op, ProtocolError
from kvlayer.cacheserver.scrub import Scrubber

if TYPE_CHECKING:
    from kvlayer.cacheserver.lower import LowerTiers
    from kvlayer.cacheserver.metrics import MetricsEndpoint

log = logging.getLogger(__name__)

Handler = Callable[["CacheServer", Session, bytes], bytes | Awaitable[bytes]]


class CacheServer:
    """Serves the arena of ``capacity`` bytes on ``socket_path``; ``token`` (if set) is required.

    ``salt_quota``: the most bytes one tenant holds (None: no bound). ``socket_group``: the group
    given the socket and the arena file (mode 0660). ``metrics``: ``(host, port)`` of a
    Prometheus ``/metrics`` endpoint, bound by ``start``. ``scrub_rate``: bytes per second of
    re-verifying sealed chunks (0: commits are sealed, never re-scrubbed).
    """

    def __init__(self, socket_path: str, capacity: int, token: str | None = None, *,
                 salt_quota: int | None = None, socket_group: str | None = None,
                 metrics: tuple[str, int] | None = None, lower: LowerTiers | None = None,
                 scrub_rate: int = 512 << 20) -> None:
        """Checks its settings (``ValueError``: a size out of range, a group that does not exist)
        and claims the socket path (``ValueError`` if a server answers there) before it creates
        the arena file, since that removes the files earlier servers of this socket left."""
        if capacity <= 0:
            raise ValueError(f"cpu_capacity must be positive, got {capacity}")
        self.socket_path = socket_path
        self.token = (token or "").encode()
        if salt_quota is not None and salt_quota <= 0:
            raise ValueError(f"salt_quota must be positive, got {salt_quota}")
        self._gid = _group_id(socket_group) if socket_group else None
        _claim(socket_path)
        self.arena = ArenaFile.create(socket_path, capacity)
        self.index = ChunkIndex(self.arena.data_offset, capacity, salt_quota)
        try:
            self.scrub = Scrubber(self.index, self.arena.path, self.arena.size, scrub_rate)
        except BaseException:
            self.arena.unlink()
            raise
        self.connections = 0
        self.accepted = 0
        self.refusals: Counter[str] = Counter()
        """Connections closed with an ``ERROR``, by ``ErrorCode`` name in lower case (``bad_token``)."""
        self._server: asyncio.base_events.Server | None = None
        self._metrics: MetricsEndpoint | None = None
        if metrics is not None:
            from kvlayer.cacheserver.metrics import MetricsEndpoint

            self._metrics = MetricsEndpoint(self, *metrics)
        self.lower = lower
        """The server's own NVMe/Redis tiers below the arena (``cacheserver/lower.py``), or None."""
        self.on_announce: Callable[[bytes], None] | None = None
        """Told each namespace a client ``ANNOUNCE``s (the controller link); cheap, never raising."""
        if lower is not None:
            lower.attach(self.arena.path, self.arena.size)

    async def start(self) -> None:
        """Bind the socket (mode 0600, or 0660 of ``socket_group``), then the metrics endpoint
        (``ValueError`` if its port cannot be bound)."""
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=self.socket_path,
                                                           limit=wire.MAX_BODY + wire.FRAME.size)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        if self._gid is not None:  # clients of another user in the group map the arena too
            for path in (self.socket_path, self.arena.path):
                os.chown(path, -1, self._gid)
                os.chmod(path, 0o660)
        self.scrub.start()
        if self._metrics is not None:
            await self._metrics.start()

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then close the socket and remove it and the arena file."""
        try:
            await stop.wait()
        finally:
            if self.lower is not None:
                await self.lower.close()  # the writes under way end first
            self.close()

    def close(self) -> None:
        """Stop listening; remove the socket (if this server bound it) and the arena file."""
        if self._metrics is not None:
            self._metrics.close()
        self.scrub.close()
        if self._server is not None:
            self._server.close()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        self.arena.unlink()

    def stats(self) -> wire.Stats:
        """The accounting ``STATS`` answers."""
        chunks, reserved, leases = self.index.counts()
        return wire.Stats(self.arena.epoch, self.index.capacity, self.index.used, chunks, reserved, leases,
                          self.connections, self.index.evictions, self.index.refused, self.index.sealed,
                          self.index.checksum_errors)

    # --- one connection -----------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = Session()
        self.connections += 1
        self.accepted += 1
        try:
            await self._greet(reader, writer)
            while True:
                op, body = await _read_frame(reader)
                handler = HANDLERS.get(op)
                if handler is None:  # HELLO again, ERROR or an unknown op
                    raise ProtocolError(f"unexpected op {op}")
                try:
                    reply = handler(self, session, body)
                    if not isinstance(reply, bytes):  # it waits on the lower tiers
                        reply = await reply
                except ValueError as e:  # a value the index refuses (a size out of range)
                    raise ProtocolError(str(e)) from None
                writer.write(wire.frame(Op(op), reply))
                await writer.drain()
        except ProtocolError as e:
            log.warning("cache-server: closing a connection: %s", e)
            self.refusals[e.code.name.lower()] += 1
            with contextlib.suppress(ConnectionError):
                writer.write(wire.frame(Op.ERROR, wire.error(e.code, str(e))))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            self.index.end(session)
            self.connections -= 1
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _greet(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        op, body = await _read_frame(reader)
        if op != Op.HELLO:
            raise ProtocolError("the first frame must be HELLO", ErrorCode.NOT_HELLO)
        version, token = wire.parse_hello(body)
        if version != wire.VERSION:
            raise ProtocolError(f"protocol version {version}, this server speaks {wire.VERSION}",
                                ErrorCode.BAD_VERSION)
        if not hmac.compare_digest(token, self.token):
            raise ProtocolError("wrong cache_server_token", ErrorCode.BAD_TOKEN)
        a = self.arena
        writer.write(wire.frame(Op.HELLO, wire.welcome(wire.Welcome(wire.VERSION, a.epoch, a.size,
                                                                    a.data_offset, a.path))))
        await writer.drain()


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    op, length = wire.parse_header(await reader.readexactly(wire.FRAME.size))
    return op, await reader.readexactly(length)


def _group_id(name: str) -> int:
    """The id of group ``name``; ``ValueError`` (one line) if there is none."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"--socket-group {name}: no such group") from None


def _claim(path: str) -> None:
    """Make ``path`` free for a new socket: remove a stale socket nobody answers on;
    ``ValueError`` if a server answers there or it is something other than a socket."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"--socket {path}: exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # left by a server that died
        return
    finally:
        probe.close()
    raise ValueError(f"--socket {path}: another cache server is listening there")


# --- the ops (registry: op -> handler) -------------------------------------------------------
def _lookup(server: CacheServer, session: Session, body: bytes) -> bytes | Awaitable[bytes]:
    keys = wire.parse_keys(body)
    n = server.index.lookup(keys)
    if server.lower is None or n == len(keys):
        return wire.count(n)
    return _count_lower(server.lower, n, keys[n:])


async def _count_lower(lower: LowerTiers, n: int, rest: list[wire.Key]) -> bytes:
    return wire.count(n + await lower.count(rest))


def _reserve(server: CacheServer, session: Session, body: bytes) -> bytes:
    return wire.slots(server.index.reserve(session, wire.parse_reserve(body)))


def _commit(server: CacheServer, session: Session, body: bytes) -> bytes:
    items = wire.parse_commit(body)
    fresh = [d for d, _ in items if d in session.reserved]
    n = server.index.commit(session, items)
    server.scrub.wake()
    if server.lower is not None:
        server.lower.write_through(server.index, fresh)
    return wire.count(n)


def _lease(server: CacheServer, session: Session, body: bytes) -> bytes | Awaitable[bytes]:
    items = wire.parse_reserve(body)
    leases = server.index.lease(session, [item.key for item in items])
    if server.lower is None or all(x.status is not wire.Status.MISSING for x in leases):
        return wire.leases(leases)
    return _promote(server, server.lower, session, items, leases)


async def _promote(server: CacheServer, lower: LowerTiers, session: Session, items: list[wire.Reserve],
                   leases: list[wire.Lease]) -> bytes:
    out = await lower.promote(server.index, session, items, leases)
    server.scrub.wake()  # promoted chunks are sealed: the re-scrub has them in line now
    return wire.leases(out)


def _release(server: CacheServer, session: Session, body: bytes) -> bytes:
    return wire.count(server.index.release(session, wire.parse_digests(body)))


def _remove(server: CacheServer, session: Session, body: bytes) -> bytes:
    return wire.count(server.index.remove(wire.parse_digests(body)))


def _announce(server: CacheServer, session: Session, body: bytes) -> bytes:
    if not 0 < len(body) <= wire.MAX_NAMESPACE:  # its content is the controller link's to check
        raise ProtocolError(f"an announced namespace has {len(body)} bytes, 1..{wire.MAX_NAMESPACE} allowed")
    if server.on_announce is not None:
        server.on_announce(body)
    return wire.count(1)


def _stats(server: CacheServer, session: Session, body: bytes) -> bytes:
    wire.parse_empty(body)
    return wire.stats(server.stats())


def _tenants(server: CacheServer, session: Session, body: bytes) -> bytes:
    wire.parse_empty(body)
    return wire.tenants(server.index.quota or 0, server.index.tenants()[:wire.MAX_ITEMS])


HANDLERS: dict[int, Handler] = {Op.LOOKUP: _lookup, Op.RESERVE: _reserve, Op.COMMIT: _commit, Op.LEASE: _lease,
                                Op.RELEASE: _release, Op.REMOVE: _remove, Op.STATS: _stats, Op.TENANTS: _tenants,
                                Op.ANNOUNCE: _announce}
