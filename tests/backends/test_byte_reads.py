"""Tests of ``backends/byte_reads.py``, the ranged read every byte store shares: a header check,
payload ranges landing in any order, the running checksum, and the ranges it refuses.

Run: ``.venv/bin/python -m pytest tests/backends/test_byte_reads.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvlayer import serde
from kvlayer.backends.byte_reads import ChunkRead
from kvlayer.layout import KVLayout
from tests.fakes import chunk_data, make_keys, namespace

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
CHUNK = 8
SHAPE = LAYOUT.chunk_shape(CHUNK)
KEYS = make_keys(2, 3, namespace(chunk_size=CHUNK, layout=LAYOUT))


def stored(key: object = KEYS[0], compression: str = "none", quantization: str = "none") -> tuple[bytes, bytes]:
    """A chunk's header and payload as a byte store holds them."""
    header, payload = serde.encode_chunk(key, chunk_data(key, LAYOUT), compression, quantization)  # type: ignore[arg-type]
    return header, bytes(payload)


def reading(key: object = KEYS[0]) -> tuple[ChunkRead, torch.Tensor]:
    out = torch.full(SHAPE, float("nan"), dtype=LAYOUT.dtype)
    return ChunkRead(key, SHAPE, LAYOUT.dtype, out), out  # type: ignore[arg-type]


def fill(read: ChunkRead, payload: bytes, start: int, end: int) -> None:
    """Claim ``[start, end)``, copy those payload bytes in, report them landed."""
    read.claim(start, end)[:] = payload[start:end]
    read.landed(start, end)


def test_ranges_in_any_order_give_the_exact_chunk() -> None:
    header, payload = stored()
    cuts = sorted(random.Random(1).sample(range(1, len(payload)), 9))
    ranges = list(zip([0, *cuts], [*cuts, len(payload)]))
    for order in (ranges, ranges[::-1], random.Random(2).sample(ranges, len(ranges))):
        read, out = reading()
        assert read.open(header) is not None
        for i, (start, end) in enumerate(order):
            fill(read, payload, start, end)
            assert read.verified() == (i == len(order) - 1), "verified only once every byte landed"
        assert torch.equal(out, chunk_data(KEYS[0], LAYOUT))
        assert read.error is None


def test_a_window_lands_piece_by_piece_and_layers_map_to_bytes() -> None:
    header, payload = stored()
    read, out = reading()
    read.open(header)
    layer = len(payload) // SHAPE[0]
    assert read.layer_span(1, 3) == (layer, 3 * layer) and read.layer_span(3, 9) == (3 * layer, 4 * layer)
    window = read.claim(0, len(payload))
    for lo in range(0, len(payload), 100):  # as a socket delivers them
        hi = min(lo + 100, len(payload))
        window[lo:hi] = payload[lo:hi]
        read.landed(lo, hi)
    assert read.verified() and torch.equal(out, chunk_data(KEYS[0], LAYOUT))


@pytest.mark.parametrize("offset", [0, 1000, -1])
def test_a_flipped_byte_fails_verification(offset: int) -> None:
    header, payload = stored()
    bad = bytearray(payload)
    bad[offset] ^= 0x10
    read, _ = reading()
    read.open(header)
    fill(read, bytes(bad), 0, len(bad) // 2)
    read.put(len(bad) // 2, bytes(bad[len(bad) // 2:]))
    assert not read.verified()
    assert str(read.error) == "payload checksum mismatch"
    assert not read.verified(), "a failed read stays failed"


@pytest.mark.parametrize(("first", "second"), [((0, 100), (0, 100)), ((0, 100), (50, 150)), ((100, 200), (0, 101)),
                                                ((0, 100), (99, 100))])
def test_duplicate_and_overlapping_ranges_are_refused(first: tuple[int, int], second: tuple[int, int]) -> None:
    read, _ = reading()
    read.claim(*first)
    with pytest.raises(ValueError, match="overlaps"):
        read.claim(*second)
    assert isinstance(read.error, ValueError) and not read.reading


@pytest.mark.parametrize("window", [(-1, 10), (10, 10), (0, 10**9)])
def test_ranges_outside_the_payload_are_refused(window: tuple[int, int]) -> None:
    read, _ = reading()
    with pytest.raises(ValueError, match="not inside"):
        read.claim(*window)


def test_a_short_range_never_verifies() -> None:
    header, payload = stored()
    read, _ = reading()
    read.open(header)
    read.claim(0, len(payload))[:] = payload
    read.landed(0, len(payload) - 1)  # the store delivered one byte less than claimed
    assert not read.verified() and read.error is None, "the store says why bytes are missing"
    with pytest.raises(ValueError, match="order"):
        read.landed(len(payload) - 1, len(payload) + 1)  # more than the window holds
    assert not read.verified()


@pytest.mark.parametrize("where", ["twice", "unclaimed", "out of order"])
def test_bytes_landing_where_nothing_waits_are_refused(where: str) -> None:
    read, _ = reading()
    read.claim(0, 100)
    read.landed(0, 50)
    start, end = {"twice": (0, 50), "unclaimed": (200, 300), "out of order": (60, 100)}[where]
    with pytest.raises(ValueError, match="order"):
        read.landed(start, end)
    assert not read.verified()


def test_only_the_keys_raw_chunk_of_this_shape_opens() -> None:
    header, payload = stored()
    for head, why in [(stored(KEYS[1])[0], "another key"), (header[:-1], "truncated header"),
                      (stored(compression="lz4")[0], "cannot be read by ranges"),
                      (stored(quantization="int8")[0], "quantization"),
                      (header[:20] + bytes([header[20] ^ 1]) + header[21:], "header checksum")]:
        read, _ = reading()
        assert read.open(head) is None
        assert why in str(read.error)
        assert not read.reading
    other = ChunkRead(KEYS[0], LAYOUT.chunk_shape(CHUNK // 2), LAYOUT.dtype)
    assert other.open(header) is None and "shape" in str(other.error)


def test_a_destination_can_come_after_the_header_and_must_fit() -> None:
    header, payload = stored()
    read = ChunkRead(KEYS[0], SHAPE, LAYOUT.dtype)
    assert read.open(header) is not None and not read.reading
    with pytest.raises(ValueError, match="destination"):
        read.claim(0, 10)
    with pytest.raises(ValueError, match="contiguous"):
        read.attach(torch.empty(SHAPE, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        read.attach(torch.empty(SHAPE[::-1], dtype=LAYOUT.dtype).permute(4, 3, 2, 1, 0))
    out = torch.empty(SHAPE, dtype=LAYOUT.dtype)
    read.attach(out)
    assert read.reading
    with pytest.raises(ValueError, match="already"):
        read.attach(out)
    read.put(0, payload)
    assert read.verified() and torch.equal(out, chunk_data(KEYS[0], LAYOUT))


def test_a_store_fault_is_kept_and_ends_the_read() -> None:
    header, payload = stored()
    read, _ = reading()
    read.fail(OSError("EIO"))
    read.fail(serde.ChunkFormatError("later"))
    assert read.open(header) is None, "a failed read takes no header"
    assert isinstance(read.error, OSError) and not read.verified()
