"""Tests of ``backends/redis_wire.py``, the Redis tier's own connections: replies received straight
into their destination, pieces reported in order, a broken or dropped connection failing the read
and never reused, a cancelled read letting go of its destination, and the set-up (AUTH, SELECT,
PING) as redis-py makes it.

The tests talk to tiny asyncio servers that send the bytes a test wants, or answer commands as
it says (no Redis needed; ``wired``, ``sending``, ``answering`` and ``bulk`` are also used by
``test_redis_reads.py``). The tier over real servers, TLS and ACLs included, is tested in
``test_redis*.py``.

Run: ``.venv/bin/python -m pytest tests/backends/test_redis_wire.py``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import xxhash

from kvlayer.backends.redis_wire import WINDOW, ProtocolError, Wire, WirePool, open_wire, pack, parse_bulk_size

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Server:
    """A test server: its URL and how many connections it accepted."""

    url: str
    connections: int = 0
    commands: list[list[bytes]] = field(default_factory=list)


@asynccontextmanager
async def serving(serve: Serve) -> AsyncIterator[Server]:
    """A server on loopback running ``serve`` for each connection (then holding it open until the test ends)."""
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info.connections += 1
        await serve(reader, writer)
        await done.wait()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    info = Server(f"redis://{host}:{port}")
    try:
        yield info
    finally:
        done.set()
        server.close()


@asynccontextmanager
async def wired(serve: Serve) -> AsyncIterator[Wire]:
    """A bare ``Wire`` (no set-up commands) to a server running ``serve``."""
    async with serving(serve) as server:
        host, port = server.url[len("redis://"):].split(":")
        _, wire = await asyncio.get_running_loop().create_connection(Wire, host, int(port))
        try:
            yield wire
        finally:
            wire.abort()


def sending(*pieces: bytes, close: bool = False) -> Serve:
    """A server that sends ``pieces`` (each drained before the next), then closes if ``close``."""
    async def serve(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for p in pieces:
            writer.write(p)
            await writer.drain()
        if close:
            writer.close()

    return serve


async def read_command(reader: asyncio.StreamReader) -> list[bytes]:
    """One RESP command (an array of bulk strings) from ``reader``."""
    n = int((await reader.readline())[1:-2])
    args = []
    for _ in range(n):
        size = int((await reader.readline())[1:-2])
        args.append((await reader.readexactly(size + 2))[:-2])
    return args


def answering(server_of: Callable[[], Server], reply: Callable[[list[bytes]], bytes]) -> Serve:
    """A server answering each command with ``reply(command)`` (recorded in ``server_of().commands``)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                command = await read_command(reader)
            except (asyncio.IncompleteReadError, ValueError):
                return
            server_of().commands.append(command)
            writer.write(reply(command))
            await writer.drain()

    return serve


def run(main: Awaitable[None]) -> None:
    """Run a test's coroutine; a read waiting for bytes that never come fails it instead of hanging."""
    asyncio.run(asyncio.wait_for(main, 10))


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n" % len(value) + value + b"\r\n"


async def read_bulk(wire: Wire) -> tuple[bytes, int, list[tuple[int, int]]]:
    """A bulk reply received into memory of its own: its bytes, their xxh3 and the pieces reported."""
    size = parse_bulk_size(await wire.line())
    out, hasher, pieces = bytearray(size), xxhash.xxh3_64(), []
    view = memoryview(out)

    def landed(lo: int, hi: int) -> None:
        pieces.append((lo, hi))
        hasher.update(view[lo:hi])

    await wire.into(view, landed)
    await wire.crlf()
    return bytes(out), hasher.intdigest(), pieces


def test_values_land_in_place_in_pieces_reported_in_order() -> None:
    values = [os.urandom(3 * WINDOW + 5), os.urandom(2 << 20), os.urandom(17)]

    async def main() -> None:
        async with wired(sending(*(bulk(v) for v in values))) as wire:
            for v in values:
                got, digest, pieces = await read_bulk(wire)
                assert (got, digest) == (v, xxhash.xxh3_64_intdigest(v))
                assert [lo for lo, _ in pieces] == [0] + [hi for _, hi in pieces[:-1]] and pieces[-1][1] == len(v)
            assert wire.received == sum(len(bulk(v)) for v in values)

    run(main())


