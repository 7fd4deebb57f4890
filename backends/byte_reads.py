"""One chunk read from a byte store range by range, straight into its destination, with a running
checksum: the read path every byte store shares (NVMe files, ``backends/nvme_files.py``; Redis
values, ``backends/redis_reads.py``; later S3 objects).

A byte store holds a chunk as its ``kvlayer.serde`` header, then its payload. A ``ChunkRead`` is
made with what the chunk must be (its key, shape and dtype: a raw payload of exactly the
destination's bytes, the only kind that can land in place by ranges), checks the header once the
store has its bytes (``open``), then takes the payload range by range, in any order: the caller
``claim``s a window of the destination, fills it (``preadv``, ``recv_into``), and says what
``landed`` (the whole window at once, or its pieces in order as they arrive); bytes already at
hand go in with ``put``. Ranges are typically layer groups (``kvlayer/read_plan.py``):
``layer_span`` turns layers into payload bytes.

The checksum (xxh3-64, the header's ``payload_checksum``) runs over the payload in order: bytes
that land right after those before them are hashed at once, while still in cache; a range that
lands early waits, in place, until the gap before it is filled. ``verified()`` is true only once
every payload byte landed and the checksum matches.

Faults of the store are kept, not raised: the first error (``ChunkFormatError`` for bytes that
are not the chunk, ``OSError`` for a store that could not be read) is ``error`` and ends the read
(a miss, which the tier counts). A range that overlaps one claimed before, lies outside the
payload, or lands where nothing was claimed is the caller's bug: ValueError, and the read fails
too. Not thread-safe: one thread at a time drives a read.
"""

from __future__ import annotations

import bisect
import math

import torch
import xxhash

from kvlayer import serde
from kvlayer.keys import ChunkKey


