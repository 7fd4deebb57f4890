"""Tests of ``backends/redis_replies.py``, the Redis tier's reply reader: replies received
straight into their destination while our protocol is installed, and the connection handed back
intact (or failed) afterwards; which StreamReaders it can run on.

The tests talk to a tiny asyncio server that sends the bytes the test wants (no Redis needed;
``served`` and ``sending`` are also used by ``test_redis_reads.py``). Reads through the tier
from real servers, over TLS too, are in ``test_redis_reads.py``.

Run: ``.venv/bin/python -m pytest tests/backends/test_redis_replies.py``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import xxhash

from kvlayer.backends.redis_replies import (
    WINDOW,
    BufferedReplies,
    ProtocolError,
    parse_bulk_size,
    supported,
    switched_replies,
)


@dataclass
class Conn:
    """The two attributes of a redis-py connection ``switched_replies`` uses."""

    _reader: asyncio.StreamReader
    _writer: asyncio.StreamWriter


Serve = Callable[[asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def served(serve: Serve) -> AsyncIterator[Conn]:
    """A connection to a server that runs ``serve(writer)`` for it (then keeps it open until the test ends)."""
    done = asyncio.Event()

    async def handle(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve(writer)
        await done.wait()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    try:
        yield Conn(reader, writer)
    finally:
        done.set()
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 2)
        server.close()
        await server.wait_closed()


def sending(*pieces: bytes, close: bool = False) -> Serve:
    async def serve(writer: asyncio.StreamWriter) -> None:
        for p in pieces:
            writer.write(p)
            await writer.drain()
        if close:
            writer.close()

    return serve


def run(main: Awaitable[None]) -> None:
    """Run a test's coroutine; a read waiting for bytes that never come fails it instead of hanging."""
    asyncio.run(asyncio.wait_for(main, 10))


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n" % len(value) + value + b"\r\n"


async def buffered(conn: Conn, n: int) -> None:
    """Wait until ``conn``'s stream holds ``n`` bytes (or more), before any switch."""
    for _ in range(500):
        if len(conn._reader._buffer) >= n:  # type: ignore[attr-defined]
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the bytes never arrived")


async def read_bulk(replies: BufferedReplies) -> tuple[bytes, int]:
    """A bulk reply received into memory of its own, and its xxh3."""
    size = int((await replies.line())[1:-2])
    out, hasher = bytearray(size), xxhash.xxh3_64()
    await replies.into(memoryview(out), hasher)
    await replies.crlf()
    return bytes(out), hasher.intdigest()


def test_values_land_in_place_and_are_hashed() -> None:
    values = [os.urandom(3 * WINDOW + 5), os.urandom(2 << 20), b"", os.urandom(17)]

    async def main() -> None:
        async with served(sending(*(bulk(v) for v in values))) as conn:
            with switched_replies(conn) as replies:
                for v in values:
                    assert await read_bulk(replies) == (v, xxhash.xxh3_64_intdigest(v))
            assert conn._writer.transport.get_protocol() is replies.original

    run(main())


def test_skipped_and_small_values_leave_the_next_in_place() -> None:
    small, big, scratch, last = os.urandom(10), os.urandom(3 << 20), os.urandom(3 * WINDOW), os.urandom(5000)

    async def main() -> None:
        async with served(sending(bulk(small), bulk(big), bulk(scratch), bulk(last))) as conn:
            with switched_replies(conn) as replies:
                for value in (small, big):
                    assert await replies.line() == b"$%d\r\n" % len(value)
                    await replies.skip(len(value))
                await replies.line()
                assert await replies.exactly(len(scratch)) == scratch  # through scratch, several windows
                await replies.crlf()
                assert (await read_bulk(replies))[0] == last

    run(main())


def test_bytes_buffered_before_the_switch_come_first_and_a_paused_stream_resumes() -> None:
    """The stream holds more than its limit, so it paused reading: the switch must take its bytes
    and resume the transport, or the rest of the value never arrives."""
    value = os.urandom(4 << 20)

    async def main() -> None:
        async with served(sending(bulk(value))) as conn:
            for _ in range(500):
                if conn._reader._paused:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.002)
            assert conn._reader._paused  # type: ignore[attr-defined]
            with switched_replies(conn) as replies:
                assert (await read_bulk(replies))[0] == value

    run(main())


