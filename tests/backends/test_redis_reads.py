"""Tests of ``backends/redis_reads.py``, the Redis tier's one fast read path: chunks received by
payload range straight into their destination (``GET`` head, ``STRLEN``/``EXISTS`` body, then
``GETRANGE`` by layer group), whole or by layer groups, checked as the bytes land; and the same
values read whole through redis-py (``redis_pairs.decode_pair``: cluster mode, compressed or
quantized tiers).

The first tests read from a tiny fake Redis (``FakeRedis``: GET, STRLEN, EXISTS, GETRANGE over a
dict, served by ``test_redis_wire.py``'s helpers), whose values a test spoils at will, or whose
connection it drops or freezes mid-value; the rest read large chunks through ``RedisBackend``
from real servers, over TLS too.

Run: ``.venv/bin/python -m pytest tests/backends/test_redis_reads.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlayer import serde
from kvlayer.backends.byte_reads import ChunkRead
from kvlayer.backends.redis import RedisBackend
from kvlayer.backends.redis_pairs import Expected, HalfChunk, chunk_names, decode_pair, split
from kvlayer.backends.redis_reads import ValueRead, read_values
from kvlayer.backends.redis_wire import WINDOW, ProtocolError, Wire
from kvlayer.config import KVLayerConfig
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena
from kvlayer.storage import BackendContext
from tests.backends.test_nvme import put_keys
from tests.backends.test_redis import (
    CHUNK,
    LAYOUT,
    keys_of,
    names_of,
    store_bytes,
    sync_client,
    through_redis_py,
    tls_server,
)
from tests.backends.test_redis_wire import bulk, read_command, run, serving, wired
from tests.fakes import chunk_data, make_keys, namespace
from tests.redis_server import RedisServer

BIG = KVLayout(num_layers=6, num_kv_heads=2, head_dim=64, dtype=torch.float32, block_size=16)
BIG_CHUNK = 256
BIG_SIZE = BIG.chunk_bytes(BIG_CHUNK)  # 768 KiB: each value takes several receives, a whole one two ranges
GROUPS = [(0, 1), (1, 4), (4, 6)]
PREFIX = b"kvlayer:"
WRONGTYPE = b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"


# --- reads from a fake Redis ------------------------------------------------------------------
class FakeRedis:
    """The few commands the fast path sends, over ``values`` (name -> bytes; a list: a key of
    another type; a str: an error reply for that key). ``drop_after``/``stall_after``: bytes sent
    before the connection is dropped or stops sending."""

    def __init__(self, values: dict[bytes, Any], drop_after: int | None = None,
                 stall_after: int | None = None) -> None:
        self.values = values
        self.drop_after, self.stall_after = drop_after, stall_after

    def reply(self, command: list[bytes]) -> bytes:
        name, *args = command
        if name == b"PING":
            return b"+PONG\r\n"
        if name == b"INFO":
            return bulk(b"")
        value = self.values.get(args[0])
        if isinstance(value, str):
            return b"-" + value.encode() + b"\r\n"
        if name == b"EXISTS":
            return b":%d\r\n" % (value is not None)
        if isinstance(value, list):
            return WRONGTYPE
        if name == b"GET":
            return b"$-1\r\n" if value is None else bulk(value)
        if name == b"STRLEN":
            return b":%d\r\n" % len(value or b"")
        assert name == b"GETRANGE", name
        return bulk((value or b"")[int(args[1]): int(args[2]) + 1])

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sent = 0
        while True:
            try:
                data = self.reply(await read_command(reader))
            except (asyncio.IncompleteReadError, ValueError):
                return
            for limit, then in ((self.drop_after, "drop"), (self.stall_after, "stall")):
                if limit is not None and sent + len(data) > limit:
                    writer.write(data[: limit - sent])
                    await writer.drain()
                    if then == "drop":
                        writer.transport.abort()
                    else:
                        await asyncio.sleep(3600)
                    return
            sent += len(data)
            writer.write(data)
            await writer.drain()


def pair_of(key: Any, layout: KVLayout = LAYOUT) -> tuple[bytes, bytes]:
    """The head and body values the tier stores for ``key``."""
    head, body = split(*serde.encode_chunk(key, chunk_data(key, layout)))
    return head, bytes(body)


def stored_values(keys: list, layout: KVLayout = LAYOUT) -> dict[bytes, Any]:
    return {name: value for k in keys for name, value in zip(chunk_names(PREFIX, k), pair_of(k, layout))}


def value_reads(keys: list, slots: int = 8, layout: KVLayout = LAYOUT, tokens: int = CHUNK) -> list[ValueRead]:
    """Whole-chunk reads of ``keys`` into staging objects from an arena of ``slots``."""
    staging = Arena(slots * layout.chunk_bytes(tokens), layout.chunk_bytes(tokens))
    shape = layout.chunk_shape(tokens)
    return [ValueRead(chunk_names(PREFIX, k), ChunkRead(k, shape, layout.dtype), staging=staging) for k in keys]


def read_fake(redis: FakeRedis, values: list[ValueRead], groups: list[tuple[int, int]] | None = None,
              seen: list[Wire] | None = None) -> None:
    async def main() -> None:
        async with wired(redis.serve) as wire:
            if seen is not None:
                seen.append(wire)
            layers = values[0].chunk.shape[0]
            await read_values(wire, values, groups or [(0, layers)], lambda g: None)

    run(main())


def outcomes(values: list[ValueRead]) -> list[tuple[bool, bool, type | None]]:
    """``(stored, hit, error type)`` of each read."""
    return [(v.stored, v.chunk.verified(), type(v.chunk.error) if v.chunk.error else None) for v in values]


def release(values: list[ValueRead]) -> None:
    for v in values:
        if v.out is not None:
            v.out.release()


def exact(v: ValueRead, layout: KVLayout = LAYOUT) -> bool:
    return v.out is not None and torch.equal(v.out.tensor, chunk_data(v.chunk.key, layout))


SPOILED: dict[str, tuple[Callable[[bytes, bytes, bytes, bytes], tuple[Any, Any]], type | None]] = {
    "missing": (lambda head, body, oh, ob: (None, None), None),
    "head missing": (lambda head, body, oh, ob: (None, body), HalfChunk),
    "body missing": (lambda head, body, oh, ob: (head, None), HalfChunk),
    "head of another type": (lambda head, body, oh, ob: ([b"x"], body), HalfChunk),
    "body of another type": (lambda head, body, oh, ob: (head, [b"x"]), HalfChunk),
    "error reply": (lambda head, body, oh, ob: ("NOPERM no access to this key", body), serde.ChunkFormatError),
    "flipped tail byte": (lambda head, body, oh, ob: (head[:-1] + bytes([head[-1] ^ 1]), body), serde.ChunkFormatError),
    "flipped body byte": (lambda head, body, oh, ob: (head, body[:99] + bytes([body[99] ^ 1]) + body[100:]),
                          serde.ChunkFormatError),
    "short body": (lambda head, body, oh, ob: (head, body[:-10]), serde.ChunkFormatError),
    "longer body": (lambda head, body, oh, ob: (head, body + b"x"), serde.ChunkFormatError),
    "empty body": (lambda head, body, oh, ob: (head, b""), serde.ChunkFormatError),
    "longer head": (lambda head, body, oh, ob: (head + b"x", body), serde.ChunkFormatError),
    "garbage head": (lambda head, body, oh, ob: (b"x" * 10_000, body), serde.ChunkFormatError),
    "short head": (lambda head, body, oh, ob: (head[:20], body), serde.ChunkFormatError),
    "another key's head": (lambda head, body, oh, ob: (oh, body), serde.ChunkFormatError),
    "another key's body": (lambda head, body, oh, ob: (head, ob), serde.ChunkFormatError),
}


@pytest.mark.parametrize("groups", [None, [(0, 1), (1, 2)]], ids=["whole", "by layers"])
def test_good_spoiled_and_missing_chunks_in_one_pipeline(groups: list[tuple[int, int]] | None) -> None:
    """Each spoiled chunk is a miss for its own reason, never data; the good chunks around it
    (one after every spoiled one) read exactly: the stream stays in step."""
    keys = keys_of(2 * len(SPOILED) + 1)
    values = stored_values(keys)
    for (spoil, _), victim in zip(SPOILED.values(), keys[1::2]):
        names = chunk_names(PREFIX, victim)
        values[names.head], values[names.body] = spoil(*pair_of(victim), *pair_of(keys[0]))
        values = {n: v for n, v in values.items() if v is not None}
    reads = value_reads(keys, slots=len(keys))
    read_fake(FakeRedis(values), reads, groups)
    got = outcomes(reads)
    assert all(hit and exact(v) for (_, hit, _), v in zip(got[::2], reads[::2]))
    for name, (_, why), outcome in zip(SPOILED, SPOILED.values(), got[1::2]):
        assert outcome == (name != "missing", False, why), name
    release(reads)
    assert reads[0].staging is not None and reads[0].staging.used_count == 0


def test_a_full_staging_arena_skips_the_body() -> None:
    keys = keys_of(3)
    reads = value_reads(keys, slots=1)
    read_fake(FakeRedis(stored_values(keys[:2])), reads)
    assert outcomes(reads) == [(True, True, None), (True, False, None), (False, False, None)]
    assert exact(reads[0]) and reads[1].out is None
    release(reads)


def test_a_large_body_lands_in_its_destination_not_in_scratch() -> None:
    key = make_keys(1, 2, namespace(chunk_size=BIG_CHUNK, layout=BIG))[0]
    reads = value_reads([key], 1, BIG, BIG_CHUNK)
    seen: list[Wire] = []
    read_fake(FakeRedis(stored_values([key], BIG)), reads, seen=seen)
    assert reads[0].chunk.verified() and exact(reads[0], BIG)
    assert len(seen[0]._buf) <= 16 * WINDOW, "the body went through the scratch buffer"
    release(reads)


@pytest.mark.parametrize("reply", [b"+OK\r\n", b"$abc\r\n"])
def test_a_broken_stream_raises(reply: bytes) -> None:
    keys = keys_of(1)
    redis = FakeRedis(stored_values(keys))
    redis.reply = lambda command: reply  # type: ignore[method-assign]
    with pytest.raises(ProtocolError):
        read_fake(redis, value_reads(keys))


@asynccontextmanager
async def tier_on(redis: FakeRedis, timeout_ms: int = 10_000) -> AsyncIterator[tuple[RedisBackend, Any]]:
    """A Redis tier on a fake server: ``(backend, server)``."""
    async with serving(redis.serve) as server:
        cfg = KVLayerConfig(chunk_size=BIG_CHUNK, cpu_capacity=0, redis_url=server.url, tier_timeout_ms=timeout_ms)
        backend = RedisBackend.create(BackendContext(cfg, BIG, torch.device("cpu"), Arena(4 * BIG_SIZE, BIG_SIZE)))
        assert backend is not None
        try:
            yield backend, server
        finally:
            await backend.close()


@pytest.mark.parametrize("fault", ["drop", "stall"])
def test_a_connection_lost_mid_value_fails_the_call_and_is_not_reused(fault: str) -> None:
    """Dropped or frozen mid-body: the call raises (a tier failure: misses), the staging object
    it was filling goes back, and the next call reads exactly on a new connection."""
    keys = make_keys(2, 4, namespace(chunk_size=BIG_CHUNK, layout=BIG))
    limit = 2 * (serde.HEADER_SIZE + 200) + BIG_SIZE // 2  # past both heads, inside the first body
    redis = FakeRedis(stored_values(keys, BIG), **{f"{fault}_after": limit})

    async def main() -> None:
        async with tier_on(redis, timeout_ms=500) as (backend, server):
            with pytest.raises(TimeoutError if fault == "stall" else ConnectionError):
                await backend.get_many(keys)
            assert backend._staging.used_count == 0
            setattr(redis, f"{fault}_after", None)
            got = await backend.get_many(keys)
            assert all(o is not None and torch.equal(o.tensor, chunk_data(k, BIG)) for k, o in zip(keys, got))
            assert server.connections == 2
            for o in got:
                o.release()  # type: ignore[union-attr]

    run(main())


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_values_parsed_by_redis_py_get_the_same_checks(compression: str) -> None:
    keys = keys_of(2)
    staging = Arena(8 * LAYOUT.chunk_bytes(CHUNK), LAYOUT.chunk_bytes(CHUNK))
    wants = [Expected(k, LAYOUT.chunk_shape(CHUNK), LAYOUT.dtype, staging) for k in keys]
    head, body = split(*serde.encode_chunk(keys[0], chunk_data(keys[0], LAYOUT), compression))
    head, body = head, bytes(body)
    hit = decode_pair(head, body, wants[0])
    assert hit.obj is not None and torch.equal(hit.obj.tensor, chunk_data(keys[0], LAYOUT))
    assert hit.nbytes == len(head) + len(body)
    hit.obj.release()
    assert decode_pair(None, None, wants[1]).stored is False
    assert isinstance(decode_pair(None, body, wants[0]).error, HalfChunk)
    assert isinstance(decode_pair(head, None, wants[0]).error, HalfChunk)
    assert "another key" in str(decode_pair(head, body, wants[1]).error)
    assert "body is" in str(decode_pair(head, body[:-1], wants[0]).error)
    assert "truncated header" in str(decode_pair(b"short", body, wants[1]).error)
    assert staging.used_count == 0


# --- large chunks through the Redis tier ------------------------------------------------------
@asynccontextmanager
async def stored(url: str, n: int, timeout_ms: int = 10_000,
                 compression: str = "none") -> AsyncIterator[tuple[RedisBackend, list, list]]:
    """A Redis tier at ``url`` holding ``n`` chunks: ``(backend, keys, outs)``, ``outs`` objects to read into."""
    cfg = KVLayerConfig(chunk_size=BIG_CHUNK, cpu_capacity=0, redis_url=url, tier_timeout_ms=timeout_ms,
                        compression=compression)
    backend = RedisBackend.create(BackendContext(cfg, BIG, torch.device("cpu"), Arena(n * BIG_SIZE, BIG_SIZE)))
    assert backend is not None
    keys = make_keys(n, 4, namespace(chunk_size=BIG_CHUNK, layout=BIG))
    arena = Arena(n * BIG_SIZE, BIG_SIZE)
    outs = [arena.allocate(BIG.chunk_shape(BIG_CHUNK), BIG.dtype) for _ in keys]
    try:
        await put_keys(backend, keys, BIG)  # type: ignore[arg-type]
        yield backend, keys, outs
    finally:
        for o in outs:
            o.release()  # type: ignore[union-attr]
        await backend.close()


async def read_all(backend: RedisBackend, keys: list, outs: list) -> None:
    """Read ``keys`` by layer groups into ``outs`` (filled with NaN first) and check every byte."""
    for o in outs:
        o.tensor.fill_(float("nan"))
    assert await backend.read_layers(keys, outs, GROUPS, lambda g: None) == [True] * len(keys)
    assert all(torch.equal(o.tensor, chunk_data(k, BIG)) for k, o in zip(keys, outs))


async def get_all(backend: RedisBackend, keys: list) -> None:
    """Read ``keys`` whole and check every byte (releasing what was read)."""
    objs = await backend.get_many(keys)
    assert all(o is not None and torch.equal(o.tensor, chunk_data(k, BIG)) for k, o in zip(keys, objs))
    for o in objs:
        o.release()  # type: ignore[union-attr]
    assert backend._staging.used_count == 0


async def read_back(url: str, compression: str = "none") -> None:
    """Read chunks whole and by layer groups, in turns, on one connection."""
    async with stored(url, 4, compression=compression) as (backend, keys, outs):
        await get_all(backend, keys)
        await read_all(backend, keys, outs)
        await read_all(backend, keys, outs)
        await get_all(backend, keys)
        await get_all(backend, keys)
        await read_all(backend, keys, outs)
        assert backend.stats()["checksum_errors"] == 0


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_large_chunks_whole_and_by_layer_groups(redis_server: RedisServer, compression: str) -> None:
    run(read_back(redis_server.url, compression))


def test_large_chunks_over_tls(tmp_path: Path) -> None:
    with tls_server(tmp_path) as url:
        run(read_back(url))


def test_a_frozen_server_times_the_read_out_and_the_next_read_works(redis_server: RedisServer) -> None:
    """The deadline cancels the read mid-reply: the connection is dropped (not left half read),
    and the next call, once the server answers again, reads every byte."""
    async def main() -> None:
        async with stored(redis_server.url, 2, timeout_ms=400) as (backend, keys, outs):
            for read in (lambda: backend.read_layers(keys, outs, GROUPS, lambda g: None),
                         lambda: backend.get_many(keys)):
                redis_server.pause()
                try:
                    with pytest.raises((TimeoutError, ConnectionError)):
                        await read()
                finally:
                    redis_server.resume()
                assert backend._staging.used_count == 0
                await read_all(backend, keys, outs)
                await get_all(backend, keys)

    run(main())


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_redis_py_reads_give_the_same_bytes_and_checks(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
                                                       compression: str) -> None:
    """Through redis-py (cluster mode, compressed or quantized tiers) the same bytes come back,
    and a bad value or a half chunk is a counted miss."""
    through_redis_py(monkeypatch)

    async def main() -> None:
        async with stored(redis_server.url, 4, compression=compression) as (backend, keys, outs):
            await get_all(backend, keys)
            await read_all(backend, keys, outs)
            client = sync_client(redis_server.url)
            head, body = client.mget(names_of(keys[1]))
            store_bytes(client, names_of(keys[1]), head[:serde.HEADER_SIZE] + body[:-1] + bytes([body[-1] ^ 1])
                        + head[serde.HEADER_SIZE:])
            client.delete(names_of(keys[2]).body)
            got = await backend.get_many(keys)
            assert [g is not None for g in got] == [True, False, False, True]
            for g in got:
                if g is not None:
                    g.release()
            stats = backend.stats()
            assert (stats["checksum_errors"], stats["half_chunks"], stats["hits"]) == (1, 1, 4 + 4 + 2)

    run(main())