def test_skipped_and_small_values_leave_the_next_in_place() -> None:
    small, big, scratch, last = os.urandom(10), os.urandom(3 << 20), os.urandom(3 * WINDOW), os.urandom(5000)

    async def main() -> None:
        async with wired(sending(bulk(small), bulk(big), bulk(scratch), bulk(last), bulk(b""))) as wire:
            for value in (small, big):
                assert await wire.line() == b"$%d\r\n" % len(value)
                await wire.skip(len(value))
            await wire.line()
            assert await wire.exactly(len(scratch)) == scratch  # through scratch, several windows
            await wire.crlf()
            assert (await read_bulk(wire))[0] == last
            assert (await read_bulk(wire))[:2] == (b"", xxhash.xxh3_64_intdigest(b""))

    run(main())


def test_bytes_past_a_reply_are_the_next_ones() -> None:
    first, second, third = os.urandom(10_000), os.urandom(100), os.urandom(300_000)

    async def main() -> None:
        async with wired(sending(bulk(first) + bulk(second), bulk(third))) as wire:
            assert [(await read_bulk(wire))[0] for _ in range(3)] == [first, second, third]
            assert wire.usable

    run(main())


def test_a_connection_closed_mid_value_fails_the_read() -> None:
    value = os.urandom(100_000)

    async def main() -> None:
        async with wired(sending(bulk(value)[:60_000], close=True)) as wire:
            with pytest.raises(ProtocolError, match="closed"):
                await read_bulk(wire)
            assert not wire.usable
            with pytest.raises(ProtocolError, match="closed"):
                wire.send([(b"PING",)])

    run(main())


