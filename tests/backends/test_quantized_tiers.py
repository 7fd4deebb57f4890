"""The NVMe and Redis backends with ``storage_quantization``: quantized chunks read back (whole and
by ``read_layers``) within their error bound, after a restart too, and a reader of another
encoding refusing them under the same key (a miss, counted in ``checksum_errors``).

Run: ``.venv/bin/python -m pytest tests/backends/test_quantized_tiers.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlayer import serde
from kvlayer.keys import ChunkKey
from kvlayer.memory import Arena
from kvlayer.storage import StorageBackend
from tests.backends import test_nvme as nvme
from tests.backends import test_redis as redis_tests
from tests.fakes import chunk_data
from tests.kvlayer.test_quantize import SLACK, error_bound
from tests.redis_server import RedisServer

LAYOUT = nvme.LAYOUT
GROUPS = [(0, 1), (1, 2)]
ENCODINGS = [("int8", "none"), ("fp8", "none"), ("none", "int8"), ("int8", "fp8")]
"""(written with, read with)."""


def fits(got: torch.Tensor, key: ChunkKey, quantization: str) -> bool:
    """Whether ``got`` is ``key``'s chunk as ``quantization`` stores it."""
    want = chunk_data(key, LAYOUT)
    if quantization == "none":
        return torch.equal(got, want)
    return bool(((got - want).abs() <= error_bound(want, quantization) * SLACK).all()) and not torch.equal(got, want)


async def read_both_ways(backend: StorageBackend, keys: list[ChunkKey]) -> tuple[list[Any], list[bool]]:
    """``keys[0]`` read by ``get_many``, the others by ``read_layers`` (which must report every
    group): each key's tensor (None for a miss) and whether it was a hit."""
    got = await backend.get_many(keys[:1])
    tensors = [None if o is None else o.tensor.clone() for o in got]
    for o in got:
        if o is not None:
            o.release()
    hits = [t is not None for t in tensors]
    slot = LAYOUT.chunk_bytes(nvme.CHUNK)
    arena = Arena(len(keys) * slot, slot)
    outs = [arena.allocate(LAYOUT.chunk_shape(nvme.CHUNK), LAYOUT.dtype) for _ in keys[1:]]
    seen: list[int] = []
    try:
        flags = await backend.read_layers(keys[1:], outs, GROUPS, seen.append)
        assert seen == [0, 1]
        return tensors + [o.tensor.clone() if ok else None for o, ok in zip(outs, flags)], hits + flags
    finally:
        for o in outs:
            o.release()


def check_tier(make: Callable[[str], StorageBackend], put: Callable[..., Any], stored: str, reader: str) -> None:
    """Write 3 chunks with ``stored``; a backend of the same encoding reads them back (whole and by
    layers); one of ``reader``'s encoding misses every one and counts it."""
    keys = nvme.chain(3)

    async def scenario() -> None:
        writer = make(stored)
        await put(writer, keys)
        await writer.close()
        same = make(stored)
        tensors, hits = await read_both_ways(same, keys)
        await same.close()
        assert hits == [True] * 3
        assert all(fits(t, k, stored) for t, k in zip(tensors, keys))
        other = make(reader)
        tensors, hits = await read_both_ways(other, keys)
        stats = other.stats()
        await other.close()
        assert hits == [False] * 3 and tensors == [None] * 3
        assert stats["checksum_errors"] == 3 and stats["hits"] == 0

    nvme.run(scenario())


@pytest.mark.parametrize(("stored", "reader"), ENCODINGS)
def test_nvme_serves_its_own_encoding_only(tmp_path: Path, stored: str, reader: str) -> None:
    check_tier(lambda q: nvme.make_backend(tmp_path, storage_quantization=q), nvme.put_keys, stored, reader)


@pytest.mark.redis
@pytest.mark.parametrize("replies", redis_tests.READERS)
@pytest.mark.parametrize(("stored", "reader"), ENCODINGS)
def test_redis_serves_its_own_encoding_only(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
                                            replies: str, stored: str, reader: str) -> None:
    if replies == "redis-py":
        redis_tests.through_redis_py(monkeypatch)
    check_tier(lambda q: redis_tests.make_backend(redis_server.url, storage_quantization=q), redis_tests.put_keys,
               stored, reader)


def test_nvme_files_of_a_quantized_tier_hold_the_encoding(tmp_path: Path) -> None:
    keys = nvme.chain(2)

    async def scenario() -> None:
        backend = nvme.make_backend(tmp_path, storage_quantization="fp8", compression="lz4")
        await nvme.put_keys(backend, keys)
        await backend.close()

    nvme.run(scenario())
    for path in tmp_path.rglob("*.kvc"):
        header = serde.decode_header(path.read_bytes())
        assert (header.quantization, header.compression) == (serde.QUANTIZATION_CODES["fp8"], 1)
        assert header.shape == LAYOUT.chunk_shape(nvme.CHUNK) and header.dtype == LAYOUT.dtype
