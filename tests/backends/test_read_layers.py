"""``read_layers`` of the serialising tiers (NVMe files, Redis): chunks read layer group by
layer group, signalled in order, verified once complete; a bad chunk is a miss, never data."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
import torch

from kvlayer import serde
from kvlayer.backends.nvme import NvmeBackend
from kvlayer.backends.redis import RedisBackend
from kvlayer.config import KVLayerConfig
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.storage import BackendContext, StorageBackend
from tests.backends.test_nvme import put_keys
from tests.fakes import chunk_data, make_keys, namespace
from tests.redis_server import RedisServer

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
CHUNK = 8
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)
LAYER_BYTES = CHUNK_BYTES // LAYOUT.num_layers
GROUPS = [(0, 1), (1, 3), (3, 4)]
KINDS = ["nvme", "redis"]


def keys_of(n: int, seed: int = 0) -> list[ChunkKey]:
    return make_keys(n, seed, namespace(chunk_size=CHUNK, layout=LAYOUT))


@pytest.fixture
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """``tier(**config)``: an async context manager opening a backend of the test's kind."""
    server: RedisServer | None = None
    if request.param == "redis":
        server = RedisServer().start()
        request.addfinalizer(server.close)

    @asynccontextmanager
    async def opened(**config: Any) -> AsyncIterator[StorageBackend]:
        place = {"redis_url": server.url} if server else {"nvme_path": str(tmp_path / "nvme")}
        cfg = KVLayerConfig(chunk_size=CHUNK, cpu_capacity=0, **place, **config)
        ctx = BackendContext(cfg, LAYOUT, torch.device("cpu"), Arena(16 * CHUNK_BYTES, CHUNK_BYTES))
        backend = (RedisBackend if server else NvmeBackend).create(ctx)
        assert backend is not None
        try:
            yield backend
        finally:
            await backend.close()

    opened.kind = request.param
    opened.server = server
    return opened


async def put(backend: StorageBackend, keys: list[ChunkKey]) -> None:
    await put_keys(backend, keys, LAYOUT)  # type: ignore[arg-type]  # any backend will do


def outs_for(keys: list[ChunkKey]) -> tuple[Arena, list[MemoryObj]]:
    arena = Arena(len(keys) * CHUNK_BYTES, CHUNK_BYTES)
    outs = [arena.allocate(LAYOUT.chunk_shape(CHUNK), LAYOUT.dtype) for _ in keys]
    for o in outs:
        o.tensor.fill_(float("nan"))
    return arena, outs  # type: ignore[return-value]


def edit_stored(tier: Any, backend: StorageBackend, key: ChunkKey, edit: Callable[[bytes], bytes]) -> None:
    """Replace the stored value (file or Redis string) of ``key`` by ``edit(value)``."""
    if tier.kind == "nvme":
        path = backend._index.get(key.digest).path  # type: ignore[attr-defined]
        data = Path(path).read_bytes()
        Path(path).write_bytes(edit(data))
        os.truncate(path, len(edit(data)))
    else:
        client = redis_sync.Redis.from_url(tier.server.url)
        name = backend.redis_key(key)  # type: ignore[attr-defined]
        client.set(name, edit(client.get(name)))
        client.close()


def flip(offset: int) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        b = bytearray(data)
        b[offset] ^= 0x40
        return bytes(b)

    return edit


@pytest.mark.parametrize("tier", KINDS, indirect=True)
def test_layers_arrive_in_order_and_match(tier: Any) -> None:
    keys = keys_of(4)

    async def main() -> None:
        async with tier() as backend:
            await put(backend, keys[:3])  # keys[3] is missing
            arena, outs = outs_for(keys)
            seen: list[tuple[int, bool]] = []

            def on_group(g: int) -> None:
                lo, hi = GROUPS[g]
                ready = all(torch.equal(o.tensor[lo:hi], chunk_data(k, LAYOUT)[lo:hi])
                            for k, o in zip(keys[:3], outs))
                later = all(o.tensor[hi:].isnan().all() for o in outs[:3])
                seen.append((g, ready and later))

            flags = await backend.read_layers(keys, outs, GROUPS, on_group)
            assert flags == [True, True, True, False]
            assert seen == [(0, True), (1, True), (2, True)], "each group in place when signalled, not later ones"
            for k, o in zip(keys[:3], outs):
                assert torch.equal(o.tensor, chunk_data(k, LAYOUT))
            assert backend.stats()["hits"] == 3 and backend.stats()["misses"] == 1
            for o in outs:
                o.release()
            assert arena.used_count == 0

    asyncio.run(main())


