"""Tests of the chunk format (kvlayer/serde.py): exact round trips and refusals.

The decoder is fuzzed in tests/fuzz/test_fuzz_serde.py. Run:
``.venv/bin/python -m pytest tests/kvlayer/test_serde.py``.
"""

from __future__ import annotations

import ast
import inspect
import struct

import lz4.frame
import pytest
import torch
import xxhash

from kvlayer import serde
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from tests.fakes import CHUNK, LAYOUT, make_keys

KEY, OTHER = make_keys(2)


def random_bits(layout: KVLayout, seed: int) -> torch.Tensor:
    """A chunk of arbitrary bit patterns (NaNs, infinities, -0.0 and subnormals included)."""
    gen = torch.Generator().manual_seed(seed)
    n = layout.chunk_bytes(CHUNK)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(layout.dtype).view(layout.chunk_shape(CHUNK))


def blob(tensor: torch.Tensor, compression: str, key: ChunkKey = KEY) -> bytes:
    header, payload = serde.encode_chunk(key, tensor, compression)
    return header + bytes(payload)


def decode(data: bytes, key: ChunkKey = KEY, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """The chunk in ``data`` for ``key``, as a reader does it; ChunkFormatError otherwise."""
    header = serde.decode_header(data)
    serde.check_header(header, key, layout.chunk_shape(CHUNK), layout.dtype)
    out = torch.empty(header.shape, dtype=header.dtype)
    serde.decode_payload(header, memoryview(data)[serde.HEADER_SIZE:], out)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bytes(a.view(-1).view(torch.uint8).numpy()) \
        == bytes(b.view(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact(dtype: torch.dtype, compression: str) -> None:
    layout = KVLayout(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype, LAYOUT.block_size)
    chunk = random_bits(layout, seed=1)
    data = blob(chunk, compression)
    assert data[:4] == serde.MAGIC and data[8:40] == KEY.digest
    assert same_bits(decode(data, layout=layout), chunk)


def test_lz4_shrinks_a_compressible_chunk() -> None:
    zeros = torch.zeros(LAYOUT.chunk_shape(CHUNK))
    data = blob(zeros, "lz4")
    assert len(data) < serde.HEADER_SIZE + LAYOUT.chunk_bytes(CHUNK) // 4
    assert same_bits(decode(data), zeros)


@pytest.mark.parametrize("what", ["key", "tokens digest", "shape", "dtype"])
def test_check_header_refuses_another_chunk(what: str) -> None:
    header = serde.decode_header(blob(random_bits(LAYOUT, 2), "none"))
    key, shape, dtype = KEY, LAYOUT.chunk_shape(CHUNK), LAYOUT.dtype
    if what == "key":
        key = OTHER
    elif what == "tokens digest":
        key = ChunkKey(KEY.digest, OTHER.tokens_digest, KEY.start, KEY.end)
    elif what == "shape":
        shape = LAYOUT.chunk_shape(CHUNK * 2)
    else:
        dtype = torch.float16
    with pytest.raises(serde.ChunkFormatError):
        serde.check_header(header, key, shape, dtype)


def test_a_forged_lz4_content_size_is_a_format_error() -> None:
    """The frame header claims 1 TiB: the decoder must not try to allocate it."""
    chunk = random_bits(LAYOUT, 3)
    frame = bytearray(lz4.frame.compress(bytes(chunk.view(-1).view(torch.uint8).numpy()), store_size=True))
    descriptor = bytes(frame[4:6]) + struct.pack("<Q", 1 << 40)
    frame[4:15] = descriptor + bytes([(xxhash.xxh32_intdigest(descriptor) >> 8) & 0xFF])
    header = serde.encode_header(KEY, chunk, bytes(frame), "lz4")
    with pytest.raises(serde.ChunkFormatError):
        decode(header + bytes(frame))


def test_serde_never_unpickles() -> None:
    tree = ast.parse(inspect.getsource(serde))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
                for a in n.names} | {n.module.split(".")[0] for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"pickle", "cPickle", "dill", "marshal", "shelve", "joblib"}
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not calls & {"torch.load", "np.load", "numpy.load"}
