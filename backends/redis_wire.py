"""The Redis tier's own connections for its reads: RESP over a transport of ours, each value's
bytes received straight into their destination (used by ``backends/redis_reads.py``).

A redis-py asyncio connection reads through a ``StreamReader``: the socket's bytes become a new
``bytes`` in the transport, are appended to the reader's buffer, and are copied out again, all
before the tier could copy them into its chunk (8 chunks of 6 MiB: 171 ms against 47 ms received
in place, docs/benchmarks.md). So the tier reads over connections it opens itself, with asyncio's
public API only: ``open_wire`` calls ``loop.create_connection`` (TCP, TLS) or
``create_unix_connection`` with a ``Wire``, an ``asyncio.BufferedProtocol``, as the protocol from
the start, so the transport receives into whatever buffer ``Wire.get_buffer`` names:

- ``into(dst, landed)``: a value's bytes go into ``dst`` itself; ``landed(lo, hi)`` hears of each
  piece as it lands (the reader hashes it while it is still in cache);
- everything else (length lines, CRLFs, small values) lands in a small scratch window, whose
  size bounds what is copied from it when a value's first bytes arrive with its length line.

A wire is set up as redis-py sets up a connection for the same URL (``parse_url``; TLS with
the context redis-py's own ``SSLConnection`` builds from the URL's options; ``AUTH`` and
``SELECT``), then sends ``PING``: an error reply then (NOAUTH, WRONGPASS) raises
``ConnectionError``, so a connection that cannot read never reaches a chunk. Writes and every
other command stay on redis-py (``backends/redis_clients.py``). ``WirePool`` keeps one event
loop's idle wires. A wire that failed in any way (a broken stream, a dropped connection, a
cancellation) is left mid-reply: it is aborted, never reused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
Landed = Callable[[int, int], None]
"""Told ``(lo, hi)`` when bytes ``[lo, hi)`` of an ``into`` destination arrived, in order."""

WINDOW = 4096
"""Bytes received at once into the scratch buffer: a length line and its value's first bytes."""
MAX_LINE = 64 * 1024
"""A reply line longer than this is a broken stream."""
MAX_IDLE = 8
"""Idle wires a pool keeps; one more comes back closed."""
_SKIP = 1 << 20


class ProtocolError(ConnectionError):
    """The stream holds something other than the expected reply, or ended: the wire cannot be reused."""


def parse_bulk_size(line: bytes) -> int:
    """The size a bulk string's length ``line`` announces, or -1 for a null (RESP2 ``$-1``, RESP3
    ``_``); ProtocolError if it is none."""
    if line == b"_\r\n":
        return -1
    if line[:1] != b"$":
        raise ProtocolError(f"expected a bulk string, got {line[:80]!r}")
    try:
        return max(int(line[1:-2]), -1)
    except ValueError:
        raise ProtocolError(f"bad bulk length in {line[:80]!r}") from None


def pack(commands: Sequence[Sequence[bytes | str | int]]) -> bytes:
    """``commands`` as RESP arrays of bulk strings, back to back."""
    out = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            out += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(out)


