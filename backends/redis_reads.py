"""Reading the Redis tier's chunks into staging objects, one ``MGET head body`` reply each
(used by ``backends/redis.py``; the two-key layout is in ``backends/redis_pairs.py``).

``read_reply`` reads one RESP2/RESP3 ``MGET`` reply from a connection's stream itself instead of
through redis-py's reply parser, which copies each value several times (into the parser's
buffer, growing it, then into a new ``bytes``) before the tier could check it and copy it again.
The head comes first: its header is checked and its tail kept; then the body is hashed and
copied straight from the stream's read buffer into the staging tensor, one slice at a time
while it is still in cache, and the tail goes after it. lz4 payloads are read whole, then decoded.
One ``MGET`` reads both keys at one instant, so a chunk written or deleted meanwhile is seen
whole or not at all; only a key Redis evicted or expired alone makes a ``HalfChunk``.

``decode_pair`` turns values redis-py already read (the cluster path) into the same ``Reply``.
Both follow the serde format's checks: any mismatch is a ``Reply`` with ``error`` set, never data.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvlayer import serde
from kvlayer.keys import ChunkKey
from kvlayer.memory import Arena, MemoryObj

from .redis_pairs import HalfChunk, check_body, check_head

_READ_SIZE = 1 << 20


class ProtocolError(ConnectionError):
    """The connection's stream holds something other than the expected reply: it cannot be reused."""


@dataclass(frozen=True, slots=True)
class Expected:
    """What a key's chunk must be: its key, shape and dtype, and the arena its copy goes to."""

    key: ChunkKey
    shape: tuple[int, ...]
    dtype: torch.dtype
    staging: Arena


@dataclass(frozen=True, slots=True)
class Reply:
    """A chunk read: ``obj`` on a hit (one reference, owned by the caller); ``stored`` whether
    either of its keys held a value; ``error`` why the values are not the key's chunk (a
    ``HalfChunk`` when one key is missing; ``stored`` with neither ``obj`` nor ``error``: the
    staging arena was full); ``nbytes`` the values' size."""

    obj: MemoryObj | None
    stored: bool
    error: serde.ChunkFormatError | None = None
    nbytes: int = 0


MISS = Reply(None, False)


async def read_reply(stream: asyncio.StreamReader, want: Expected) -> Reply:
    """Read one ``MGET head body`` reply from ``stream``; ProtocolError (or the stream's own
    errors) if the stream breaks or holds no such reply, after which the connection must be dropped."""
    line = await stream.readuntil(b"\r\n")
    if line[:1] == b"-":  # e.g. NOPERM
        return Reply(None, True, serde.ChunkFormatError(f"error reply: {line[1:-2].decode(errors='replace')[:80]}"))
    if line != b"*2\r\n":
        raise ProtocolError(f"unexpected reply to MGET: {line[:80]!r}")
    head_size = await bulk_size(stream)
    header, tail, error = await _read_head(stream, head_size, want) if head_size >= 0 else (None, b"", None)
    size = await bulk_size(stream)
    nbytes = max(head_size, 0) + max(size, 0)
    if head_size < 0 and size < 0:
        return MISS
    if header is not None and size >= 0:
        try:
            check_body(header, size)
        except serde.ChunkFormatError as e:
            error = e
        else:
            return await _read_body(stream, header, size, tail, nbytes, want)
    if size >= 0:
        await skip_reply(stream, size)
    return Reply(None, True, error or HalfChunk(f"{'body' if size < 0 else 'head'} missing"), nbytes)


def decode_pair(head: Any, body: Any, want: Expected) -> Reply:
    """The ``Reply`` for a head and a body value redis-py read (bytes, or None for a missing key)."""
    if head is None and body is None:
        return MISS
    if not isinstance(head, bytes) or not isinstance(body, bytes):
        return Reply(None, True, HalfChunk(f"{'body' if body is None else 'head'} missing"), len(head or body or b""))
    nbytes = len(head) + len(body)
    try:
        header = check_head(head, len(head), want.key, want.shape, want.dtype)
        check_body(header, len(body))
    except serde.ChunkFormatError as e:
        return Reply(None, True, e, nbytes)
    return _decoded(header, body + head[serde.HEADER_SIZE:], nbytes, want)


