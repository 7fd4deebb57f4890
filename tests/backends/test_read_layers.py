"""``read_layers`` of the serialising tiers (NVMe files, Redis): chunks read layer group by
layer group, signalled in order, verified once complete; a bad chunk is a miss, never data.

A Redis chunk is two keys (``backends/redis_pairs.py``): the tests edit its bytes as a file's
(header, payload) and store them back split the same way, so each edit lands in the key that
holds those bytes (the payload's last 128 bytes are in the head)."""

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
from tests.backends.test_redis import chunk_bytes, store_bytes, through_redis_py
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
        names = backend.redis_keys(key)  # type: ignore[attr-defined]
        data = chunk_bytes(client, names)
        assert data is not None
        store_bytes(client, names, edit(data))
        client.close()


def flip(offset: int) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        b = bytearray(data)
        b[offset] ^= 0x40
        return bytes(b)

    return edit


def check_three_of_four(backend: Any, keys: list[Any], outs: list[Any], flags: list[bool], arena: Any) -> None:
    """After reading 4 keys of which the first 3 were stored: the right flags, data and counts;
    then the objects are released and the arena is empty again."""
    assert flags == [True, True, True, False]
    for k, o in zip(keys[:3], outs):
        assert torch.equal(o.tensor, chunk_data(k, LAYOUT))
    assert backend.stats()["hits"] == 3 and backend.stats()["misses"] == 1
    for o in outs:
        o.release()
    assert arena.used_count == 0


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
            assert seen == [(0, True), (1, True), (2, True)], "each group in place when signalled, not later ones"
            check_three_of_four(backend, keys, outs, flags, arena)

    asyncio.run(main())


BAD_VALUES = {
    "last layer flipped": flip(serde.HEADER_SIZE + CHUNK_BYTES - 3),
    "last layer flipped before its last 128 bytes": flip(serde.HEADER_SIZE + CHUNK_BYTES - 200),
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
        data = chunk_bytes(client, backend.redis_keys(key))  # type: ignore[attr-defined]
        assert data is not None
        return data
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
@pytest.mark.parametrize("which", [0, 1], ids=["head", "body"])
def test_a_value_of_another_type_is_a_miss(tier: Any, which: int) -> None:
    """A key of another type reads as missing, as ``MGET`` reads it: the chunk has one string
    key, a half chunk (a miss, counted, both keys deleted), and the stream stays in step."""
    keys = keys_of(2, seed=5)

    async def main() -> None:
        async with tier() as backend:
            await put(backend, keys)
            client = redis_sync.Redis.from_url(tier.server.url)
            name = backend.redis_keys(keys[1])[which]
            client.delete(name)
            client.rpush(name, b"not a chunk")
            client.close()
            _, outs = outs_for(keys)
            assert await backend.read_layers(keys, outs, GROUPS, lambda g: None) == [True, False]
            assert (backend.stats()["half_chunks"], backend.stats()["checksum_errors"]) == (1, 0)
            # the connection is still usable afterwards
            assert await backend.read_layers(keys[:1], outs[:1], GROUPS, lambda g: None) == [True]

    asyncio.run(main())


@pytest.mark.parametrize("tier", ["redis"], indirect=True)
@pytest.mark.parametrize("which", [0, 1], ids=["head", "body"])
def test_a_chunk_missing_one_key(tier: Any, which: int) -> None:
    """A head without its body, or a body without its head, is a half chunk (the pipeline's
    commands run back to back, so a write cannot land between them): a miss, counted, and both
    keys deleted."""
    keys = keys_of(3, seed=6)

    async def main() -> None:
        async with tier() as backend:
            await put(backend, keys)
            client = redis_sync.Redis.from_url(tier.server.url)
            names = backend.redis_keys(keys[1])
            client.delete(names[which])
            _, outs = outs_for(keys)
            assert await backend.read_layers(keys, outs, GROUPS, lambda g: None) == [True, False, True]
            stats = backend.stats()
            assert (stats["misses"], stats["checksum_errors"], stats["half_chunks"], stats["staging_full"]) == (
                1, 0, 1, 0)
            for _ in range(50):
                if client.exists(*names) == 0:
                    break
                await asyncio.sleep(0.02)
            assert client.exists(*names) == 0
            client.close()

    asyncio.run(main())


@pytest.mark.parametrize("layer_bytes", [128, 64, 32])
def test_a_tail_spanning_whole_layer_groups(layer_bytes: int) -> None:
    """Layers so small that the head's 128 payload bytes hold the last layer(s) whole: those
    groups ask Redis for no body range, and still arrive in order and verified."""
    layout = KVLayout(num_layers=6, num_kv_heads=1, head_dim=layer_bytes // 32, dtype=torch.float32, block_size=4)
    keys = make_keys(3, 9, namespace(chunk_size=4, layout=layout))
    groups = [(i, i + 1) for i in range(6)]
    size = layout.chunk_bytes(4)

    async def main() -> None:
        with RedisServer() as server:
            cfg = KVLayerConfig(chunk_size=4, cpu_capacity=0, redis_url=server.url)
            backend = RedisBackend.create(BackendContext(cfg, layout, torch.device("cpu"), Arena(4 * size, size)))
            assert backend is not None
            try:
                await put_keys(backend, keys, layout)  # type: ignore[arg-type]
                arena = Arena(3 * size, size)
                outs = [arena.allocate(layout.chunk_shape(4), layout.dtype) for _ in keys]
                seen: list[int] = []

                def on_group(g: int) -> None:
                    assert all(torch.equal(o.tensor[g], chunk_data(k, layout)[g]) for k, o in zip(keys, outs))
                    seen.append(g)

                assert await backend.read_layers(keys, outs, groups, on_group) == [True] * 3  # type: ignore[arg-type]
                assert seen == list(range(6))
                for o in outs:
                    o.release()  # type: ignore[union-attr]
            finally:
                await backend.close()

    asyncio.run(main())


@pytest.mark.parametrize("tier", ["redis"], indirect=True)
def test_redis_reads_whole_chunks_through_redis_py(tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fast path does not read (cluster mode, compressed or quantized tiers), ranged
    reads are whole chunks through redis-py (every group signalled at the end), with the same results."""
    through_redis_py(monkeypatch)
    keys = keys_of(4)

    async def main() -> None:
        async with tier() as backend:
            await put(backend, keys[:3])
            arena, outs = outs_for(keys)
            seen: list[int] = []
            flags = await backend.read_layers(keys, outs, GROUPS, seen.append)
            assert seen == list(range(len(GROUPS)))
            check_three_of_four(backend, keys, outs, flags, arena)

    asyncio.run(main())
