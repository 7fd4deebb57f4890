"""Reading the Redis tier's ``GET`` replies into staging objects (used by ``backends/redis.py``).

``read_reply`` reads one RESP2/RESP3 ``GET`` reply from a connection's stream itself instead of
through redis-py's reply parser, which copies each value several times (into the parser's
buffer, growing it, then into a new ``bytes``) before the tier could check it and copy it again.
Here the header is parsed from the value's first ``serde.HEADER_SIZE`` bytes, and the payload is
hashed and copied straight from the stream's read buffer into the staging tensor, one slice at a
time while it is still in cache. lz4 payloads are read whole, then decoded.

``decode_value`` turns a value redis-py already read (the cluster path) into the same ``Reply``.
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

_READ_SIZE = 1 << 20


class ProtocolError(ConnectionError):
    """The connection's stream holds something other than a ``GET`` reply: it cannot be reused."""


@dataclass(frozen=True, slots=True)
class Expected:
    """What a key's chunk must be: its key, shape and dtype, and the arena its copy goes to."""

    key: ChunkKey
    shape: tuple[int, ...]
    dtype: torch.dtype
    staging: Arena


@dataclass(frozen=True, slots=True)
class Reply:
    """A ``GET`` reply for one key: ``obj`` on a hit (one reference, owned by the caller);
    ``stored`` whether the key held a value; ``error`` why that value is not the key's chunk
    (``stored`` with neither ``obj`` nor ``error``: the staging arena was full); ``nbytes`` its size."""

    obj: MemoryObj | None
    stored: bool
    error: serde.ChunkFormatError | None = None
    nbytes: int = 0


MISS = Reply(None, False)


async def read_reply(stream: asyncio.StreamReader, want: Expected) -> Reply:
    """Read one ``GET`` reply from ``stream``; ProtocolError (or the stream's own errors) if the
    stream breaks or holds no such reply, after which the connection must be dropped."""
    line = await stream.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    if kind == b"$":
        try:
            size = int(rest)
        except ValueError:
            raise ProtocolError(f"bad bulk length in {line[:80]!r}") from None
        return MISS if size < 0 else await _read_value(stream, size, want)
    if kind == b"_":  # RESP3's null
        return MISS
    if kind == b"-":  # e.g. WRONGTYPE: the key holds something that is not a string
        error = serde.ChunkFormatError(f"not a string value: {rest.decode(errors='replace')[:80]}")
        return Reply(None, True, error)
    raise ProtocolError(f"unexpected reply to GET: {line[:80]!r}")


def decode_value(value: Any, want: Expected) -> Reply:
    """The ``Reply`` for a value redis-py read (bytes, None for a miss, or an error reply)."""
    if value is None:
        return MISS
    if not isinstance(value, bytes):
        return Reply(None, True, serde.ChunkFormatError(f"not a string value: {value!r:.80}"))
    view = memoryview(value)
    try:
        header = _checked_header(view[: serde.HEADER_SIZE], len(value), want)
    except serde.ChunkFormatError as e:
        return Reply(None, True, e, len(value))
    return _decoded(header, view[serde.HEADER_SIZE:], len(value), want)


def _decoded(header: serde.ChunkHeader, payload: bytes | memoryview, size: int, want: Expected) -> Reply:
    """The reply for a value of ``size`` bytes with a checked ``header`` and its ``payload``."""
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


def _checked_header(head: bytes | memoryview, size: int, want: Expected) -> serde.ChunkHeader:
    """The header of a ``size``-byte value starting with ``head``, if it is ``want``'s chunk."""
    header = serde.decode_header(head)
    serde.check_header(header, want.key, want.shape, want.dtype)
    if size != serde.HEADER_SIZE + header.payload_len:
        raise serde.ChunkFormatError(f"value is {size} bytes, header says {serde.HEADER_SIZE + header.payload_len}")
    return header


async def _read_value(stream: asyncio.StreamReader, size: int, want: Expected) -> Reply:
    """The reply for a ``size``-byte value whose bytes (then CRLF) come next on ``stream``."""
    head = await stream.readexactly(min(size, serde.HEADER_SIZE))
    try:
        header = _checked_header(head, size, want)
    except serde.ChunkFormatError as e:
        await skip_reply(stream, size - len(head))
        return Reply(None, True, e, size)
    if header.compression != serde.COMPRESSION_CODES["none"]:
        payload = await stream.readexactly(header.payload_len)
        await skip_reply(stream, 0)
        return _decoded(header, payload, size, want)
    obj = want.staging.allocate(header.shape, header.dtype)
    if obj is None:
        await skip_reply(stream, header.payload_len)
        return Reply(None, True, None, size)
    try:
        hasher = xxhash.xxh3_64()
        await read_into(stream, obj.tensor.view(-1).view(torch.uint8).numpy(), hasher)
        checksum = hasher.intdigest()
        await skip_reply(stream, 0)
    except BaseException:
        obj.release()
        raise
    if checksum != header.payload_checksum:
        obj.release()
        return Reply(None, True, serde.ChunkFormatError("payload checksum mismatch"), size)
    return Reply(obj, True, None, size)


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
