"""Fuzzing of the chunk format (kvlayer/serde.py): random bytes, damaged chunks, forged headers.

Whatever bytes a reader is fed, it gets the exact chunk that was written or ``ChunkFormatError``
with a one-line message, never another exception and never other data: a flipped bit anywhere
fails a checksum. Run: ``.venv/bin/python -m pytest tests/fuzz/test_fuzz_serde.py`` (add
``-m slow`` for the full counts).
"""

from __future__ import annotations

import lz4.frame
import torch
import xxhash
from hypothesis import strategies as st

from kvlayer import serde
from kvlayer.keys import FORMAT_VERSION
from tests.fakes import CHUNK, LAYOUT, make_keys
from tests.fuzz.budget import budget, explore
from tests.kvlayer.test_serde import random_bits, same_bits

KEY, OTHER = make_keys(2)
SHAPE, DTYPE = LAYOUT.chunk_shape(CHUNK), LAYOUT.dtype
BLOB_MAX = serde.HEADER_SIZE + LAYOUT.chunk_bytes(CHUNK) + 16


def read(data: bytes, quantization: str = "none") -> torch.Tensor:
    """``KEY``'s chunk in ``data``, as a reader of ``quantization`` chunks takes it; ChunkFormatError otherwise."""
    header = serde.decode_header(data)
    serde.check_header(header, KEY, SHAPE, DTYPE, quantization)
    out = torch.empty(SHAPE, dtype=DTYPE)
    serde.decode_payload(header, memoryview(data)[serde.HEADER_SIZE:], out)
    return out


def exact_or_refused(data: bytes, original: torch.Tensor | None, quantization: str = "none") -> None:
    """Reading ``data`` gives ``original`` bit for bit, or a one-line ChunkFormatError."""
    try:
        got = read(data, quantization)
    except serde.ChunkFormatError as e:
        assert str(e) and "\n" not in str(e), repr(e)
        return
    assert original is not None, "bytes that were never a chunk decoded"
    assert same_bits(got, original), "a damaged chunk decoded to other data"


def _valid(seed: int, zeros: bool, compression: str, quantization: str) -> tuple[bytes, torch.Tensor, str]:
    """A written chunk: its bytes, what a reader gets back from them, its quantization."""
    if quantization == "none":
        chunk = torch.zeros(SHAPE, dtype=DTYPE) if zeros else random_bits(LAYOUT, seed)
    else:  # a quantized chunk must be finite
        chunk = torch.zeros(SHAPE) if zeros else torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    header, payload = serde.encode_chunk(KEY, chunk, compression, quantization)
    data = header + bytes(payload)
    return data, read(data, quantization), quantization


VALID = [_valid(seed, zeros, c, q) for seed in range(3) for zeros in (False, True) for c in ("none", "lz4")
         for q in ("none", "int8", "fp8")]
"""Chunks of every encoding, random and zero (compressible, so lz4 frames vary)."""
valid = st.sampled_from(VALID)


def check_random_bytes(data: bytes) -> None:
    exact_or_refused(data, None)


@budget(ci=600)
def test_random_bytes_never_decode(examples: int) -> None:
    explore(examples, check_random_bytes, st.binary(max_size=BLOB_MAX))


def check_prefixed_bytes(rest: bytes) -> None:
    """Random bytes behind a plausible magic and version."""
    exact_or_refused(serde.MAGIC + FORMAT_VERSION.to_bytes(2, "little") + rest, None)


@budget(ci=300)
def test_random_bytes_after_a_good_magic_never_decode(examples: int) -> None:
    explore(examples, check_prefixed_bytes, st.binary(max_size=BLOB_MAX))


def check_one_flip(case: tuple[bytes, torch.Tensor, str], at: int, bit: int) -> None:
    """One flipped bit, in the header or the payload: always refused (a checksum catches it)."""
    data, _, quantization = case
    damaged = bytearray(data)
    damaged[at % len(data)] ^= 1 << bit
    try:
        read(bytes(damaged), quantization)
    except serde.ChunkFormatError as e:
        assert "\n" not in str(e)
        return
    raise AssertionError(f"a flipped bit at byte {at % len(data)} of {len(data)} was accepted")


