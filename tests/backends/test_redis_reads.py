"""Tests of ``backends/redis_reads.py``: GET replies read from a stream into staging, without a server.

Run: ``.venv/bin/python -m pytest tests/backends/test_redis_reads.py``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvlayer import serde
from kvlayer.backends.redis_reads import Expected, ProtocolError, Reply, decode_value, read_reply
from kvlayer.memory import Arena
from tests.backends.test_redis import CHUNK, CHUNK_BYTES, LAYOUT, keys_of
from tests.fakes import chunk_data


def value_of(key: object, compression: str = "none") -> bytes:
    header, payload = serde.encode_chunk(key, chunk_data(key, LAYOUT), compression)  # type: ignore[arg-type]
    return header + bytes(payload)


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n" % len(value) + value + b"\r\n"


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


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_values_misses_and_errors_in_one_stream(compression: str) -> None:
    keys = keys_of(5)
    wants = expected(keys)
    bad = bytearray(value_of(keys[3]))
    bad[-1] ^= 1
    wire = (bulk(value_of(keys[0], compression)) + b"$-1\r\n" + b"-WRONGTYPE not a string\r\n"
            + bulk(bytes(bad)) + b"_\r\n")
    replies = read_all(wire, wants, feed_size=777)
    assert replies[0].obj is not None and torch.equal(replies[0].obj.tensor, chunk_data(keys[0], LAYOUT))
    assert replies[0].nbytes == len(value_of(keys[0], compression))
    assert [(r.stored, r.obj is None, r.error is None) for r in replies[1:]] == [
        (False, True, True), (True, True, False), (True, True, False), (False, True, True)]
    replies[0].obj.release()
    assert wants[0].staging.used_count == 0


def test_wrong_length_or_key_is_an_error_and_the_stream_stays_in_step() -> None:
    keys = keys_of(3)
    wants = expected(keys)
    wire = bulk(value_of(keys[0])[:-10]) + bulk(value_of(keys[2])) + bulk(value_of(keys[2]))
    first, second, third = read_all(wire, wants)
    assert first.error is not None and "value is" in str(first.error)
    assert second.error is not None and "another key" in str(second.error)
    assert third.obj is not None and torch.equal(third.obj.tensor, chunk_data(keys[2], LAYOUT))
    third.obj.release()


def test_full_staging_skips_the_value() -> None:
    keys = keys_of(2)
    wants = expected(keys, slots=1)
    first, second = read_all(bulk(value_of(keys[0])) + bulk(value_of(keys[1])), wants)
    assert first.obj is not None
    assert (second.stored, second.obj, second.error) == (True, None, None)
    first.obj.release()


@pytest.mark.parametrize("wire", [b"+OK\r\n", b"$abc\r\n", b"$%d\r\n" % (serde.HEADER_SIZE + CHUNK_BYTES)])
def test_a_broken_stream_raises_and_releases(wire: bytes) -> None:
    wants = expected(keys_of(1))
    key = wants[0].key
    if wire.startswith(b"$") and wire[1:2].isdigit():
        wire += value_of(key)[: serde.HEADER_SIZE + 100]  # the server went away mid-payload
    with pytest.raises((ProtocolError, asyncio.IncompleteReadError)):
        read_all(wire, wants)
    assert wants[0].staging.used_count == 0


def test_decode_value_matches_read_reply() -> None:
    keys = keys_of(2)
    wants = expected(keys)
    hit = decode_value(value_of(keys[0]), wants[0])
    assert hit.obj is not None and torch.equal(hit.obj.tensor, chunk_data(keys[0], LAYOUT))
    hit.obj.release()
    assert decode_value(None, wants[1]).stored is False
    assert decode_value(value_of(keys[0]), wants[1]).error is not None
    assert decode_value(b"short", wants[1]).error is not None
