"""A blocking client of the cache server's protocol, for ``kvlayer cache-server --stats`` and tests.

It speaks the control messages only (the engine-side tier, ``kvlayer.cacheserver.tier``, also
maps the arena and moves the bytes). One request at a time; ``ConnectionError`` when the server
closes the connection or answers ``ERROR`` (``ServerError``, which names its code).
"""

from __future__ import annotations

import socket

from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.protocol import Op


class ServerError(ConnectionError):
    """The server answered ``ERROR`` (and closed the connection)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"cache server error {code}: {message}")
        self.code = code


class SyncClient:
    """One connection to the server at ``socket_path``, greeted with ``token``; a context manager."""

    def __init__(self, socket_path: str, token: str | None = None, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(socket_path)
            self.welcome = wire.parse_welcome(self.call(Op.HELLO, wire.hello(token)))
        except BaseException:
            self.sock.close()
            raise

    def call(self, op: Op, body: bytes = b"") -> bytes:
        """Send one request and return its reply's body."""
        self.sock.sendall(wire.frame(op, body))
        got, length = wire.parse_header(self.read(wire.FRAME.size))
        reply = self.read(length)
        if got == Op.ERROR:
            raise ServerError(*wire.parse_error(reply))
        if got != op:
            raise wire.ProtocolError(f"reply op {got} to {op.name}")
        return reply

    def read(self, n: int) -> bytes:
        """Exactly ``n`` bytes; ``ConnectionError`` if the server closes first."""
        out = bytearray()
        while len(out) < n:
            piece = self.sock.recv(n - len(out))
            if not piece:
                raise ConnectionError("the cache server closed the connection")
            out += piece
        return bytes(out)

    def stats(self) -> wire.Stats:
        """The server's accounting."""
        return wire.parse_stats(self.call(Op.STATS))

    def lookup(self, keys: list[wire.Key]) -> int:
        """How many leading ``keys`` the server holds."""
        return wire.parse_count(self.call(Op.LOOKUP, wire.keys(keys)))

    def reserve(self, items: list[tuple[wire.Key, int]]) -> list[wire.Slot]:
        """Ranges for the (key, size) items (see ``ChunkIndex.reserve``)."""
        return wire.parse_slots(self.call(Op.RESERVE, wire.reserve(items)))

    def commit(self, items: list[tuple[bytes, int]]) -> int:
        """Commit this connection's reservations; how many it committed."""
        return wire.parse_count(self.call(Op.COMMIT, wire.commit(items)))

    def lease(self, items: list[wire.Key] | list[wire.Reserve]) -> list[wire.Lease]:
        """A lease per held key (``MISSING`` for the others), kept until released or closed. A
        bare key is of size 0 (not known: only the arena answers it) and the default tenant."""
        wanted = [x if isinstance(x, wire.Reserve) else wire.Reserve(x, 0) for x in items]
        return wire.parse_leases(self.call(Op.LEASE, wire.reserve(wanted)))

    def release(self, digests: list[bytes]) -> int:
        """Give back one lease (or reservation) per digest; how many were released."""
        return wire.parse_count(self.call(Op.RELEASE, wire.digests(digests)))

    def close(self) -> None:
        """Close the connection (the server then releases all its claims)."""
        self.sock.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