BAD_VALUES = {
    "last layer flipped": flip(serde.HEADER_SIZE + CHUNK_BYTES - 3),
    "first layer flipped": flip(serde.HEADER_SIZE + 5),
    "header flipped": flip(10),
    "truncated": lambda data: data[: serde.HEADER_SIZE + CHUNK_BYTES - LAYER_BYTES // 2],
    "longer": lambda data: data + b"x" * LAYER_BYTES,
    "another key's value": None,
}


@pytest.mark.parametrize("tier", KINDS, indirect=True)
@pytest.mark.parametrize("bad", list(BAD_VALUES))
def test_a_bad_value_is_a_counted_miss_and_is_dropped(tier: Any, bad: str) -> None:
    keys = keys_of(3, seed=7)

    async def main() -> None:
        async with tier() as backend:
            await put(backend, keys)
            other = await _stored(tier, backend, keys[0])
            edit = BAD_VALUES[bad] or (lambda _data: other)
            edit_stored(tier, backend, keys[1], edit)
            _, outs = outs_for(keys)
            flags = await backend.read_layers(keys, outs, GROUPS, lambda g: None)
            assert flags == [True, False, True]
            assert torch.equal(outs[2].tensor, chunk_data(keys[2], LAYOUT))
            assert backend.stats()["checksum_errors"] == 1
            for _ in range(50):  # the bad value is deleted (Redis: in the background)
                if await backend.contains_prefix(keys[1:2]) == 0:
                    break
                await asyncio.sleep(0.02)
            assert await backend.contains_prefix(keys[1:2]) == 0

    asyncio.run(main())


async def _stored(tier: Any, backend: StorageBackend, key: ChunkKey) -> bytes:
    if tier.kind == "nvme":
        return Path(backend._index.get(key.digest).path).read_bytes()  # type: ignore[attr-defined]
    client = redis_sync.Redis.from_url(tier.server.url)
    try:
        return client.get(backend.redis_key(key))  # type: ignore[attr-defined]
    finally:
        client.close()


@pytest.mark.parametrize("tier", KINDS, indirect=True)
def test_compressed_chunks_are_read_whole(tier: Any) -> None:
    keys = keys_of(2, seed=3)

    async def main() -> None:
        async with tier(compression="lz4") as backend:
            await put(backend, keys)
            _, outs = outs_for(keys)
            groups: list[int] = []
            assert await backend.read_layers(keys, outs, GROUPS, groups.append) == [True, True]
            assert groups == [0, 1, 2]
            for k, o in zip(keys, outs):
                assert torch.equal(o.tensor, chunk_data(k, LAYOUT))

    asyncio.run(main())


@pytest.mark.parametrize("tier", ["redis"], indirect=True)
def test_a_value_of_another_type_is_a_miss(tier: Any) -> None:
    keys = keys_of(2, seed=5)

    async def main() -> None:
        async with tier() as backend:
            await put(backend, keys[:1])
            client = redis_sync.Redis.from_url(tier.server.url)
            client.rpush(backend.redis_key(keys[1]), b"not a chunk")
            client.close()
            _, outs = outs_for(keys)
            assert await backend.read_layers(keys, outs, GROUPS, lambda g: None) == [True, False]
            # the connection is still usable afterwards
            assert await backend.read_layers(keys[:1], outs[:1], GROUPS, lambda g: None) == [True]

    asyncio.run(main())
