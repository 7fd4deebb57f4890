"""Tests of ``backends/redis_reads.py``: ``MGET head body`` replies read from a stream into
staging, without a server.

Run: ``.venv/bin/python -m pytest tests/backends/test_redis_reads.py``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvlayer import serde
from kvlayer.backends.redis_pairs import HalfChunk, split
from kvlayer.backends.redis_reads import Expected, ProtocolError, Reply, decode_pair, read_reply
from kvlayer.memory import Arena
from tests.backends.test_redis import CHUNK, CHUNK_BYTES, LAYOUT, keys_of
from tests.fakes import chunk_data

NIL = b"$-1\r\n"


def pair_of(key: object, compression: str = "none") -> tuple[bytes, bytes]:
    """The head and body values the tier stores for ``key``."""
    head, body = split(*serde.encode_chunk(key, chunk_data(key, LAYOUT), compression))  # type: ignore[arg-type]
    return head, bytes(body)


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n" % len(value) + value + b"\r\n"


def mget(head: bytes | None, body: bytes | None, nil: bytes = NIL) -> bytes:
    """An MGET reply for two keys (``None``: a missing key)."""
    return b"*2\r\n" + (nil if head is None else bulk(head)) + (nil if body is None else bulk(body))


def read_all(wire: bytes, wants: list[Expected], feed_size: int = 4096) -> list[Reply]:
    """The replies ``read_reply`` reads from ``wire``, fed to the stream ``feed_size`` bytes at a time."""
    async def main() -> list[Reply]:
        stream = asyncio.StreamReader()
        for at in range(0, len(wire), feed_size):
            stream.feed_data(wire[at:at + feed_size])
        stream.feed_eof()
        return [await read_reply(stream, w) for w in wants]

    return asyncio.run(main())


def expected(keys: list, slots: int = 8) -> list[Expected]:
    staging = Arena(slots * CHUNK_BYTES, CHUNK_BYTES)
    return [Expected(k, LAYOUT.chunk_shape(CHUNK), LAYOUT.dtype, staging) for k in keys]


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
    replies = read_all(wire, wants, feed_size=777)
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
    replies = read_all(wire, wants)
    assert "body is" in str(replies[0].error) and "head is" in str(replies[1].error)
    assert "another key" in str(replies[2].error)
    assert replies[3].error is not None and replies[3].nbytes == 10_000 + len(body)
    assert replies[4].obj is not None and torch.equal(replies[4].obj.tensor, chunk_data(keys[4], LAYOUT))
    replies[4].obj.release()


def test_full_staging_skips_the_body() -> None:
    keys = keys_of(3)
    wants = expected(keys, slots=1)
    first, second, third = read_all(mget(*pair_of(keys[0])) + mget(*pair_of(keys[1])) + mget(None, None), wants)
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
    with pytest.raises((ProtocolError, asyncio.IncompleteReadError)):
        read_all(wire, wants)
    assert wants[0].staging.used_count == 0


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_decode_pair_matches_read_reply(compression: str) -> None:
    keys = keys_of(2)
    wants = expected(keys)
    head, body = pair_of(keys[0], compression)
    hit = decode_pair(head, body, wants[0])
    assert hit.obj is not None and torch.equal(hit.obj.tensor, chunk_data(keys[0], LAYOUT))
    hit.obj.release()
    assert decode_pair(None, None, wants[1]).stored is False
    assert isinstance(decode_pair(None, body, wants[0]).error, HalfChunk)
    assert isinstance(decode_pair(head, None, wants[0]).error, HalfChunk)
    assert decode_pair(head, body, wants[1]).error is not None
    assert decode_pair(head, body[:-1], wants[0]).error is not None
    assert decode_pair(b"short", body, wants[1]).error is not None
    assert wants[0].staging.used_count == 0
