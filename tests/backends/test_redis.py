"""Tests of the Redis tier (backends/redis.py) against throwaway servers: round trips (through
the tier's fast read path and through redis-py), the two-key layout and its memory per KV
byte, TTL, prefix lookups, put checks, a full staging arena and usage.

Run: ``.venv/bin/python -m pytest tests/backends/test_redis.py`` (skips without redis-server).
The helpers defined here are reused by the other ``test_redis_*.py`` files: connections (a
second process, ACL passwords, TLS) in ``test_redis_connections.py``, fault injection in
``test_redis_faults.py``, the fast read path in ``test_redis_reads.py``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
import torch

import kvlayer.backends.redis as redis_backend
from kvlayer import serde
from kvlayer.backends import redis_pairs
from kvlayer.backends.redis import RedisBackend
from kvlayer.backends.redis_pairs import ChunkNames
from kvlayer.config import KVLayerConfig
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.storage import BackendContext
from tests.fakes import chunk_data, make_chunk, make_keys, namespace
from tests.redis_server import RedisServer, make_tls_files

pytestmark = pytest.mark.redis

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
CHUNK = 16
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)
ROOT = str(Path(__file__).parents[2])
"""The repository root (a child process imports the tests from it)."""
READERS = ["ours", "redis-py"]
"""How chunks are read: by the tier's fast path over its own connections, or by redis-py (``through_redis_py``)."""


# --- helpers (also used by test_redis_faults.py and the child process) -------------------
def make_ctx(url: str | None, staging_slots: int = 64, **config: Any) -> BackendContext:
    """A context for ``LAYOUT`` and ``CHUNK``-token chunks whose Redis tier is at ``url``."""
    cfg = KVLayerConfig(chunk_size=CHUNK, cpu_capacity=0, redis_url=url, **config)
    return BackendContext(cfg, LAYOUT, torch.device("cpu"), Arena(staging_slots * CHUNK_BYTES, CHUNK_BYTES))


def make_backend(url: str, staging_slots: int = 64, **config: Any) -> RedisBackend:
    backend = RedisBackend.create(make_ctx(url, staging_slots, **config))
    assert isinstance(backend, RedisBackend)
    return backend


@asynccontextmanager
async def opened(url: str, staging_slots: int = 64, **config: Any) -> AsyncIterator[RedisBackend]:
    """A backend on ``url``, closed on exit."""
    backend = make_backend(url, staging_slots, **config)
    try:
        yield backend
    finally:
        await backend.close()


@contextmanager
def tls_server(folder: Path) -> Iterator[str]:
    """A TLS-only server (its files under ``folder``; skips without TLS support): its URL, trusting its CA."""
    tls = make_tls_files(folder)
    server = RedisServer(tls.server_args(), tls=True)
    try:
        server.start()
    except RuntimeError as e:
        server.close()
        pytest.skip(f"redis-server without TLS support: {e}")
    try:
        yield f"{server.url}?ssl_ca_certs={tls.ca_cert}"
    finally:
        server.close()


