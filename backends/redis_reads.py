"""The Redis tier's one fast read path: raw chunks received over its own connections
(``backends/redis_wire.py``) straight into their destination, by payload range, for whole
chunks (``get_many``: into staging objects) and layer groups (``read_layers``: into the
caller's chunks) alike. Each chunk is one shared ranged read (``backends/byte_reads.py``: header
check, destination, running checksum); the two-key layout and its checks are in
``backends/redis_pairs.py``. Compressed or quantized tiers and cluster mode read through redis-py
instead (``redis_pairs.decode_pair``).

One pipeline asks, for every chunk, ``GET`` of its head, ``STRLEN`` and ``EXISTS`` of its body
(a missing key and an empty string both have length 0), then the bodies' ``GETRANGE`` of layer
group 0 of every chunk, then group 1, and so on. The payload is raw and layer-major, so layers
``[lo, hi)`` are payload bytes ``lo * L .. hi * L - 1`` (L: one layer's bytes); the payload's
last bytes (the tail) come with the head, and go into the chunk with the group that holds them.
A server runs the commands of a pipeline that arrived together back to back, so a head and its
body's length are seen together, as ``MGET`` sees them: a chunk with one string key (the other
missing, or of another type) is a ``HalfChunk``.

Per chunk: a head that is not the key's raw chunk of the expected shape, a body of another
length, an error reply or a range of the wrong size fail that chunk only (its bytes are skipped,
the stream stays in step); a chunk with no head and no body is a plain miss. A whole chunk's
staging object is allocated once its head and body length checked out (a full arena: its
ranges are skipped, ``stored`` and no error). A broken stream raises ``ProtocolError`` (or the
transport's errors); the wire is then dropped (``WirePool``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlayer import serde
from kvlayer.memory import Arena, MemoryObj

from .byte_reads import ChunkRead
from .redis_pairs import ChunkNames, HalfChunk, body_len, check_head_size, tail_len
from .redis_wire import ProtocolError, Wire, parse_bulk_size

RANGE_BYTES = 512 << 10
"""The most bytes one ``GETRANGE`` asks for: 8 bodies of 6 MiB came in 57-60 ms in ranges of 512
KiB (55-59 in 1 MiB, 61-64 in 2, 64-69 in 256 KiB), 66-71 in one range each (docs/benchmarks.md)."""


@dataclass(eq=False)
class ValueRead:
    """One chunk's read from its two keys ``names`` into ``chunk`` (the shared ranged read).

    Its destination is ``out`` if given (the caller's), else a staging object from ``staging``
    allocated once the head and body length checked out, and then owned by whoever holds this
    read. ``stored``: either key held a value; ``nbytes``: the bytes of the values received.
    """

    names: ChunkNames
    chunk: ChunkRead
    out: MemoryObj | None = None
    staging: Arena | None = None
    stored: bool = False
    nbytes: int = 0
    tail: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        self.body_bytes = self.chunk.payload_len - tail_len(self.chunk.payload_len)
        if self.out is not None:
            self.chunk.attach(self.out.tensor)

    def body_ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The body (and payload) bytes of layers ``[lo, hi)``, without the tail's, as ranges
        ``[start, end)`` of at most ``RANGE_BYTES`` (none when the tail holds those layers)."""
        start, end = (min(x, self.body_bytes) for x in self.chunk.layer_span(lo, hi))
        return [(i, min(i + RANGE_BYTES, end)) for i in range(start, end, RANGE_BYTES)]

    def add_tail(self, lo: int, hi: int) -> None:
        """Put the part of layers ``[lo, hi)`` the head held (after their body bytes) into the chunk."""
        start, end = (max(x, self.body_bytes) for x in self.chunk.layer_span(lo, hi))
        if self.chunk.reading and start < end:
            self.chunk.put(start, self.tail[start - self.body_bytes : end - self.body_bytes])

    def make_room(self) -> None:
        """Allocate the staging object of a whole-chunk read that has none (none if the arena is full)."""
        if self.out is None and self.staging is not None:
            self.out = self.staging.allocate(self.chunk.shape, self.chunk.dtype)
            if self.out is not None:
                self.chunk.attach(self.out.tensor)


def commands(values: Sequence[ValueRead], groups: Sequence[tuple[int, int]]) -> list[tuple[Any, ...]]:
    """The pipeline ``read_values`` reads the replies of."""
    out: list[tuple[Any, ...]] = [c for v in values for c in (("GET", v.names.head), ("STRLEN", v.names.body),
                                                               ("EXISTS", v.names.body))]
    for lo, hi in groups:
        # GETRANGE's end is inclusive (an empty range cannot be asked for: none is)
        out += [("GETRANGE", v.names.body, start, end - 1) for v in values for start, end in v.body_ranges(lo, hi)]
    return out


async def read_values(wire: Wire, values: Sequence[ValueRead], groups: Sequence[tuple[int, int]],
                      on_group: Callable[[int], None]) -> None:
    """Send ``commands(values, groups)`` on ``wire`` and fill each value's chunk, calling
    ``on_group(g)`` once group g of every chunk is in place. Afterwards ``v.chunk.verified()``
    tells whether ``v`` holds its chunk, ``v.chunk.error`` why not."""
    wire.send(commands(values, groups))
    for v in values:
        await _read_head(wire, v)
        await _read_body_length(wire, v)
    for g, (lo, hi) in enumerate(groups):
        for v in values:
            for start, end in v.body_ranges(lo, hi):
                await _read_range(wire, v, start, end)
            v.add_tail(lo, hi)
        on_group(g)


async def _error_or_line(wire: Wire, v: ValueRead) -> bytes | None:
    """The next reply's first line, or None for an error reply: a key of another type reads as
    missing (as ``MGET`` reads it); any other error (e.g. NOPERM) fails ``v``."""
    line = await wire.line()
    if line[:1] != b"-":
        return line
    if not line.startswith(b"-WRONGTYPE"):
        v.chunk.fail(serde.ChunkFormatError(f"error reply: {line[1:-2].decode(errors='replace')[:80]}"))
    return None


async def _read_head(wire: Wire, v: ValueRead) -> None:
    """Read a head's GET reply: a raw chunk of the expected shape opens ``v``'s chunk and keeps its tail."""
    line = await _error_or_line(wire, v)
    size = -1 if line is None else parse_bulk_size(line)
    if size < 0:
        return
    v.stored, v.nbytes = True, v.nbytes + size
    head = await wire.exactly(min(size, serde.HEADER_SIZE))
    header = v.chunk.open(head)
    if header is not None:
        try:
            check_head_size(header, size)
        except serde.ChunkFormatError as e:
            v.chunk.fail(e)
    if v.chunk.error is not None:
        await wire.skip(size - len(head))
        return
    v.tail = await wire.exactly(size - len(head))
    await wire.crlf()


async def _read_body_length(wire: Wire, v: ValueRead) -> None:
    """Read a body's STRLEN and EXISTS replies: one string key without the other is a half
    chunk; a body of another size fails ``v``; a whole-chunk read that checked out gets its
    staging object."""
    line = await _error_or_line(wire, v)
    size = -1 if line is None else _integer(line, "STRLEN")
    exists = await _error_or_line(wire, v)
    there = size >= 0 and exists is not None and _integer(exists, "EXISTS") == 1  # another type: none
    head = v.stored
    v.stored = head or there
    if v.chunk.error is not None or not v.stored:
        return
    if not head or not there:
        v.chunk.fail(HalfChunk(f"{'body' if head else 'head'} missing"))
    elif v.chunk.header is not None and size != body_len(v.chunk.header):
        v.chunk.fail(serde.ChunkFormatError(f"body is {size} bytes, its header says {body_len(v.chunk.header)}"))
    else:
        v.make_room()


def _integer(line: bytes, command: str) -> int:
    if line[:1] != b":":
        raise ProtocolError(f"unexpected reply to {command}: {line[:80]!r}")
    return int(line[1:-2])


async def _read_range(wire: Wire, v: ValueRead, start: int, end: int) -> None:
    """Read one GETRANGE reply into ``v``'s payload bytes ``[start, end)`` (or past it once ``v`` failed)."""
    line = await _error_or_line(wire, v)
    if line is None:
        if v.chunk.reading:  # the body turned into a key of another type since its STRLEN
            v.chunk.fail(HalfChunk("body gone"))
        return
    size = parse_bulk_size(line)
    if v.chunk.reading and size != end - start:  # the body changed since its STRLEN
        v.chunk.fail(serde.ChunkFormatError(f"body range is {size} bytes, expected {end - start}"))
    if not v.chunk.reading:
        if size >= 0:  # a null (never from GETRANGE) has no bytes to skip
            await wire.skip(size)
        return
    chunk = v.chunk
    await wire.into(chunk.claim(start, end), lambda lo, hi: chunk.landed(start + lo, start + hi))
    await wire.crlf()
    v.nbytes += size