def _decoded(header: serde.ChunkHeader, payload: bytes | memoryview, size: int, want: Expected) -> Reply:
    """The reply for values of ``size`` bytes with a checked ``header`` and their ``payload``."""
    obj = want.staging.allocate(header.shape, header.dtype)
    if obj is None:
        return Reply(None, True, None, size)
    try:
        serde.decode_payload(header, payload, obj.tensor)
    except serde.ChunkFormatError as e:
        obj.release()
        return Reply(None, True, e, size)
    except BaseException:
        obj.release()
        raise
    return Reply(obj, True, None, size)


async def _read_head(stream: asyncio.StreamReader, size: int,
                     want: Expected) -> tuple[serde.ChunkHeader | None, bytes, serde.ChunkFormatError | None]:
    """Read a ``size``-byte head (then CRLF): ``(header, tail, None)`` if it is ``want``'s, else
    ``(None, b"", why)``."""
    head = await stream.readexactly(min(size, serde.HEADER_SIZE))
    try:
        header = check_head(head, size, want.key, want.shape, want.dtype)
    except serde.ChunkFormatError as e:
        await skip_reply(stream, size - len(head))
        return None, b"", e
    tail = await stream.readexactly(size - len(head))
    await skip_reply(stream, 0)
    return header, tail, None


async def _read_body(stream: asyncio.StreamReader, header: serde.ChunkHeader, size: int, tail: bytes,
                     nbytes: int, want: Expected) -> Reply:
    """The reply for a checked head and the ``size``-byte body (then CRLF) coming next on ``stream``."""
    if header.compression != serde.COMPRESSION_CODES["none"]:
        body = await stream.readexactly(size)
        await skip_reply(stream, 0)
        return _decoded(header, body + tail, nbytes, want)
    obj = want.staging.allocate(header.shape, header.dtype)
    if obj is None:
        await skip_reply(stream, size)
        return Reply(None, True, None, nbytes)
    try:
        hasher = xxhash.xxh3_64()
        dst = obj.tensor.view(-1).view(torch.uint8).numpy()
        await read_into(stream, dst[:size], hasher)
        await skip_reply(stream, 0)
        hasher.update(tail)
        dst[size:] = np.frombuffer(tail, dtype=np.uint8)
    except BaseException:
        obj.release()
        raise
    if hasher.intdigest() != header.payload_checksum:
        obj.release()
        return Reply(None, True, serde.ChunkFormatError("payload checksum mismatch"), nbytes)
    return Reply(obj, True, None, nbytes)


async def bulk_size(stream: asyncio.StreamReader) -> int:
    """Read a bulk string's length line: its size, or -1 for a null (RESP2 ``$-1``, RESP3 ``_``)."""
    return parse_bulk_size(await stream.readuntil(b"\r\n"))


def parse_bulk_size(line: bytes) -> int:
    """The size a bulk string's length ``line`` announces, or -1 for a null; ProtocolError if it is none."""
    if line == b"_\r\n":
        return -1
    if line[:1] != b"$":
        raise ProtocolError(f"expected a bulk string, got {line[:80]!r}")
    try:
        return max(int(line[1:-2]), -1)
    except ValueError:
        raise ProtocolError(f"bad bulk length in {line[:80]!r}") from None


async def read_into(stream: asyncio.StreamReader, out: np.ndarray, hasher: Any) -> None:
    """Fill ``out`` (uint8) from ``stream``, feeding the bytes to ``hasher`` (an xxh3 state)."""
    done = 0
    while done < len(out):
        data = await stream.read(min(len(out) - done, _READ_SIZE))
        if not data:
            raise ProtocolError("the server closed the connection mid-reply")
        hasher.update(data)
        out[done:done + len(data)] = np.frombuffer(data, dtype=np.uint8)
        done += len(data)


async def skip_reply(stream: asyncio.StreamReader, n: int) -> None:
    """Drop ``n`` bytes of a value, then the CRLF ending it."""
    while n > 0:
        data = await stream.read(min(n, _READ_SIZE))
        if not data:
            raise ProtocolError("the server closed the connection mid-reply")
        n -= len(data)
    if await stream.readexactly(2) != b"\r\n":
        raise ProtocolError("a value not followed by CRLF")