class ChunkRead:
    """``key``'s chunk (``shape`` and ``dtype``, raw) read into ``out``, a contiguous host tensor of
    that shape and dtype owned by the caller (given now, or later with ``attach``: a store that
    allocates the destination only once the header checked out).

    ``header`` is the checked header once ``open`` accepted it; ``error`` the first fault. The
    destination holds garbage unless ``verified()``.
    """

    def __init__(self, key: ChunkKey, shape: tuple[int, ...], dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> None:
        if len(shape) != 5:
            raise ValueError(f"a chunk has 5 dimensions, got shape {tuple(shape)}")
        self.key = key
        self.shape = tuple(shape)
        self.dtype = dtype
        self.payload_len = math.prod(self.shape) * torch.empty((), dtype=dtype).element_size()
        self.header: serde.ChunkHeader | None = None
        self.error: Exception | None = None
        self._dst: memoryview | None = None
        self._starts: list[int] = []
        self._claims: list[list[int]] = []
        """``[start, end, landed up to]`` of each claimed window, sorted by start (``_starts``)."""
        self._hashed = 0
        """Payload bytes hashed so far: every byte before it landed."""
        self._hasher = xxhash.xxh3_64()
        if out is not None:
            self.attach(out)

    @property
    def reading(self) -> bool:
        """Whether bytes still go into the destination: the header was accepted, a destination is
        attached and nothing failed."""
        return self.error is None and self.header is not None and self._dst is not None

    def attach(self, out: torch.Tensor) -> None:
        """Make ``out`` the destination; ValueError unless it is a contiguous host tensor of the
        read's shape and dtype, or if one is attached already."""
        if self._dst is not None:
            raise ValueError("the read already has a destination")
        if tuple(out.shape) != self.shape or out.dtype != self.dtype or out.device.type != "cpu" \
                or not out.is_contiguous():
            raise ValueError(f"the destination must be a contiguous host {self.dtype} tensor of shape {self.shape}")
        self._dst = memoryview(out.view(-1).view(torch.uint8).numpy())

    def open(self, head: bytes | bytearray | memoryview) -> serde.ChunkHeader | None:
        """Check the header at the start of ``head``: ``key``'s chunk of the read's shape and dtype,
        raw (neither compressed nor quantized). The header, or None when it is not (the reason
        then in ``error``) or the read failed before."""
        if self.header is not None:
            raise ValueError("the header was read already")
        if self.error is not None:
            return None
        try:
            header = serde.decode_header(head)
            serde.check_header(header, self.key, self.shape, self.dtype)
            if not header.raw:
                raise serde.ChunkFormatError("a compressed or quantized chunk cannot be read by ranges")
        except serde.ChunkFormatError as e:
            self.fail(e)
            return None
        self.header = header  # raw, of this shape and dtype: decode_header checked its payload_len
        return header

    def layer_span(self, lo: int, hi: int) -> tuple[int, int]:
        """The payload bytes ``[start, end)`` of layers ``[lo, hi)`` (the payload is layer-major;
        layers past the chunk's last hold none of its bytes)."""
        per_layer = self.payload_len // self.shape[0]
        return min(lo, self.shape[0]) * per_layer, min(hi, self.shape[0]) * per_layer

    def claim(self, start: int, end: int) -> memoryview:
        """The destination's bytes ``[start, end)`` of the payload, to fill and then report with
        ``landed``. ValueError (and the read fails) for an empty window, one outside the payload,
        or one that overlaps a window claimed before (a duplicate range)."""
        if self._dst is None:
            raise ValueError("the read has no destination yet")
        if not 0 <= start < end <= self.payload_len:
            self._refuse(f"range [{start}, {end}) is not inside the {self.payload_len}-byte payload")
        i = bisect.bisect_right(self._starts, start)
        if (i and self._claims[i - 1][1] > start) or (i < len(self._claims) and self._claims[i][0] < end):
            self._refuse(f"range [{start}, {end}) overlaps a range claimed before")
        self._starts.insert(i, start)
        self._claims.insert(i, [start, end, start])
        return self._dst[start:end]

    def landed(self, start: int, end: int) -> None:
        """Payload bytes ``[start, end)`` are in place: the next bytes of a claimed window (all
        of it, or a piece, the pieces in order). Hashes what now follows the bytes hashed before.
        ValueError (and the read fails) for bytes no claim covers, or not the window's next."""
        i = bisect.bisect_right(self._starts, start) - 1
        claim = self._claims[i] if i >= 0 else None
        if claim is None or start != claim[2] or not start < end <= claim[1]:
            self._refuse(f"bytes [{start}, {end}) landed out of their claimed window's order")
        claim[2] = end
        self._hash_ready(i)

    def put(self, start: int, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` (bytes at hand, e.g. a payload's tail kept with its header) into payload
        bytes ``[start, start + len(data))``: ``claim``, copy, ``landed``."""
        self.claim(start, start + len(data))[:] = data
        self.landed(start, start + len(data))

    def fail(self, error: Exception) -> None:
        """Record why the read cannot hold the chunk (its first reason is kept)."""
        if self.error is None:
            self.error = error

    def verified(self) -> bool:
        """Whether the header was accepted, every payload byte landed and their checksum matches
        the header's. A mismatch is kept in ``error``; bytes missing (a range that never came, or
        came short) leave ``error`` as it was: the store knows why they are missing."""
        if self.error is not None or self.header is None or self._hashed != self.payload_len:
            return False
        if self._hasher.intdigest() == self.header.payload_checksum:
            return True
        self.fail(serde.ChunkFormatError("payload checksum mismatch"))
        return False

    def _hash_ready(self, i: int) -> None:
        """Hash the landed bytes that follow the hashed ones, from claim ``i`` on (if it is
        where hashing stands)."""
        assert self._dst is not None
        while i < len(self._claims):
            start, end, filled = self._claims[i]
            if not start <= self._hashed < filled:
                return
            self._hasher.update(self._dst[self._hashed:filled])
            self._hashed = filled
            if filled < end:
                return
            i += 1

    def _refuse(self, why: str) -> None:
        error = ValueError(why)
        self.fail(error)
        raise error