def through_redis_py(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the tier read raw chunks as it reads those of cluster mode and of compressed or
    quantized tiers (``RedisBackend.ranged_reads`` false): whole, through redis-py's ``MGET``."""
    def refuse(*args: Any) -> None:
        raise AssertionError("the fast read path ran")

    monkeypatch.setattr(RedisBackend, "ranged_reads", property(lambda self: False))
    monkeypatch.setattr(redis_backend, "read_values", refuse)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def keys_of(n: int, seed: int = 0) -> list[ChunkKey]:
    return make_keys(n, seed, namespace(chunk_size=CHUNK, layout=LAYOUT))


async def put_keys(backend: RedisBackend, keys: Sequence[ChunkKey]) -> None:
    """Put each key's ``chunk_data`` through a source arena whose references all go back."""
    source = Arena(max(len(keys), 1) * CHUNK_BYTES, CHUNK_BYTES, name="source")
    chunks = [make_chunk(source, k, LAYOUT) for k in keys]
    try:
        await backend.put_many(keys, chunks)
    finally:
        for c in chunks:
            c.release()
    assert source.used_count == 0


def check_and_release(got: Sequence[MemoryObj | None], keys: Sequence[ChunkKey]) -> list[bool]:
    """Which keys hit; every hit must equal its key's data exactly (then it is released)."""
    hits = []
    for obj, key in zip(got, keys, strict=True):
        hits.append(obj is not None)
        if obj is not None:
            assert torch.equal(obj.tensor, chunk_data(key, LAYOUT)), f"wrong data for {key.hex[:12]}"
            assert obj.ref_count == 1
            obj.release()
    return hits


async def sampled_usage(backend: RedisBackend) -> tuple[int, int]:
    """``backend.usage()`` once its background sample has come in (or (0, 0) after a second)."""
    for _ in range(100):
        if backend.usage() != (0, 0):
            break
        await asyncio.sleep(0.01)
    return backend.usage()


def sync_client(url: str, **kw: Any) -> redis_sync.Redis:
    return redis_sync.Redis.from_url(url, socket_timeout=5, **kw)


def names_of(key: ChunkKey, prefix: str = "kvlayer") -> ChunkNames:
    """The two Redis keys of ``key``'s chunk (head, body), spelled out as the docs give them."""
    head = f"{prefix}:{{{key.hex}}}".encode()
    return ChunkNames(head, head + b":b")


def chunk_bytes(client: redis_sync.Redis, names: ChunkNames) -> bytes | None:
    """A chunk's bytes as a chunk file holds them (header, payload), joined from its two keys;
    None when either key holds no string."""
    head, body = client.mget(names)
    if head is None or body is None:
        return None
    return head[: serde.HEADER_SIZE] + body + head[serde.HEADER_SIZE :]


def store_bytes(client: redis_sync.Redis, names: ChunkNames, data: bytes) -> None:
    """Store ``data`` (a header, then a payload: edited at will) as a chunk's two keys, split as
    the tier splits them (the payload's last ``tail_len`` bytes after the header, in the head)."""
    cut = len(data) - redis_pairs.tail_len(max(len(data) - serde.HEADER_SIZE, 0))
    client.mset({names.head: data[: serde.HEADER_SIZE] + data[cut:], names.body: data[serde.HEADER_SIZE : cut]})


# --- tests ------------------------------------------------------------------------------
def test_create_is_lazy_and_needs_a_url() -> None:
    assert RedisBackend.create(make_ctx(None)) is None
    backend = RedisBackend.create(make_ctx("redis://127.0.0.1:1"))  # nothing listens: no I/O yet
    assert isinstance(backend, RedisBackend) and (backend.name, backend.rank) == ("redis", 30)
    with pytest.raises(ValueError, match="redis_key_prefix"):
        RedisBackend.create(make_ctx("redis://127.0.0.1:1", redis_key_prefix="{tag}"))


def test_importing_the_backend_does_not_import_redis() -> None:
    code = "import sys, kvlayer.backends.redis; print('redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_round_trip_is_exact(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, compression: str,
                             reader: str) -> None:
    if reader == "redis-py":
        through_redis_py(monkeypatch)
    keys = keys_of(5)

    async def main() -> None:
        async with opened(redis_server.url, compression=compression) as backend:
            await put_keys(backend, keys)
            got = await backend.get_many(keys)
            assert check_and_release(got, keys) == [True] * 5
            assert backend._staging.used_count == 0
            stats = backend.stats()
            assert (stats["hits"], stats["puts"], stats["checksum_errors"]) == (5, 5, 0)

    run(main())


def test_two_keys_per_chunk_in_one_slot(redis_server: RedisServer) -> None:
    """Head: header + the payload's last 128 bytes; body: the rest of the payload; together
    exactly the bytes of a chunk file, under one hash tag."""
    from redis.crc import key_slot

    keys = keys_of(3)

    async def main() -> RedisBackend:
        async with opened(redis_server.url, redis_key_prefix="kvtest") as backend:
            await put_keys(backend, keys)
            assert [backend.redis_keys(k) for k in keys] == [names_of(k, "kvtest") for k in keys]
            return backend

    backend = run(main())
    client = sync_client(redis_server.url)
    assert sorted(client.keys("*")) == sorted(n for k in keys for n in names_of(k, "kvtest"))
    for key in keys:
        names = names_of(key, "kvtest")
        head, body = client.mget(names)
        assert len(head) == serde.HEADER_SIZE + redis_pairs.TAIL and len(body) == CHUNK_BYTES - redis_pairs.TAIL
        header, payload = serde.encode_chunk(key, chunk_data(key, LAYOUT))
        assert chunk_bytes(client, names) == header + bytes(payload)
        assert key_slot(names.head) == key_slot(names.body)
        assert client.ttl(names.head) == client.ttl(names.body) == -1  # no TTL unless configured
    assert sorted(backend.keys()) == sorted(k.digest for k in keys), "one digest per chunk (its head)"