class Wire(asyncio.BufferedProtocol):
    """One connection to a Redis server: the transport's protocol, and the coroutine side that
    reads its replies (one coroutine at a time). ``received`` counts the bytes it ever got."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray(WINDOW)
        self._start = self._end = 0
        self._target: memoryview | None = None
        self._filled = 0
        self._landed: Landed | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._skip: memoryview | None = None
        self.eof = False
        self.lost: BaseException | None = None
        self.received = 0

    # --- transport side ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._filled:]
        if len(self._buf) - self._end < WINDOW:
            kept = self._end - self._start
            self._buf[:kept] = self._buf[self._start:self._end]
            self._start, self._end = 0, kept
            if len(self._buf) - kept < WINDOW:
                self._buf.extend(bytes(WINDOW))
        return memoryview(self._buf)[self._end:self._end + WINDOW]

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self._target is None:
            self._end += nbytes
            self._wake()
            return
        lo = self._filled
        self._filled += nbytes
        if self._landed is not None:
            self._landed(lo, self._filled)
        if self._filled == len(self._target):
            self._target = None
            self._wake()  # only now: waking the reader for every piece would cost a task step each

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # nothing more can come: let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc
        self.eof = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- the connection --------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        """Whether the connection is open (the server has not closed it)."""
        return not self.eof and self._transport is not None and not self._transport.is_closing()

    def send(self, commands: Sequence[Sequence[bytes | str | int]]) -> None:
        """Queue ``commands`` on the transport (it sends them as the socket takes them)."""
        if not self.usable:
            raise ProtocolError("the connection is closed")
        assert self._transport is not None
        self._transport.write(pack(commands))

    def abort(self) -> None:
        """Drop the connection now, unread bytes and all (the way out after any failure)."""
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        """Close a connection whose replies were all read."""
        if self._transport is not None:
            self._transport.close()

    async def status(self, *command: bytes | str | int) -> bytes:
        """Send one command whose reply is a status line (``+OK``) and return that line;
        ConnectionError with the server's words for an error reply (e.g. NOAUTH)."""
        self.send([command])
        line = await self.line()
        if line[:1] != b"+":
            name = command[0].decode() if isinstance(command[0], bytes) else str(command[0])
            raise ConnectionError(f"redis {name}: {line[1:-2].decode(errors='replace')[:200]}")
        return line

    # --- reading replies -------------------------------------------------------------------
    async def _more(self) -> None:
        """Wait until the transport calls back (new bytes, end of stream or a lost connection)."""
        if self.eof:
            raise ProtocolError("the server closed the connection mid-reply") from self.lost
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def line(self) -> bytes:
        """The next line, with its CRLF."""
        while (i := self._buf.find(b"\r\n", self._start, self._end)) < 0:
            if self._end - self._start > MAX_LINE:
                raise ProtocolError("a reply line longer than 64 KiB")
            await self._more()
        line = bytes(self._buf[self._start:i + 2])
        self._start = i + 2
        return line

    async def exactly(self, n: int) -> bytes:
        """The next ``n`` bytes (a small value: read through scratch)."""
        while self._end - self._start < n:
            await self._more()
        data = bytes(self._buf[self._start:self._start + n])
        self._start += n
        return data

    async def into(self, dst: memoryview, landed: Landed | None = None) -> None:
        """Fill ``dst`` (a writable byte view) with the next ``len(dst)`` bytes, telling ``landed``
        of each piece as it arrives."""
        take = min(len(dst), self._end - self._start)
        if take:
            with memoryview(self._buf) as buf:
                dst[:take] = buf[self._start:self._start + take]
            self._start += take
            if landed is not None:
                landed(0, take)
        if self._start == self._end:
            self._start = self._end = 0
        if take == len(dst):
            return
        self._target, self._filled, self._landed = dst, take, landed
        try:
            while self._target is not None:
                await self._more()
        finally:
            # a cancelled read must not receive into ``dst`` any longer: the caller frees it
            self._target = self._landed = None

    async def crlf(self) -> None:
        """Read the CRLF ending a value."""
        if await self.exactly(2) != b"\r\n":
            raise ProtocolError("a value not followed by CRLF")

    async def skip(self, n: int) -> None:
        """Drop ``n`` bytes of a value, then the CRLF ending it."""
        if self._skip is None or len(self._skip) < min(n, _SKIP):
            self._skip = memoryview(bytearray(min(n, _SKIP)))
        while n > 0:
            piece = self._skip[:min(n, len(self._skip))]
            await self.into(piece)
            n -= len(piece)
        await self.crlf()


async def open_wire(url: str) -> Wire:
    """A ready ``Wire`` to the server at ``url`` (``redis://``, ``rediss://``, ``unix://``, with
    its ``user:password@``, ``/db`` and TLS options); OSError or ConnectionError if the server
    cannot be reached or refuses it. No deadline of its own: the caller's bounds it."""
    from redis.asyncio.connection import SSLConnection, parse_url

    kwargs: dict[str, Any] = dict(parse_url(url))
    kind = kwargs.pop("connection_class", None)
    loop = asyncio.get_running_loop()
    if "path" in kwargs:
        _, wire = await loop.create_unix_connection(Wire, kwargs["path"])
    else:
        host = kwargs.get("host", "localhost")
        # the context redis-py builds for this URL: the same certificates, checks and defaults
        tls = SSLConnection(**kwargs).ssl_context.get() if kind is SSLConnection else None
        _, wire = await loop.create_connection(Wire, host, kwargs.get("port", 6379), ssl=tls,
                                               server_hostname=host if tls is not None else None)
    try:
        if kwargs.get("password"):
            user = [kwargs["username"]] if kwargs.get("username") else []
            await wire.status(b"AUTH", *user, kwargs["password"])
        if kwargs.get("db"):
            await wire.status(b"SELECT", kwargs["db"])
        await wire.status(b"PING")
    except BaseException:
        wire.abort()
        raise
    return wire


class WirePool:
    """The idle wires to one server of the event loop that uses it (at most ``MAX_IDLE``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._idle: list[Wire] = []
        self._closed = False

    async def run(self, read: Callable[[Wire], Awaitable[T]]) -> T:
        """``await read(wire)`` on an idle wire (or a new one), given back to the pool after.

        On any failure the wire is aborted and the failure raised; but if an idle wire failed
        as a connection (OSError) before any reply byte came, as one the server closed since (a
        restart) does, ``read`` runs once more on a new wire (``read`` must start over on each call).
        """
        wire = self._take()
        if wire is not None:
            before = wire.received
            try:
                return await self._use(wire, read)
            except OSError:  # ConnectionError and ProtocolError too
                if wire.received != before:
                    raise
        return await self._use(await open_wire(self.url), read)

    async def _use(self, wire: Wire, read: Callable[[Wire], Awaitable[T]]) -> T:
        try:
            result = await read(wire)
        except BaseException:
            wire.abort()
            raise
        if wire.usable and not self._closed and len(self._idle) < MAX_IDLE:
            self._idle.append(wire)
        else:
            wire.close()
        return result

    def _take(self) -> Wire | None:
        while self._idle:
            wire = self._idle.pop()
            if wire.usable:
                return wire
            wire.abort()
        return None

    def close(self) -> None:
        """Close the idle wires; a wire in use is closed when its read ends."""
        self._closed = True
        for wire in self._idle:
            wire.close()
        self._idle.clear()
