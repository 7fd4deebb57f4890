"""The Redis tier's one reply reader: ``recv_into`` straight into each value's destination
(used by ``backends/redis_reads.py`` for whole-chunk and layer-group reads).

A redis-py asyncio connection reads through a ``StreamReader``: the socket's bytes become a new
``bytes`` in the transport, are appended to the reader's buffer, and ``read(n)`` copies them out
again before the tier copies them into its chunk. ``switched_replies(conn)`` instead installs a
``BufferedProtocol`` of ours on the connection's transport (selector and SSL transports both hand
a buffered protocol a buffer to receive into) for the duration of one batch of replies:

- ``into(dst, hasher)`` makes the transport receive a value's bytes into ``dst`` itself, each
  piece hashed as it lands, while it is still in cache;
- everything else (length lines, CRLFs, small values) lands in a small scratch window, whose
  size bounds what is copied from it when a value's first bytes arrive with its length line.

On leaving, the original protocol is put back and the bytes received past the last reply read
(none in a well-formed exchange) go back into the ``StreamReader``; an end of stream or a lost
connection seen meanwhile is passed on to it, so redis-py sees the connection as it would have.
The caller must drop the connection on any error: it is left mid-reply.

``switched_replies`` relies on CPython's ``StreamReader`` internals (see ``supported``); where
they are missing (``SUPPORTED`` false) the tier reads through redis-py's own reply parser.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

WINDOW = 4096
"""Bytes received at once into the scratch buffer: a length line and its value's first bytes."""
MAX_LINE = 64 * 1024
"""A reply line longer than this is a broken stream."""
_SKIP = 1 << 20
_INTERNALS = ("_buffer", "_eof", "_maybe_resume_transport", "feed_data", "feed_eof")


class ProtocolError(ConnectionError):
    """The connection's stream holds something other than the expected reply: it cannot be reused."""


def supported(reader: type = asyncio.StreamReader) -> bool:
    """Whether the StreamReader class ``reader`` has the internals ``switched_replies`` uses: its
    methods, and the buffer and end-of-stream flag its ``__init__`` sets (read without making one,
    which would need an event loop)."""
    init = getattr(reader.__init__, "__code__", None)
    names = set(dir(reader)) | set(init.co_names if init is not None else ())
    return all(name in names for name in _INTERNALS)


SUPPORTED = supported()
"""Whether this Python's StreamReader can hand its connection to ``switched_replies``."""


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


class BufferedReplies(asyncio.BufferedProtocol):
    """The connection's protocol while a batch of replies is read; its coroutine side reads them.

    Only one coroutine reads at a time. The transport calls ``get_buffer``/``buffer_updated``
    between its awaits: into the current ``into`` destination if there is one, else into scratch.
    """

    def __init__(self, original: asyncio.BaseProtocol, buffered: bytes, eof: bool) -> None:
        self.original = original
        self._buf = bytearray(buffered) + bytearray(WINDOW)
        self._start, self._end = 0, len(buffered)
        self._target: memoryview | None = None
        self._filled = 0
        self._hasher: Any = None
        self._waiter: asyncio.Future[None] | None = None
        self.eof = eof
        self.lost: tuple[BaseException | None] | None = None
        self._skip: memoryview | None = None

    # --- transport side ------------------------------------------------------------------
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
        if self._target is not None:
            if self._hasher is not None:
                self._hasher.update(self._target[self._filled:self._filled + nbytes])
            self._filled += nbytes
            if self._filled == len(self._target):
                self._target = None
                self._wake()  # only now: waking the reader for every piece would cost a task step each
        else:
            self._end += nbytes
            self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # nothing more can come: let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = (exc,)
        self.eof = True
        self._wake()

    def pause_writing(self) -> None:
        self.original.pause_writing()

    def resume_writing(self) -> None:
        self.original.resume_writing()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- reader side ---------------------------------------------------------------------
    async def _more(self) -> None:
        """Wait until the transport calls back (new bytes, end of stream or a lost connection)."""
        if self.eof:
            error = self.lost[0] if self.lost else None
            raise ProtocolError("the server closed the connection mid-reply") from error
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

    async def bulk_size(self) -> int:
        """Read a bulk string's length line: its size, or -1 for a null."""
        return parse_bulk_size(await self.line())

    async def exactly(self, n: int) -> bytes:
        """The next ``n`` bytes (a small value: read through scratch)."""
        while self._end - self._start < n:
            await self._more()
        data = bytes(self._buf[self._start:self._start + n])
        self._start += n
        return data

    async def into(self, dst: memoryview, hasher: Any = None) -> None:
        """Fill ``dst`` (a writable byte view) with the next ``len(dst)`` bytes, feeding them to ``hasher``."""
        take = min(len(dst), self._end - self._start)
        if take:
            with memoryview(self._buf) as buf:
                dst[:take] = buf[self._start:self._start + take]
            if hasher is not None:
                hasher.update(dst[:take])
            self._start += take
        if self._start == self._end:
            self._start = self._end = 0
        if take == len(dst):
            return
        self._target, self._filled, self._hasher = dst, take, hasher
        try:
            while self._target is not None:
                await self._more()
        finally:
            self._target = self._hasher = None

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

    def leftover(self) -> bytes:
        """The bytes received but not read (past the last reply read)."""
        return bytes(self._buf[self._start:self._end])


@contextmanager
def switched_replies(conn: Any) -> Iterator[BufferedReplies]:
    """Read replies on the redis-py asyncio connection ``conn`` through a ``BufferedReplies``.

    Takes the bytes ``conn``'s ``StreamReader`` holds first; gives the stream back, with any bytes
    not read and any end of stream or lost connection, on leaving (also on an error).
    """
    stream: asyncio.StreamReader = conn._reader
    transport: Any = conn._writer.transport
    if (error := stream.exception()) is not None:
        raise ProtocolError("the connection failed before its replies were read") from error
    ours = BufferedReplies(transport.get_protocol(), bytes(stream._buffer), stream._eof)  # type: ignore[attr-defined]
    stream._buffer.clear()  # type: ignore[attr-defined]
    transport.set_protocol(ours)
    stream._maybe_resume_transport()  # type: ignore[attr-defined]  # it may have paused reading when full
    try:
        yield ours
    finally:
        transport.set_protocol(ours.original)
        _give_back(stream, ours)


def _give_back(stream: asyncio.StreamReader, ours: BufferedReplies) -> None:
    """Return to ``stream`` what ``ours`` received and did not read, then what ended the connection."""
    leftover = ours.leftover()
    if stream._eof:  # type: ignore[attr-defined]  # it ended before the switch: feed_data would refuse
        stream._buffer.extend(leftover)  # type: ignore[attr-defined]
    elif leftover:
        stream.feed_data(leftover)
    if ours.lost is not None:
        ours.original.connection_lost(ours.lost[0])  # the transport told ours only: its own protocol must learn
    elif ours.eof:
        stream.feed_eof()
