"""Reading the Redis tier's chunks layer group by layer group (``StorageBackend.read_layers``).

A chunk is two keys (``backends/redis_pairs.py``): the head holds the serde header and the
payload's last bytes (the tail), the body the payload's first bytes. The payload is raw and
layer-major, so layers ``[lo, hi)`` are payload bytes ``lo * L .. hi * L - 1`` (L: one layer's
bytes): a ``GETRANGE`` of the body at those offsets, then, for the last group(s), bytes of the
tail. One pipeline asks ``GET`` of every head and ``STRLEN`` of every body (a missing head:
a missing chunk; a head without its body: a ``HalfChunk``), then ``GETRANGE`` of group 0 of
every body, then group 1, and so on; the replies are read in that order, each range received
by the socket straight into the caller's chunk (``redis_buffered``), its bytes feeding the
chunk's running checksum as they land, checked after its last group. A value of the wrong
size, type, header or checksum fails its key only. Raw values only: compressed chunks and
cluster mode go through whole reads (``MGET``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from kvlayer import serde
from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj

from .redis_buffered import BufferedReplies, switched_replies
from .redis_pairs import ChunkNames, HalfChunk, body_len, check_head, tail_len
from .redis_reads import ProtocolError, parse_bulk_size


class RangedValue:
    """One chunk's read state: where its bytes go, its running checksum and its first error
    (``header`` None and no ``error``: its head is missing, the chunk is a plain miss)."""

    def __init__(self, key: ChunkKey, out: MemoryObj) -> None:
        self.key = key
        self.out = out
        self.dst = out.tensor.view(-1).view(torch.uint8).numpy()
        self.layer_bytes = len(self.dst) // out.shape[0]
        self.body_bytes = len(self.dst) - tail_len(len(self.dst))
        self.hasher = xxhash.xxh3_64()
        self.header: serde.ChunkHeader | None = None
        self.tail = b""
        self.error: serde.ChunkFormatError | None = None
        self.nbytes = 0

    @property
    def reading(self) -> bool:
        """Whether its bytes still go into its chunk (its head was valid, nothing failed since)."""
        return self.header is not None and self.error is None

    def body_span(self, lo: int, hi: int) -> tuple[int, int]:
        """The body (and payload) bytes ``[start, end)`` of layers ``[lo, hi)``, without the tail's."""
        return min(lo * self.layer_bytes, self.body_bytes), min(hi * self.layer_bytes, self.body_bytes)

    def add_tail(self, lo: int, hi: int) -> None:
        """Copy and hash the part of layers ``[lo, hi)`` the head held (after their body bytes)."""
        start, end = max(lo * self.layer_bytes, self.body_bytes), min(hi * self.layer_bytes, len(self.dst))
        if self.reading and start < end:
            piece = self.tail[start - self.body_bytes : end - self.body_bytes]
            self.hasher.update(piece)
            self.dst[start:end] = np.frombuffer(piece, dtype=np.uint8)

    def fail(self, error: serde.ChunkFormatError) -> None:
        """Record why the chunk is not valid (its first reason is kept)."""
        self.error = self.error or error

    def verified(self) -> bool:
        """Whether every byte arrived and matches the header's checksum (call after the last group)."""
        if self.reading and self.header is not None:
            if self.hasher.intdigest() == self.header.payload_checksum:
                return True
            self.error = serde.ChunkFormatError("payload checksum mismatch")
        return False


async def read_layers_on(conn: Any, names: Sequence[ChunkNames], keys: Sequence[ChunkKey],
                         outs: Sequence[MemoryObj], groups: Sequence[tuple[int, int]],
                         on_group: Callable[[int], None]) -> list[RangedValue]:
    """Send the ranged reads of the chunks ``names`` on the redis-py connection ``conn`` and fill ``outs``.

    Answers each key's ``RangedValue`` (``verified()`` tells whether it holds the chunk, ``error``
    why not; a never-started value is a missing key). Raises ProtocolError (or the stream's
    errors) if the stream breaks, after which the connection must be dropped.
    """
    values = [RangedValue(k, o) for k, o in zip(keys, outs, strict=True)]
    commands: list[tuple[Any, ...]] = [c for n in names for c in (("GET", n.head), ("STRLEN", n.body))]
    for lo, hi in groups:
        for n, v in zip(names, values):
            start, end = v.body_span(lo, hi)
            if start < end:  # GETRANGE's end is inclusive: an empty range cannot be asked for
                commands.append(("GETRANGE", n.body, start, end - 1))
    await conn.send_packed_command(conn.pack_commands(commands))
    with switched_replies(conn) as replies:
        for v in values:
            await _read_head(replies, v)
            await _read_body_length(replies, v)
        for g, (lo, hi) in enumerate(groups):
            for v in values:
                start, end = v.body_span(lo, hi)
                if start < end:
                    await _read_range(replies, v, start, end)
                v.add_tail(lo, hi)
            on_group(g)
    return values


async def _error_or_line(replies: BufferedReplies, v: RangedValue) -> bytes | None:
    """The next reply's first line, or None after failing ``v`` for an error reply (e.g. WRONGTYPE)."""
    line = await replies.line()
    if line[:1] == b"-":
        v.fail(serde.ChunkFormatError(f"not a string value: {line[1:80]!r}"))
        return None
    return line


async def _read_head(replies: BufferedReplies, v: RangedValue) -> None:
    """Read a head's GET reply: check its header, keep its tail."""
    line = await _error_or_line(replies, v)
    size = -1 if line is None else parse_bulk_size(line)
    if size < 0:
        return
    head = await replies.exactly(min(size, serde.HEADER_SIZE))
    v.nbytes += size
    try:
        header = check_head(head, size, v.key, tuple(v.out.shape), v.out.dtype)
        if header.compression != serde.COMPRESSION_CODES["none"] or header.payload_len != len(v.dst):
            raise serde.ChunkFormatError("not a raw chunk of this shape")
    except serde.ChunkFormatError as e:
        v.fail(e)
        await replies.skip(size - len(head))
        return
    v.tail = await replies.exactly(size - len(head))
    await replies.crlf()
    v.header = header


async def _read_body_length(replies: BufferedReplies, v: RangedValue) -> None:
    """Read a body's STRLEN reply (0: no body); a body of another size fails ``v``."""
    line = await _error_or_line(replies, v)
    if line is None:
        return
    if line[:1] != b":":
        raise ProtocolError(f"unexpected reply to STRLEN: {line[:80]!r}")
    size = int(line[1:-2])
    if v.reading and v.header is not None:
        if size == 0:
            v.fail(HalfChunk("body missing"))
        elif size != body_len(v.header):
            v.fail(serde.ChunkFormatError(f"body is {size} bytes, its header says {body_len(v.header)}"))


async def _read_range(replies: BufferedReplies, v: RangedValue, start: int, end: int) -> None:
    """Read one GETRANGE reply into ``v``'s chunk bytes ``[start, end)`` (or past it once ``v`` failed)."""
    line = await _error_or_line(replies, v)
    if line is None:
        return
    size = parse_bulk_size(line)
    if v.reading and size != end - start:  # the body changed since its STRLEN
        v.fail(serde.ChunkFormatError(f"body range is {size} bytes, expected {end - start}"))
    if not v.reading:
        if size >= 0:  # a null (never from GETRANGE) has no bytes to skip
            await replies.skip(size)
        return
    await replies.into(memoryview(v.dst)[start:end], v.hasher)
    await replies.crlf()
    v.nbytes += size
