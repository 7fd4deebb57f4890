"""``CacheServer``: the Unix-socket server in front of one shared arena (docs/architecture.md section 15).

One asyncio loop serves every connection; each is a ``Session`` of the ``ChunkIndex``, ended
(its leases and reservations given back) when the connection closes for any reason. Every
count, size and digest a client sends is checked here or in the index: a frame that breaks the
format (``kvlayer.cacheserver.protocol``) gets an ``ERROR`` reply and closes that connection
only. The socket is created mode 0600; with a token, ``HELLO`` must carry it.

Run it with ``kvlayer cache-server`` (``kvlayer.cacheserver.cli``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import stat
from collections.abc import Callable

from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.arena import ArenaFile
from kvlayer.cacheserver.index import ChunkIndex, Session
from kvlayer.cacheserver.protocol import ErrorCode, Op, ProtocolError

log = logging.getLogger(__name__)

Handler = Callable[["CacheServer", Session, bytes], bytes]


class CacheServer:
    """Serves the arena of ``capacity`` bytes on ``socket_path``; ``token`` (if set) is required."""

    def __init__(self, socket_path: str, capacity: int, token: str | None = None) -> None:
        """Claims the socket path (``ValueError`` if a server answers there) before it creates
        the arena file, since that removes the files earlier servers of this socket left."""
        if capacity <= 0:
            raise ValueError(f"cpu_capacity must be positive, got {capacity}")
        self.socket_path = socket_path
        self.token = (token or "").encode()
        _claim(socket_path)
        self.arena = ArenaFile.create(socket_path, capacity)
        self.index = ChunkIndex(self.arena.data_offset, capacity)
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        """Bind the socket (mode 0600)."""
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=self.socket_path,
                                                           limit=wire.MAX_BODY + wire.FRAME.size)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then close the socket and remove it and the arena file."""
        try:
            await stop.wait()
        finally:
            self.close()

    def close(self) -> None:
        """Stop listening; remove the socket (if this server bound it) and the arena file."""
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
                          self.connections, self.index.evictions, self.index.refused)

    # --- one connection -----------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = Session()
        self.connections += 1
        try:
            await self._greet(reader, writer)
            while True:
                op, body = await _read_frame(reader)
                handler = HANDLERS.get(op)
                if handler is None:  # HELLO again, ERROR or an unknown op
                    raise ProtocolError(f"unexpected op {op}")
                try:
                    reply = handler(self, session, body)
                except ValueError as e:  # a value the index refuses (a size out of range)
                    raise ProtocolError(str(e)) from None
                writer.write(wire.frame(Op(op), reply))
                await writer.drain()
        except ProtocolError as e:
            log.warning("cache-server: closing a connection: %s", e)
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
def _lookup(server: CacheServer, session: Session, body: bytes) -> bytes:
    return wire.count(server.index.lookup(wire.parse_keys(body)))


def _reserve(server: CacheServer, session: Session, body: bytes) -> bytes:
    return wire.slots(server.index.reserve(session, wire.parse_reserve(body)))


def _commit(server: CacheServer, session: Session, body: bytes) -> bytes:
    return wire.count(server.index.commit(session, wire.parse_commit(body)))


def _lease(server: CacheServer, session: Session, body: bytes) -> bytes:
    return wire.leases(server.index.lease(session, wire.parse_keys(body)))


def _release(server: CacheServer, session: Session, body: bytes) -> bytes:
    return wire.count(server.index.release(session, wire.parse_digests(body)))


def _remove(server: CacheServer, session: Session, body: bytes) -> bytes:
    return wire.count(server.index.remove(wire.parse_digests(body)))


def _stats(server: CacheServer, session: Session, body: bytes) -> bytes:
    wire.parse_empty(body)
    return wire.stats(server.stats())


HANDLERS: dict[int, Handler] = {Op.LOOKUP: _lookup, Op.RESERVE: _reserve, Op.COMMIT: _commit, Op.LEASE: _lease,
                                Op.RELEASE: _release, Op.REMOVE: _remove, Op.STATS: _stats}