def test_a_cancelled_read_lets_go_of_its_destination() -> None:
    """Bytes arriving after a read was cancelled must not land in the memory it was filling:
    the caller frees that memory at once."""
    value = os.urandom(100_000)

    async def main() -> None:
        gate = asyncio.Event()

        async def serve(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(bulk(value)[:60_000])
            await writer.drain()
            await gate.wait()
            writer.write(bulk(value)[60_000:])
            await writer.drain()

        async with wired(serve) as wire:
            out = bytearray(len(value))
            await wire.line()
            task = asyncio.create_task(wire.into(memoryview(out)))
            for _ in range(100):
                if wire.received >= 60_000:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            before = bytes(out)
            gate.set()
            for _ in range(100):
                if wire.received >= len(bulk(value)):
                    break
                await asyncio.sleep(0.01)
            assert wire.received == len(bulk(value)) and bytes(out) == before
            assert out[60_000:] == bytes(len(out) - 60_000), "nothing past the first bytes came in"

    run(main())


def test_a_line_without_end_is_a_protocol_error() -> None:
    async def main() -> None:
        async with wired(sending(b"$" + b"9" * 100_000)) as wire:
            with pytest.raises(ProtocolError, match="line"):
                await wire.line()

    run(main())


def test_bulk_lengths_nulls_and_packed_commands() -> None:
    assert [parse_bulk_size(line) for line in (b"$0\r\n", b"$12\r\n", b"$-1\r\n", b"_\r\n")] == [0, 12, -1, -1]
    for line in (b"+OK\r\n", b":1\r\n", b"$abc\r\n"):
        with pytest.raises(ProtocolError):
            parse_bulk_size(line)
    assert pack([(b"GET", "k"), ("GETRANGE", b"b", 0, 9)]) == (
        b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*4\r\n$8\r\nGETRANGE\r\n$1\r\nb\r\n$1\r\n0\r\n$1\r\n9\r\n")


@pytest.mark.parametrize(("url_tail", "sent"), [("", [[b"PING"]]),
                                                ("/3", [[b"SELECT", b"3"], [b"PING"]]),
                                                ("alice:s3cret@", [[b"AUTH", b"alice", b"s3cret"], [b"PING"]]),
                                                (":s3cret@/2", [[b"AUTH", b"s3cret"], [b"SELECT", b"2"], [b"PING"]])])
def test_a_wire_is_set_up_as_the_url_says(url_tail: str, sent: list[list[bytes]]) -> None:
    async def main() -> None:
        async with serving(answering(lambda: server, lambda c: b"+PONG\r\n" if c == [b"PING"] else b"+OK\r\n")) \
                as server:
            address = server.url[len("redis://"):]
            path = url_tail.rsplit("@", 1)[-1] if "/" in url_tail else ""
            auth = url_tail.rsplit("@", 1)[0] + "@" if "@" in url_tail else ""
            wire = await open_wire(f"redis://{auth}{address}{path}")
            assert wire.usable and server.commands == sent
            wire.abort()

    run(main())


def test_a_refused_set_up_raises_the_servers_words() -> None:
    async def main() -> None:
        async with serving(answering(lambda: server, lambda c: b"-NOAUTH Authentication required.\r\n")) as server:
            with pytest.raises(ConnectionError, match="PING: NOAUTH Authentication required"):
                await open_wire(server.url)

    run(main())


def pong_then(value: bytes) -> Callable[[list[bytes]], bytes]:
    """Answers PING with PONG and anything else with ``value``."""
    return lambda command: b"+PONG\r\n" if command == [b"PING"] else value


def test_a_pool_reuses_a_good_wire_and_never_a_failed_one() -> None:
    async def main() -> None:
        async with serving(answering(lambda: server, pong_then(bulk(b"v")))) as server:
            pool = WirePool(server.url)

            async def get(wire: Wire) -> bytes:
                wire.send([(b"GET", b"k")])
                return (await read_bulk(wire))[0]

            async def broken(wire: Wire) -> None:
                wire.send([(b"GET", b"k")])
                await wire.line()
                raise ValueError("a reader's bug, mid-reply")

            assert [await pool.run(get) for _ in range(3)] == [b"v"] * 3
            assert server.connections == 1
            with pytest.raises(ValueError, match="bug"):
                await pool.run(broken)
            assert await pool.run(get) == b"v"
            assert server.connections == 2, "the wire left mid-reply was dropped"
            pool.close()
            assert await pool.run(get) == b"v"
            assert server.connections == 3, "a closed pool keeps nothing"

    run(main())


def test_a_pool_retries_once_on_a_new_wire_when_an_idle_one_is_dead() -> None:
    """An idle wire whose connection died unseen fails before any byte of its reply: the read
    runs again on a new wire; one that fails after bytes came is not retried."""
    async def main() -> None:
        async with serving(answering(lambda: server, pong_then(bulk(b"v")))) as server:
            pool = WirePool(server.url)
            calls: list[Wire] = []

            async def get(wire: Wire) -> bytes:
                wire.send([(b"GET", b"k")])
                return (await read_bulk(wire))[0]

            async def dies_once(wire: Wire) -> bytes:
                calls.append(wire)
                if len(calls) == 1:
                    raise ProtocolError("the server closed the connection mid-reply")
                return await get(wire)

            with pytest.raises(ProtocolError):
                await pool.run(dies_once)  # on a new wire: no retry
            assert await pool.run(get) == b"v"  # the pool keeps this wire
            calls.clear()
            assert await pool.run(dies_once) == b"v" and len(calls) == 2 and calls[0] is not calls[1]
            assert server.connections == 3

            async def dies_after_bytes(wire: Wire) -> None:
                calls.append(wire)
                wire.send([(b"GET", b"k")])
                await wire.line()
                raise ProtocolError("broken")

            calls.clear()
            with pytest.raises(ProtocolError, match="broken"):
                await pool.run(dies_after_bytes)
            assert len(calls) == 1

    run(main())