def test_bytes_past_the_last_reply_go_back_and_the_connection_is_reused() -> None:
    first, second, third = os.urandom(10_000), os.urandom(100), os.urandom(300_000)

    async def main() -> None:
        async with served(sending(bulk(first) + bulk(second), bulk(third))) as conn:
            await buffered(conn, len(bulk(first) + bulk(second)))
            with switched_replies(conn) as replies:
                assert (await read_bulk(replies))[0] == first
            # the second reply was received with the first: it is the stream's again
            assert await conn._reader.readexactly(len(bulk(second))) == bulk(second)
            with switched_replies(conn) as replies:
                assert (await read_bulk(replies))[0] == third
            assert not conn._reader._buffer  # type: ignore[attr-defined]

    run(main())


def test_a_connection_closed_mid_value_fails_the_read_and_reaches_the_stream() -> None:
    value = os.urandom(100_000)

    async def main() -> None:
        async with served(sending(bulk(value)[:60_000], close=True)) as conn:
            with pytest.raises(ProtocolError, match="closed"), switched_replies(conn) as replies:
                await read_bulk(replies)
            for _ in range(100):  # the end of stream (or the lost connection) was passed on
                if conn._reader.at_eof():
                    break
                await asyncio.sleep(0.01)
            assert conn._reader.at_eof()
            assert conn._writer.transport.get_protocol() is replies.original

    run(main())


def test_a_cancelled_read_hands_the_connection_back() -> None:
    value = os.urandom(100_000)

    async def main() -> None:
        async with served(sending(bulk(value)[:60_000])) as conn:  # the rest never comes
            got: list[BufferedReplies] = []

            async def read() -> None:
                with switched_replies(conn) as replies:
                    got.append(replies)
                    await read_bulk(replies)

            task = asyncio.create_task(read())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert conn._writer.transport.get_protocol() is got[0].original
            assert got[0]._target is None and got[0]._waiter is None
            # dropping the connection afterwards (as read_or_drop does) completes: checked by served()

    run(main())


def test_a_connection_lost_while_switched_reaches_the_stream_protocol() -> None:
    """The transport reports a lost connection to the protocol installed at the time, ours: the
    stream's must learn it too, or closing the connection would wait for it forever."""
    value = os.urandom(100_000)

    async def main() -> None:
        async with served(sending(bulk(value)[:60_000])) as conn:
            async def read() -> None:
                with switched_replies(conn) as replies:
                    await read_bulk(replies)

            task = asyncio.create_task(read())
            await asyncio.sleep(0.1)
            conn._writer.transport.abort()
            with pytest.raises(ProtocolError, match="closed"):
                await task
            assert conn._reader.at_eof()
            await asyncio.wait_for(conn._writer.wait_closed(), 2)

    run(main())


def test_a_line_without_end_is_a_protocol_error() -> None:
    async def main() -> None:
        async with served(sending(b"$" + b"9" * 100_000)) as conn:
            with pytest.raises(ProtocolError, match="line"), switched_replies(conn) as replies:
                await replies.line()

    run(main())


def test_bulk_lengths_and_nulls() -> None:
    assert [parse_bulk_size(line) for line in (b"$0\r\n", b"$12\r\n", b"$-1\r\n", b"_\r\n")] == [0, 12, -1, -1]
    for line in (b"+OK\r\n", b":1\r\n", b"$abc\r\n"):
        with pytest.raises(ProtocolError):
            parse_bulk_size(line)


def test_runs_only_on_a_stream_reader_with_the_internals_it_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    assert supported(asyncio.StreamReader)

    class NoBuffer(asyncio.StreamReader):
        def __init__(self) -> None:  # keeps its bytes elsewhere: no ``_buffer``, no ``_eof``
            self.data = bytearray()

    assert not supported(NoBuffer)
    monkeypatch.delattr(asyncio.StreamReader, "_maybe_resume_transport")
    assert not supported(asyncio.StreamReader)
