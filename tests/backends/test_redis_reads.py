"""Tests of ``backends/redis_reads.py``: whole chunks (``MGET head body``) and layer groups
(``GETRANGE``) read through the tier's one reply reader, and the same values parsed by redis-py
(``redis_pairs.decode_pair``: cluster mode, and the fallback where the reader cannot run).

The first tests feed ``MGET`` replies from a tiny asyncio server (``served`` in
``test_redis_replies.py``, no Redis needed); the rest read large chunks through ``RedisBackend``
from real servers, over TLS too.

Run: ``.venv/bin/python -m pytest tests/backends/test_redis_reads.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlayer import serde
from kvlayer.backends.redis import RedisBackend
from kvlayer.backends.redis_pairs import Expected, HalfChunk, Reply, decode_pair, split
from kvlayer.backends.redis_reads import read_pairs
from kvlayer.backends.redis_replies import WINDOW, BufferedReplies, ProtocolError, switched_replies
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
    tls_server,
    without_buffered_reader,
)
from tests.backends.test_redis_replies import Conn, bulk, run, sending, served
from tests.fakes import chunk_data, make_keys, namespace
from tests.redis_server import RedisServer

NIL = b"$-1\r\n"
BIG = KVLayout(num_layers=6, num_kv_heads=2, head_dim=64, dtype=torch.float32, block_size=16)
BIG_CHUNK = 256
BIG_SIZE = BIG.chunk_bytes(BIG_CHUNK)  # 768 KiB: each value takes several receives
GROUPS = [(0, 1), (1, 4), (4, 6)]


# --- MGET replies from a fake server ---------------------------------------------------------
def pair_of(key: Any, compression: str = "none", layout: KVLayout = LAYOUT) -> tuple[bytes, bytes]:
    """The head and body values the tier stores for ``key``."""
    head, body = split(*serde.encode_chunk(key, chunk_data(key, layout), compression))
    return head, bytes(body)


def mget(head: bytes | None, body: bytes | None, nil: bytes = NIL) -> bytes:
    """An MGET reply for two keys (``None``: a missing key)."""
    return b"*2\r\n" + (nil if head is None else bulk(head)) + (nil if body is None else bulk(body))


def expected(keys: list, slots: int = 8, layout: KVLayout = LAYOUT, tokens: int = CHUNK) -> list[Expected]:
    staging = Arena(slots * layout.chunk_bytes(tokens), layout.chunk_bytes(tokens))
    return [Expected(k, layout.chunk_shape(tokens), layout.dtype, staging) for k in keys]


async def switched_read(conn: Conn, wants: list[Expected], seen: list[BufferedReplies] | None = None) -> list[Reply]:
    with switched_replies(conn) as replies:
        if seen is not None:
            seen.append(replies)
        return await read_pairs(replies, wants)


def read_wire(wire: bytes, wants: list[Expected], close: bool = False, piece: int = 777) -> list[Reply]:
    """The replies ``read_pairs`` reads from a server sending ``wire`` ``piece`` bytes at a time."""
    got: list[list[Reply]] = []

    async def main() -> None:
        async with served(sending(*(wire[i:i + piece] for i in range(0, len(wire), piece)), close=close)) as conn:
            got.append(await switched_read(conn, wants))

    run(main())
    return got[0]


def outcomes(replies: list[Reply]) -> list[tuple[bool, bool, type | None]]:
    """``(stored, hit, error type)`` of each reply."""
    return [(r.stored, r.obj is not None, type(r.error) if r.error else None) for r in replies]


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_values_misses_and_errors_in_one_stream(compression: str) -> None:
    keys = keys_of(7)
    wants = expected(keys)
    head, body = pair_of(keys[3])
    bad_tail = head[:-1] + bytes([head[-1] ^ 1])
    wire = (mget(*pair_of(keys[0], compression)) + mget(None, None) + b"-NOPERM no access\r\n"
            + mget(bad_tail, body) + mget(None, None, nil=b"_\r\n") + mget(None, pair_of(keys[5])[1])
            + mget(pair_of(keys[6])[0], None))
    replies = read_wire(wire, wants)
    assert replies[0].obj is not None and torch.equal(replies[0].obj.tensor, chunk_data(keys[0], LAYOUT))
    assert replies[0].nbytes == sum(len(v) for v in pair_of(keys[0], compression))
    assert outcomes(replies[1:]) == [(False, False, None), (True, False, serde.ChunkFormatError),
                                     (True, False, serde.ChunkFormatError), (False, False, None),
                                     (True, False, HalfChunk), (True, False, HalfChunk)]
    replies[0].obj.release()
    assert wants[0].staging.used_count == 0


def test_wrong_sizes_or_key_are_errors_and_the_stream_stays_in_step() -> None:
    keys = keys_of(5)
    wants = expected([keys[0], keys[0], keys[2], keys[0], keys[4]])
    head, body = pair_of(keys[0])
    wire = (mget(head, body[:-10]) + mget(head + b"x", body) + mget(*pair_of(keys[4]))
            + mget(b"x" * 10_000, body) + mget(*pair_of(keys[4])))
    replies = read_wire(wire, wants)
    assert "body is" in str(replies[0].error) and "head is" in str(replies[1].error)
    assert "another key" in str(replies[2].error)
    assert replies[3].error is not None and replies[3].nbytes == 10_000 + len(body)
    assert replies[4].obj is not None and torch.equal(replies[4].obj.tensor, chunk_data(keys[4], LAYOUT))
    replies[4].obj.release()


def test_a_flipped_body_byte_fails_the_checksum() -> None:
    key = keys_of(1)[0]
    head, body = pair_of(key)
    (reply,) = read_wire(mget(head, body[:100] + bytes([body[100] ^ 1]) + body[101:]), expected([key]))
    assert (reply.obj, str(reply.error)) == (None, "payload checksum mismatch")


def test_full_staging_skips_the_body() -> None:
    keys = keys_of(3)
    wants = expected(keys, slots=1)
    first, second, third = read_wire(mget(*pair_of(keys[0])) + mget(*pair_of(keys[1])) + mget(None, None), wants)
    assert first.obj is not None
    assert (second.stored, second.obj, second.error) == (True, None, None)
    assert third.stored is False
    first.obj.release()


@pytest.mark.parametrize("wire", [b"+OK\r\n", b"*1\r\n" + NIL, b"*2\r\n$abc\r\n", b"*2\r\n:1\r\n",
                                  b"*2\r\n$%d\r\n" % (serde.HEADER_SIZE + 128)])
def test_a_broken_stream_raises_and_releases(wire: bytes) -> None:
    wants = expected(keys_of(1))
    head, body = pair_of(wants[0].key)
    if wire.endswith(b"$%d\r\n" % len(head)):
        wire += head + b"\r\n" + b"$%d\r\n" % len(body) + body[:100]  # the server went away mid-body
    with pytest.raises(ProtocolError):
        read_wire(wire, wants, close=True)
    assert wants[0].staging.used_count == 0


def test_a_large_body_lands_in_its_staging_object_not_in_scratch() -> None:
    key = make_keys(1, 2, namespace(chunk_size=BIG_CHUNK, layout=BIG))[0]
    wants = expected([key], 1, BIG, BIG_CHUNK)
    seen: list[BufferedReplies] = []

    async def main() -> None:
        async with served(sending(mget(*pair_of(key, layout=BIG)))) as conn:
            (reply,) = await switched_read(conn, wants, seen)
            assert reply.obj is not None and torch.equal(reply.obj.tensor, chunk_data(key, BIG))
            reply.obj.release()

    run(main())
    assert len(seen[0]._buf) <= 16 * WINDOW, "the body went through the scratch buffer"


def test_a_cancelled_read_releases_the_object_it_was_filling() -> None:
    key = keys_of(1)[0]
    wants = expected([key])
    head, body = pair_of(key)

    async def main() -> None:
        async with served(sending(b"*2\r\n" + bulk(head) + b"$%d\r\n" % len(body) + body[:1000])) as conn:
            task = asyncio.create_task(switched_read(conn, wants))  # the rest of the body never comes
            for _ in range(100):
                if wants[0].staging.used_count:
                    break
                await asyncio.sleep(0.01)
            assert wants[0].staging.used_count == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert wants[0].staging.used_count == 0

    run(main())


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_values_parsed_by_redis_py_get_the_same_checks(compression: str) -> None:
    keys = keys_of(2)
    wants = expected(keys)
    head, body = pair_of(keys[0], compression)
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
    assert wants[0].staging.used_count == 0


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
    """The deadline cancels the read while our protocol is installed: the connection is dropped
    (not left half read) and the next call, once the server answers again, reads every byte."""
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
def test_redis_py_reads_where_the_reader_cannot_run(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
                                                    compression: str) -> None:
    """Without the StreamReader internals the reader needs, every read goes through redis-py's
    parser: the same bytes, and a bad value or a half chunk is a counted miss."""
    without_buffered_reader(monkeypatch)

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
