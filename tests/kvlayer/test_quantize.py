"""Tests of the quantized payloads (kvlayer/quantize.py) and of their place in the chunk format
(kvlayer/serde.py) and the key namespace (kvlayer/keys.py).

Error bounds are computed here from the chunk itself (absmax per layer, K/V and head), not taken
from the module. Run: ``.venv/bin/python -m pytest tests/kvlayer/test_quantize.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlayer import serde
from kvlayer.keys import Namespace, chunk_keys
from kvlayer.layout import KVLayout
from kvlayer.quantize import QUANTIZATIONS, QUANTIZERS
from tests.fakes import namespace

LAYOUT = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, dtype=torch.float32, block_size=4)
TOKENS = 16
KEY = chunk_keys(namespace(chunk_size=TOKENS, layout=LAYOUT), list(range(TOKENS)))[0]
ENCODED = 2 * LAYOUT.num_layers * LAYOUT.num_kv_heads * (4 + TOKENS * LAYOUT.head_dim)
"""Bytes of a quantized chunk: a float32 scale and a byte per value of each layer, K/V and head."""
SLACK = 1 + 1e-5
"""Float32 rounding of ``x * (qmax / absmax)`` on top of the quantizer's own error."""


def spread_chunk(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random KV whose heads differ in magnitude by up to 10^6 (a per-chunk scale would fail them)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(LAYOUT.chunk_shape(TOKENS), generator=gen)
    magnitude = 10.0 ** torch.randint(-3, 4, (LAYOUT.num_layers, 2, 1, LAYOUT.num_kv_heads, 1), generator=gen)
    return (x * magnitude).to(dtype)


def absmax(x: torch.Tensor) -> torch.Tensor:
    """Per layer, K/V and head, over tokens and head_dim; broadcastable to ``x``."""
    return x.float().abs().amax(dim=(2, 4), keepdim=True)


def error_bound(x: torch.Tensor, quantization: str) -> torch.Tensor:
    """The largest error each value of ``x`` may take: half an int8 step of its head's scale, or
    e4m3's rounding (3 mantissa bits; absolute below the smallest normal, 2^-6 of the scale)."""
    if quantization == "int8":
        return (absmax(x) / 254).expand_as(x)  # scale / 2, scale = absmax / 127
    return torch.maximum(x.float().abs() / 16, absmax(x) / 448 / 1024)


def round_trip(x: torch.Tensor, quantization: str, compression: str = "none") -> torch.Tensor:
    header, payload = serde.encode_chunk(KEY, x, compression, quantization)
    data = header + bytes(payload)
    head = serde.decode_header(data)
    serde.check_header(head, KEY, tuple(x.shape), x.dtype, quantization)
    out = torch.empty_like(x)
    serde.decode_payload(head, memoryview(data)[serde.HEADER_SIZE:], out)
    return out


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_int8_error_is_at_most_half_a_step(compression: str) -> None:
    x = spread_chunk()
    got = round_trip(x, "int8", compression)
    assert ((got - x).abs() <= error_bound(x, "int8") * SLACK).all()
    assert not torch.equal(got, x), "int8 is lossy: the check above must be able to fail"
    # every value is a multiple of its head's scale: 255 levels at most
    assert torch.allclose(got / (absmax(x) / 127), (got / (absmax(x) / 127)).round(), atol=1e-3)


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_fp8_error_is_that_of_e4m3(compression: str) -> None:
    x = spread_chunk(1)
    got = round_trip(x, "fp8", compression)
    assert ((got - x).abs() <= error_bound(x, "fp8") * SLACK).all()
    scale = absmax(x) / 448
    # each value over its scale is an e4m3 number
    steps = (got / scale).float()
    assert torch.allclose(steps.to(torch.float8_e4m3fn).float(), steps, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_16_bit_kv_decodes_into_its_own_dtype(dtype: torch.dtype, quantization: str) -> None:
    x = spread_chunk(2, dtype)
    got = round_trip(x, quantization)
    assert got.dtype == dtype
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # the 16-bit rounding of the result
    err = (got.float() - x.float()).abs()
    assert (err <= error_bound(x, quantization) * SLACK + got.float().abs() * eps).all()


def test_the_encoding_is_layer_major_with_scales_first() -> None:
    x = spread_chunk(3)
    q = QUANTIZERS["int8"]
    encoded = q.encode(x)
    assert tuple(encoded.shape) == (LAYOUT.num_layers, ENCODED // LAYOUT.num_layers)
    assert encoded.dtype == torch.uint8
    assert q.encoded_len(tuple(x.shape)) == encoded.numel()
    scales = encoded[:, : 2 * LAYOUT.num_kv_heads * 4].contiguous().view(torch.float32)
    assert torch.allclose(scales, absmax(x).view(LAYOUT.num_layers, -1) / 127)
    codes = encoded[:, 2 * LAYOUT.num_kv_heads * 4 :].contiguous().view(torch.int8).view(x.shape)
    assert torch.equal(codes, (x / (absmax(x) / 127)).round().to(torch.int8))
    for layer in range(LAYOUT.num_layers):  # a layer's bytes depend on that layer only
        assert torch.equal(q.encode(x[layer : layer + 1])[0], encoded[layer])


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_a_head_of_zeros_stays_exactly_zero(quantization: str) -> None:
    x = spread_chunk(4)
    x[1, 0, :, 2] = 0.0
    got = round_trip(x, quantization)
    assert torch.equal(got[1, 0, :, 2], torch.zeros_like(got[1, 0, :, 2]))
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_kv_is_refused(bad: float) -> None:
    x = spread_chunk(5)
    x[0, 1, 3, 0, 0] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        serde.encode_chunk(KEY, x, "none", "int8")


def test_fp8_codes_decode_as_torch_casts_them() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    values, unit = QUANTIZERS["fp8"].from_codes(codes)
    finite = ~want.isnan()  # 0x7f and 0xff: NaN, never written
    assert finite.sum() == 254
    assert torch.equal((values * unit)[finite], want[finite])


# --- the chunk header -----------------------------------------------------------------------
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_the_header_records_the_encoding(quantization: str) -> None:
    x = spread_chunk(6)
    header, payload = serde.encode_chunk(KEY, x, "none", quantization)
    head = serde.decode_header(header)
    assert head.quantization == serde.QUANTIZATION_CODES[quantization]
    assert head.raw == (quantization == "none")
    assert head.shape == tuple(x.shape) and head.dtype == x.dtype and head.raw_len == x.numel() * 4
    expected = x.numel() * 4 if quantization == "none" else ENCODED
    assert head.payload_len == len(payload) == expected


@pytest.mark.parametrize(("stored", "reader"), [("int8", "none"), ("fp8", "none"), ("none", "int8"),
                                                ("int8", "fp8"), ("fp8", "int8")])
def test_a_reader_refuses_a_payload_of_another_encoding(stored: str, reader: str) -> None:
    x = spread_chunk(7)
    header, _ = serde.encode_chunk(KEY, x, "none", stored)
    head = serde.decode_header(header)
    with pytest.raises(serde.ChunkFormatError, match="quantization"):
        serde.check_header(head, KEY, tuple(x.shape), x.dtype, reader)
    if reader == "none":  # the default is the exact reader's
        with pytest.raises(serde.ChunkFormatError, match="quantization"):
            serde.check_header(head, KEY, tuple(x.shape), x.dtype)


def with_quantization_code(header: bytes, code: int) -> bytes:
    """``header`` with another quantization field (offset 58) under a valid header checksum."""
    head = bytearray(header[: serde.HEADER_SIZE - 8])
    head[58:60] = code.to_bytes(2, "little")
    return bytes(head) + xxhash.xxh3_64_intdigest(bytes(head)).to_bytes(8, "little")


def test_an_unknown_or_inconsistent_encoding_is_a_format_error() -> None:
    x = spread_chunk(8)
    header, payload = serde.encode_chunk(KEY, x, "none", "int8")
    assert serde.decode_header(with_quantization_code(header, 1)).quantization == 1  # the offset is right
    with pytest.raises(serde.ChunkFormatError, match="unknown quantization"):
        serde.decode_header(with_quantization_code(header, 7))
    with pytest.raises(serde.ChunkFormatError, match="payload length"):  # int8 bytes under "exact"
        serde.decode_header(with_quantization_code(header, 0))


@pytest.mark.parametrize("where", ["scale", "code", "last"])
def test_a_flipped_byte_in_scales_or_codes_fails_the_checksum(where: str) -> None:
    x = spread_chunk(9)
    header, payload = serde.encode_chunk(KEY, x, "none", "fp8")
    data = bytearray(header + bytes(payload))
    offset = {"scale": 2, "code": 2 * 4 * 4 + 5, "last": len(payload) - 1}[where]
    data[serde.HEADER_SIZE + offset] ^= 0x10
    head = serde.decode_header(bytes(data))
    with pytest.raises(serde.ChunkFormatError, match="checksum"):
        serde.decode_payload(head, memoryview(data)[serde.HEADER_SIZE:], torch.empty_like(x))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.one_of(st.binary(max_size=600), st.binary(min_size=ENCODED, max_size=ENCODED)),
       quantization=st.sampled_from(["int8", "fp8"]), compression=st.sampled_from(["none", "lz4"]))
def test_quantized_payloads_under_valid_checksums_never_escape(payload: bytes, quantization: str,
                                                               compression: str) -> None:
    """Any bytes under a valid header decode (whatever values they give) or raise ChunkFormatError."""
    x = spread_chunk(10)
    header = serde.encode_header(KEY, x, payload, compression, quantization)
    out = torch.empty_like(x)
    try:
        serde.decode_payload(serde.decode_header(header), payload, out)
    except serde.ChunkFormatError:
        return
    assert compression == "lz4" or len(payload) == ENCODED, "a raw payload of another length must fail"


# --- the key namespace ----------------------------------------------------------------------
def test_the_quantization_is_part_of_the_namespace() -> None:
    exact = namespace(chunk_size=TOKENS, layout=LAYOUT)
    roots = {q: dataclasses.replace(exact, quantization=q).root() for q in QUANTIZATIONS}
    assert len(set(roots.values())) == len(QUANTIZATIONS)
    assert roots["none"] == exact.root()
    assert b"storage:" not in exact.describe(), "exact instances keep the keys they had"
    int8 = dataclasses.replace(exact, quantization="int8")
    assert int8.with_salt("tenant").quantization == "int8"
    assert int8.with_salt("tenant").root() != exact.with_salt("tenant").root()
    with pytest.raises(ValueError, match="quantization"):
        Namespace("m", "f", LAYOUT, TOKENS, quantization="int4")
