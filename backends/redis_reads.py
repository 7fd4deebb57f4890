"""Reading the Redis tier's chunks through its one reply reader (``backends/redis_replies.py``):
whole chunks into staging objects (``get_many``) and layer groups into the caller's chunks
(``read_layers``). The two-key layout and its checks are in ``backends/redis_pairs.py``.

Both send one pipeline, then read its replies in order under one ``switched_replies``: every
payload byte is received by the socket straight into the chunk it belongs to and hashed as it
lands, while it is still in cache; the payload's last bytes (the tail) come with the head. One
function, ``_read_head``, checks a head for both (its serde header against the key, shape,
dtype and quantization, its size against the header) and keeps its tail.

Whole chunks (``read_whole_on``): one ``MGET head body`` per chunk, which reads both keys at one
instant, so a chunk written or deleted meanwhile is seen whole or not at all; only a key Redis
evicted or expired alone makes a ``HalfChunk``. The body goes into a staging object allocated
once the head and the body's size check out (a full arena: the body is skipped); lz4 and
quantized payloads are received whole into scratch memory, then decoded.

Layer groups (``read_layers_on``): the payload is raw and layer-major, so layers ``[lo, hi)`` are
payload bytes ``lo * L .. hi * L - 1`` (L: one layer's bytes): a ``GETRANGE`` of the body at
those offsets, then, for the last group(s), bytes of the tail. One pipeline asks ``GET`` of every
head and ``STRLEN`` of every body (a missing head: a missing chunk; a head without its body: a
``HalfChunk``), then ``GETRANGE`` of group 0 of every body, then group 1, and so on; each chunk's
running checksum is checked after its last group. Raw values only: compressed or quantized chunks
and cluster mode go through whole reads.

A value of the wrong size, type, header or checksum fails its key only; a broken stream raises
``ProtocolError`` (or the transport's errors), after which the connection must be dropped
(``redis_clients.read_or_drop``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from kvlayer import serde
from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj, release_all

from .redis_pairs import (
    MISS,
    ChunkNames,
    Expected,
    HalfChunk,
    Reply,
    check_body,
    check_head,
    decoded,
    tail_len,
)
from .redis_replies import BufferedReplies, ProtocolError, parse_bulk_size, switched_replies


async def _read_head(wire: BufferedReplies, size: int, key: ChunkKey, shape: tuple[int, ...], dtype: torch.dtype,
                     quantization: str = "none",
                     ) -> tuple[serde.ChunkHeader | None, bytes, serde.ChunkFormatError | None]:
    """Read a ``size``-byte head value (after its length line, through its CRLF): ``(header, tail,
    None)`` if it is ``key``'s chunk of ``shape``, ``dtype`` and ``quantization``, else ``(None, b"", why)``."""
    head = await wire.exactly(min(size, serde.HEADER_SIZE))
    try:
        header = check_head(head, size, key, shape, dtype, quantization)
    except serde.ChunkFormatError as e:
        await wire.skip(size - len(head))
        return None, b"", e
    tail = await wire.exactly(size - len(head))
    await wire.crlf()
    return header, tail, None


# --- whole chunks ------------------------------------------------------------------------
async def read_whole_on(conn: Any, names: Sequence[ChunkNames], wants: Sequence[Expected]) -> list[Reply]:
    """``MGET`` each chunk's two keys ``names[i]`` on the redis-py connection ``conn`` and read the
    replies into staging objects: each key's ``Reply`` (its ``obj`` owned by the caller)."""
    await conn.send_packed_command(conn.pack_commands([("MGET", *n) for n in names]))
    with switched_replies(conn) as wire:
        return await read_pairs(wire, wants)


async def read_pairs(wire: BufferedReplies, wants: Sequence[Expected]) -> list[Reply]:
    """Read one ``MGET head body`` reply per ``wants``; on any failure the objects read are released."""
    replies: list[Reply] = []
    try:
        for want in wants:
            replies.append(await _read_pair(wire, want))
    except BaseException:
        release_all(r.obj for r in replies if r.obj is not None)
        raise
    return replies


async def _read_pair(wire: BufferedReplies, want: Expected) -> Reply:
    line = await wire.line()
    if line[:1] == b"-":  # e.g. NOPERM
        return Reply(None, True, serde.ChunkFormatError(f"error reply: {line[1:-2].decode(errors='replace')[:80]}"))
    if line != b"*2\r\n":
        raise ProtocolError(f"unexpected reply to MGET: {line[:80]!r}")
    head_size = await wire.bulk_size()
    header, tail, error = (await _read_head(wire, head_size, want.key, want.shape, want.dtype, want.quantization)
                           if head_size >= 0 else (None, b"", None))
    size = await wire.bulk_size()
    nbytes = max(head_size, 0) + max(size, 0)
    if head_size < 0 and size < 0:
        return MISS
    if header is not None and size >= 0:
        try:
            check_body(header, size)
        except serde.ChunkFormatError as e:
            error = e
        else:
            return await _read_body(wire, header, size, tail, nbytes, want)
    if size >= 0:
        await wire.skip(size)
    return Reply(None, True, error or HalfChunk(f"{'body' if size < 0 else 'head'} missing"), nbytes)