@budget(ci=600)
def test_a_flipped_bit_is_always_refused(examples: int) -> None:
    explore(examples, check_one_flip, valid, st.integers(0, 1 << 20), st.integers(0, 7))


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, torch.Tensor, str]:
    """A valid chunk after a few flips, cuts, extensions and overwrites."""
    data, decoded, quantization = draw(valid)
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "extend", "overwrite"]))
        if op == "flip" and out:
            out[draw(st.integers(0, len(out) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del out[draw(st.integers(0, len(out))):]
        elif op == "extend":
            out += draw(st.binary(min_size=1, max_size=64))
        elif out:
            i = draw(st.integers(0, len(out) - 1))
            patch = draw(st.binary(min_size=1, max_size=16))
            out[i : i + len(patch)] = patch
    return bytes(out), decoded, quantization


def check_mutated(case: tuple[bytes, torch.Tensor, str]) -> None:
    exact_or_refused(*case)


@budget(ci=600)
def test_mutated_chunks_decode_exactly_or_not_at_all(examples: int) -> None:
    explore(examples, check_mutated, mutated())


def _u(bits: int) -> st.SearchStrategy[int]:
    return st.integers(0, (1 << bits) - 1)


@st.composite
def forged(draw: st.DrawFn) -> tuple[bytes, torch.Tensor, str]:
    """A chunk whose header fields are each kept or replaced (edge values and random ones),
    under a recomputed header checksum mostly: a writer's bug or a forgery, not corruption."""
    data, decoded, quantization = draw(valid)
    fields = list(serde._HEAD.unpack(data[: serde._HEAD.size]))
    edges = {0: st.sampled_from([b"KVLD", b"\x00" * 4]) | st.binary(min_size=4, max_size=4),
             1: st.sampled_from([0, FORMAT_VERSION + 1, 0xFFFF]) | _u(16), 2: st.integers(0, 3) | _u(16),
             3: st.sampled_from([OTHER.digest]) | st.binary(min_size=32, max_size=32),
             4: st.sampled_from([OTHER.tokens_digest]) | st.binary(min_size=16, max_size=16),
             5: st.integers(0, 4) | _u(8), 6: st.sampled_from([0, 4, 6]) | _u(8), 7: st.integers(0, 4) | _u(16)}
    for i in range(8, 13):  # the shape
        edges[i] = st.sampled_from([0, 1, fields[i] + 1, max(fields[i] - 1, 0), 1 << 31, (1 << 32) - 1]) | _u(32)
    for i in range(13, 15):  # raw_len, payload_len
        edges[i] = st.sampled_from([0, fields[i] + 1, max(fields[i] - 1, 0), fields[i] * 2, (1 << 64) - 1]) | _u(64)
    edges[15] = st.sampled_from([0, fields[15] ^ 1]) | _u(64)
    for i in sorted(draw(st.sets(st.sampled_from(sorted(edges)), min_size=1, max_size=4))):
        fields[i] = draw(edges[i])
    head = serde._HEAD.pack(*fields)
    check = xxhash.xxh3_64_intdigest(head) if draw(st.integers(0, 9)) else draw(_u(64))
    payload = data[serde.HEADER_SIZE:]
    if draw(st.integers(0, 4)) == 0:
        payload = draw(st.binary(max_size=len(payload) + 8))
    return head + serde._CHECK.pack(check) + payload, decoded, quantization


def check_forged(case: tuple[bytes, torch.Tensor, str]) -> None:
    data, decoded, quantization = case
    try:
        header = serde.decode_header(data)
        assert header.encoded_len >= 0
    except serde.ChunkFormatError as e:
        assert "\n" not in str(e)
    exact_or_refused(data, decoded, quantization)


@budget(ci=600)
def test_forged_header_fields_are_refused_or_harmless(examples: int) -> None:
    explore(examples, check_forged, forged())


def check_lz4_forgery(payload: bytes, damage: tuple[bool, int, int, int]) -> None:
    """A writer that recomputes the checksums (a forgery, not corruption) still gets no crash:
    a frame that decodes must still hold exactly the chunk's length."""
    chunk = random_bits(LAYOUT, 0)
    start_from_real, at, xor, cut = damage
    if start_from_real:
        frame = bytearray(lz4.frame.compress(bytes(chunk.view(-1).view(torch.uint8).numpy())))
        frame[at % len(frame)] ^= xor
        payload = bytes(frame[: cut % (len(frame) + 1)]) + payload[:8]
    header = serde.encode_header(KEY, chunk, payload, "lz4")
    try:
        got = read(header + payload)
    except serde.ChunkFormatError as e:
        assert "\n" not in str(e)
        return
    assert got.shape == chunk.shape


@budget(ci=400)
def test_lz4_payloads_under_valid_checksums_never_escape(examples: int) -> None:
    damage = st.tuples(st.booleans(), st.integers(0, 1 << 16), st.integers(1, 255), st.integers(0, 1 << 16))
    explore(examples, check_lz4_forgery, st.binary(max_size=600), damage)
