"""Reading the Redis tier's chunks layer group by layer group (``StorageBackend.read_layers``).

A chunk value is ``serde`` header + raw payload, layer-major, so layers ``[lo, hi)`` are the
value's bytes ``HEADER_SIZE + lo * L .. HEADER_SIZE + hi * L - 1`` (L: one layer's bytes).
One pipeline asks ``GETRANGE`` for group 0 of every key (with the header in front), then
group 1 of every key, and so on; the replies are read in that order straight from the
connection's stream into the caller's chunks (``redis_reads``), each value's bytes feeding a
running checksum checked after its last group. A ``STRLEN`` of each key comes first
(0: a missing key). A value of the wrong size, type, header or checksum fails its key only. Raw values only:
compressed chunks and cluster mode go through whole ``GET``s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import torch
import xxhash

from kvlayer import serde
from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj

from .redis_reads import ProtocolError, read_into, skip_reply


class RangedValue:
    """One key's read state: where its bytes go, its running checksum and its first error."""

    def __init__(self, key: ChunkKey, out: MemoryObj) -> None:
        self.key = key
        self.out = out
        self.dst = out.tensor.view(-1).view(torch.uint8).numpy()
        self.layer_bytes = len(self.dst) // out.shape[0]
        self.hasher = xxhash.xxh3_64()
        self.header: serde.ChunkHeader | None = None
        self.error: serde.ChunkFormatError | None = None
        self.nbytes = 0

    def span(self, lo: int, hi: int, first: bool) -> tuple[int, int]:
        """The inclusive value byte range of layers ``[lo, hi)`` (from byte 0 for the first group)."""
        start = 0 if first else serde.HEADER_SIZE + lo * self.layer_bytes
        return start, serde.HEADER_SIZE + hi * self.layer_bytes - 1

    def verified(self) -> bool:
        if self.error is None and self.header is not None:
            if self.hasher.intdigest() == self.header.payload_checksum:
                return True
            self.error = serde.ChunkFormatError("payload checksum mismatch")
        return False


async def read_layers_on(conn: Any, names: Sequence[bytes], keys: Sequence[ChunkKey], outs: Sequence[MemoryObj],
                         groups: Sequence[tuple[int, int]], on_group: Callable[[int], None]) -> list[RangedValue]:
    """Send the ranged reads of ``names`` on the redis-py connection ``conn`` and fill ``outs``.

    Answers each key's ``RangedValue`` (``verified()`` tells whether it holds the chunk, ``error``
    why not; a never-started value is a missing key). Raises ProtocolError (or the stream's
    errors) if the stream breaks, after which the connection must be dropped.
    """
    values = [RangedValue(k, o) for k, o in zip(keys, outs, strict=True)]
    commands = [("STRLEN", name) for name in names]
    commands += [("GETRANGE", name, *v.span(lo, hi, g == 0))
                 for g, (lo, hi) in enumerate(groups) for name, v in zip(names, values)]
    await conn.send_packed_command(conn.pack_commands(commands))
    stream: asyncio.StreamReader = conn._reader
    for v in values:
        await _read_length(stream, v)
    for g, (lo, hi) in enumerate(groups):
        for v in values:
            await _read_group(stream, v, lo, hi, g == 0)
        on_group(g)
    return values


async def _read_length(stream: asyncio.StreamReader, v: RangedValue) -> None:
    """Read one STRLEN reply: a value of another size than a raw chunk's fails ``v``."""
    line = await stream.readuntil(b"\r\n")
    if line[:1] == b"-":
        v.error = serde.ChunkFormatError(f"not a string value: {line[1:80]!r}")
        return
    if line[:1] != b":":
        raise ProtocolError(f"unexpected reply to STRLEN: {line[:80]!r}")
    size = int(line[1:-2])
    if size and size != serde.HEADER_SIZE + len(v.dst):
        v.error = serde.ChunkFormatError(f"value is {size} bytes, a raw chunk {serde.HEADER_SIZE + len(v.dst)}")


async def _read_group(stream: asyncio.StreamReader, v: RangedValue, lo: int, hi: int, first: bool) -> None:
    """Read one GETRANGE reply into ``v``'s chunk (or past it once ``v`` failed)."""
    start, end = v.span(lo, hi, first)
    line = await stream.readuntil(b"\r\n")
    if line[:1] != b"$":
        if line[:1] == b"-":  # e.g. WRONGTYPE
            v.error = v.error or serde.ChunkFormatError(f"not a string value: {line[1:80]!r}")
            return
        raise ProtocolError(f"unexpected reply to GETRANGE: {line[:80]!r}")
    try:
        size = int(line[1:-2])
    except ValueError:
        raise ProtocolError(f"bad bulk length in {line[:80]!r}") from None
    if v.error is not None or size != end - start + 1:
        if v.error is None and (size or not first):  # an empty first range: the key is missing
            v.error = serde.ChunkFormatError(f"value range is {size} bytes, expected {end - start + 1}")
        await skip_reply(stream, size)
        return
    if first:
        try:
            v.header = _checked_header(await stream.readexactly(serde.HEADER_SIZE), v)
        except serde.ChunkFormatError as e:
            v.error = e
            await skip_reply(stream, size - serde.HEADER_SIZE)
            return
        start = serde.HEADER_SIZE
    lo_byte = start - serde.HEADER_SIZE
    await read_into(stream, v.dst[lo_byte : end + 1 - serde.HEADER_SIZE], v.hasher)
    await skip_reply(stream, 0)
    v.nbytes += size


def _checked_header(head: bytes, v: RangedValue) -> serde.ChunkHeader:
    header = serde.decode_header(head)
    serde.check_header(header, v.key, tuple(v.out.shape), v.out.dtype)
    if header.compression != serde.COMPRESSION_CODES["none"] or header.payload_len != len(v.dst):
        raise serde.ChunkFormatError("not a raw chunk of this shape")
    return header