async def _read_body(wire: BufferedReplies, header: serde.ChunkHeader, size: int, tail: bytes, nbytes: int,
                     want: Expected) -> Reply:
    """The reply for a checked head and the ``size``-byte body (then CRLF) coming next."""
    if not header.raw:
        payload = memoryview(bytearray(size + len(tail)))
        await wire.into(payload[:size])
        await wire.crlf()
        payload[size:] = tail
        return decoded(header, payload, nbytes, want)
    obj = want.staging.allocate(header.shape, header.dtype)
    if obj is None:
        await wire.skip(size)
        return Reply(None, True, None, nbytes)
    try:
        hasher = xxhash.xxh3_64()
        dst = memoryview(obj.tensor.view(-1).view(torch.uint8).numpy())
        await wire.into(dst[:size], hasher)
        await wire.crlf()
        dst[size:] = tail
        hasher.update(tail)
    except BaseException:
        obj.release()
        raise
    if hasher.intdigest() != header.payload_checksum:
        obj.release()
        return Reply(None, True, serde.ChunkFormatError("payload checksum mismatch"), nbytes)
    return Reply(obj, True, None, nbytes)


# --- layer groups ------------------------------------------------------------------------
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
    why not; a never-started value is a missing key).
    """
    values = [RangedValue(k, o) for k, o in zip(keys, outs, strict=True)]
    commands: list[tuple[Any, ...]] = [c for n in names for c in (("GET", n.head), ("STRLEN", n.body))]
    for lo, hi in groups:
        for n, v in zip(names, values):
            start, end = v.body_span(lo, hi)
            if start < end:  # GETRANGE's end is inclusive: an empty range cannot be asked for
                commands.append(("GETRANGE", n.body, start, end - 1))
    await conn.send_packed_command(conn.pack_commands(commands))
    with switched_replies(conn) as wire:
        for v in values:
            await _read_head_reply(wire, v)
            await _read_body_length(wire, v)
        for g, (lo, hi) in enumerate(groups):
            for v in values:
                start, end = v.body_span(lo, hi)
                if start < end:
                    await _read_range(wire, v, start, end)
                v.add_tail(lo, hi)
            on_group(g)
    return values


async def _error_or_line(wire: BufferedReplies, v: RangedValue) -> bytes | None:
    """The next reply's first line, or None after failing ``v`` for an error reply (e.g. WRONGTYPE)."""
    line = await wire.line()
    if line[:1] == b"-":
        v.fail(serde.ChunkFormatError(f"not a string value: {line[1:80]!r}"))
        return None
    return line


async def _read_head_reply(wire: BufferedReplies, v: RangedValue) -> None:
    """Read a head's GET reply: a raw chunk of ``v``'s shape gives ``v`` its header and tail."""
    line = await _error_or_line(wire, v)
    size = -1 if line is None else parse_bulk_size(line)
    if size < 0:
        return
    v.nbytes += size
    header, tail, error = await _read_head(wire, size, v.key, tuple(v.out.shape), v.out.dtype)
    if header is not None and (not header.raw or header.payload_len != len(v.dst)):
        header, error = None, serde.ChunkFormatError("not a raw chunk of this shape")
    if error is not None:
        v.fail(error)
    v.header, v.tail = header, tail


async def _read_body_length(wire: BufferedReplies, v: RangedValue) -> None:
    """Read a body's STRLEN reply (0: no body); a body of another size fails ``v``."""
    line = await _error_or_line(wire, v)
    if line is None:
        return
    if line[:1] != b":":
        raise ProtocolError(f"unexpected reply to STRLEN: {line[:80]!r}")
    size = int(line[1:-2])
    if v.reading and v.header is not None:
        if size == 0:
            v.fail(HalfChunk("body missing"))
            return
        try:
            check_body(v.header, size)
        except serde.ChunkFormatError as e:
            v.fail(e)


async def _read_range(wire: BufferedReplies, v: RangedValue, start: int, end: int) -> None:
    """Read one GETRANGE reply into ``v``'s chunk bytes ``[start, end)`` (or past it once ``v`` failed)."""
    line = await _error_or_line(wire, v)
    if line is None:
        return
    size = parse_bulk_size(line)
    if v.reading and size != end - start:  # the body changed since its STRLEN
        v.fail(serde.ChunkFormatError(f"body range is {size} bytes, expected {end - start}"))
    if not v.reading:
        if size >= 0:  # a null (never from GETRANGE) has no bytes to skip
            await wire.skip(size)
        return
    await wire.into(memoryview(v.dst)[start:end], v.hasher)
    await wire.crlf()
    v.nbytes += size