@pytest.mark.parametrize("payload_mib", [1, 2])
def test_memory_per_kv_byte_is_under_1_05(redis_server: RedisServer, payload_mib: int) -> None:
    """A payload that is itself an allocator size class (KV chunks usually are) costs Redis
    under 5% more than its bytes; the same chunk in one value (header + payload) costs 25% more."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, block_size=16)
    tokens = payload_mib * 512
    nbytes = layout.chunk_bytes(tokens)
    assert nbytes == payload_mib << 20
    keys = make_keys(2, 3, namespace(chunk_size=tokens, layout=layout))
    cfg = KVLayerConfig(chunk_size=tokens, cpu_capacity=0, redis_url=redis_server.url)
    source = Arena(2 * nbytes, nbytes, name="source")
    chunks = [make_chunk(source, k, layout) for k in keys]

    async def main() -> None:
        backend = RedisBackend.create(BackendContext(cfg, layout, torch.device("cpu"), Arena(nbytes, nbytes)))
        assert backend is not None
        try:
            await backend.put_many(keys, chunks)
        finally:
            await backend.close()

    try:
        run(main())
        client = sync_client(redis_server.url)
        client.set("one value", serde.HEADER_SIZE * b"h" + bytes(chunks[0].tensor.view(-1).view(torch.uint8).numpy()))
    finally:
        for c in chunks:
            c.release()
    one_value = client.memory_usage("one value", samples=0) / nbytes
    if one_value < 1.1:
        pytest.skip(f"this redis-server's allocator does not round values up to size classes ({one_value:.3f})")
    for key in keys:
        used = sum(client.memory_usage(n, samples=0) for n in names_of(key)) / nbytes
        assert used < 1.05, f"{used:.3f} bytes of Redis memory per KV byte (one value: {one_value:.3f})"


def test_ttl_is_set_when_configured(redis_server: RedisServer) -> None:
    keys = keys_of(2)

    async def main() -> None:
        async with opened(redis_server.url, redis_ttl_s=100) as backend:
            await put_keys(backend, keys)
            await put_keys(backend, keys)  # present already: MSETNX writes nothing
            assert backend.stats()["puts"] == 2, "the MSETNX replies are read out of the MULTI's EXEC"
            assert check_and_release(await backend.get_many(keys), keys) == [True, True]

    run(main())
    client = sync_client(redis_server.url)
    assert all(0 < client.ttl(n) <= 100 for k in keys for n in names_of(k))


def test_database_number_in_the_url(redis_server: RedisServer) -> None:
    keys = keys_of(1)

    async def main() -> None:
        async with opened(redis_server.url + "/3") as backend:
            await put_keys(backend, keys)

    run(main())
    assert sync_client(redis_server.url + "/3").exists(*names_of(keys[0])) == 2
    assert sync_client(redis_server.url + "/0").dbsize() == 0


def test_contains_prefix_remove_and_listener(redis_server: RedisServer) -> None:
    keys = keys_of(6)
    events: list[tuple[str, int]] = []

    class Listener:
        def on_admit(self, tier: str, digests: Sequence[bytes]) -> None:
            events.append(("admit", len(digests)))

        def on_evict(self, tier: str, digests: Sequence[bytes]) -> None:
            events.append(("evict", len(digests)))

    async def main() -> None:
        async with opened(redis_server.url) as backend:
            backend.set_listener(Listener())
            assert await backend.contains_prefix([]) == 0
            assert await backend.contains_prefix(keys) == 0
            await put_keys(backend, [keys[i] for i in (0, 1, 2, 4)])
            assert await backend.contains_prefix(keys) == 3
            await put_keys(backend, keys[:2])  # present already: a no-op
            assert await backend.remove([keys[1], keys[5]]) == 1
            assert await backend.contains_prefix(keys) == 1
            assert await backend.pin(keys) == 0 and await backend.unpin(keys) == 0

    run(main())
    assert events == [("admit", 4), ("evict", 1)]


def test_put_rejects_a_chunk_that_does_not_fit_its_key(redis_server: RedisServer) -> None:
    key = keys_of(1)[0]

    async def main() -> None:
        async with opened(redis_server.url) as backend:
            arena = Arena(CHUNK_BYTES, CHUNK_BYTES)
            wrong = arena.allocate(LAYOUT.chunk_shape(CHUNK // 2), LAYOUT.dtype)
            assert wrong is not None
            with wrong, pytest.raises(ValueError, match="does not fit"):
                await backend.put_many([key], [wrong])
            with pytest.raises(ValueError, match="1 keys but 0 chunks"):
                await backend.put_many([key], [])

    run(main())
    assert sync_client(redis_server.url).dbsize() == 0


def test_a_full_staging_arena_makes_misses(redis_server: RedisServer) -> None:
    keys = keys_of(4)

    async def main() -> None:
        async with opened(redis_server.url, staging_slots=2) as backend:
            await put_keys(backend, keys)
            got = await backend.get_many(keys)
            assert check_and_release(got, keys) == [True, True, False, False]
            assert backend.stats()["staging_full"] == 2
            assert backend.stats()["checksum_errors"] == 0

    run(main())
    assert sync_client(redis_server.url).dbsize() == 8  # nothing deleted (two keys a chunk)


def test_usage_reports_the_servers_memory() -> None:
    with RedisServer(["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]) as server:
        async def main() -> tuple[int, int]:
            async with opened(server.url) as backend:
                assert backend.usage() == (0, 0)
                await put_keys(backend, keys_of(2))
                return await sampled_usage(backend)

        used, capacity = run(main())
    assert used > 0 and capacity == 64 * 1024**2
