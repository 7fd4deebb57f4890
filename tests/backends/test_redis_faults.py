"""Fault injection for the Redis tier: dead, frozen and restarted servers, corrupted values, and
a Redis Cluster losing a node.

A dead or frozen server makes calls raise within ``tier_timeout_ms`` (the tier manager turns
that into misses), never hang; the same backend object serves hits again once the server is
back. A corrupted value is a miss and a ``checksum_errors`` count, never wrong data, and is
deleted. In a cluster, a dead node's chunks fail fast while the other nodes' chunks still read.
Run: ``.venv/bin/python -m pytest tests/backends/test_redis_faults.py`` (skips without redis-server).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis as redis_sync

from kvlayer import serde
from kvlayer.keys import ChunkKey
from tests.backends.test_redis import (
    CHUNK_BYTES,
    check_and_release,
    keys_of,
    opened,
    put_keys,
    run,
    sampled_usage,
    sync_client,
)
from tests.redis_server import RedisClusterNodes, RedisServer

pytestmark = pytest.mark.redis

TIMEOUT_MS = 400
SLACK_S = 0.3
"""Allowed beyond the deadline for scheduling on a busy 2-core machine."""


async def fails_fast(call: Awaitable[Any]) -> BaseException:
    """The exception ``call`` raises, asserting it came within the deadline."""
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        await call
    assert time.monotonic() - start < TIMEOUT_MS / 1000 + SLACK_S
    return info.value


# --- dead, frozen and restarted servers --------------------------------------------------
def test_killed_server_fails_fast_and_restart_resumes(redis_server: RedisServer) -> None:
    keys = keys_of(4)

    async def main() -> None:
        async with opened(redis_server.url, tier_timeout_ms=TIMEOUT_MS) as backend:
            await put_keys(backend, keys)
            assert check_and_release(await backend.get_many(keys), keys) == [True] * 4
            redis_server.kill()
            for _ in range(3):  # every call fails fast, including those after the first failure
                await fails_fast(backend.get_many(keys))
                await fails_fast(backend.contains_prefix(keys))
                await fails_fast(put_keys(backend, keys))
                await fails_fast(backend.remove(keys))
            assert backend._staging.used_count == 0
            redis_server.restart()  # an empty server on the same port
            assert await backend.contains_prefix(keys) == 0  # the first call after the restart works
            await put_keys(backend, keys)
            assert check_and_release(await backend.get_many(keys), keys) == [True] * 4

    run(main())


def test_server_killed_mid_workload(redis_server: RedisServer) -> None:
    """A loop of puts and gets while the server dies and comes back: no call outlives the
    deadline, data read is always exact, and hits resume after the restart."""
    keys = keys_of(8)
    outcomes: list[tuple[float, float, bool]] = []  # (start, duration, succeeded)

    async def workload(backend: Any, stop: asyncio.Event) -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                await put_keys(backend, keys)
                check_and_release(await backend.get_many(keys), keys)
                ok = True
            except Exception:
                ok = False
            outcomes.append((start, time.monotonic() - start, ok))
            await asyncio.sleep(0.005)

    async def main() -> None:
        async with opened(redis_server.url, tier_timeout_ms=TIMEOUT_MS) as backend:
            stop = asyncio.Event()
            task = asyncio.ensure_future(workload(backend, stop))
            await asyncio.sleep(0.2)
            redis_server.kill()
            await asyncio.sleep(0.3)
            restarted = time.monotonic()
            redis_server.restart()
            await asyncio.sleep(0.3)
            stop.set()
            await task
            assert backend._staging.used_count == 0
        assert max(d for _, d, _ in outcomes) < 2 * TIMEOUT_MS / 1000 + SLACK_S  # a put and a get
        assert not all(ok for _, _, ok in outcomes)
        assert any(ok for start, _, ok in outcomes if start > restarted)

    run(main())


def test_restart_between_calls_is_invisible(redis_server: RedisServer) -> None:
    """The pooled connection is dead after a restart: the call reconnects instead of failing."""
    keys = keys_of(2)

    async def main() -> None:
        async with opened(redis_server.url, tier_timeout_ms=TIMEOUT_MS) as backend:
            await put_keys(backend, keys)
            redis_server.restart()
            await put_keys(backend, keys)
            assert check_and_release(await backend.get_many(keys), keys) == [True, True]

    run(main())


def test_frozen_server_times_out_without_leaks(redis_server: RedisServer) -> None:
    keys = keys_of(3)

    async def main() -> None:
        async with opened(redis_server.url, tier_timeout_ms=TIMEOUT_MS) as backend:
            await put_keys(backend, keys)
            redis_server.pause()
            try:
                for call in (backend.get_many(keys), backend.contains_prefix(keys), put_keys(backend, keys)):
                    assert isinstance(await fails_fast(call), TimeoutError)
            finally:
                redis_server.resume()
            assert backend._staging.used_count == 0
            assert check_and_release(await backend.get_many(keys), keys) == [True] * 3

    run(main())


def test_unreachable_server_at_start_fails_fast() -> None:
    with RedisServer() as server:
        url = server.url
    keys = keys_of(1)

    async def main() -> None:
        async with opened(url, tier_timeout_ms=TIMEOUT_MS) as backend:
            await fails_fast(backend.get_many(keys))

    run(main())


# --- corrupted values ---------------------------------------------------------------------
Corruption = Callable[[redis_sync.Redis, str, bytes, bytes], Any]
"""Replaces the value under a name, given the client, the name, its value and another key's."""


def rewrite(transform: Callable[[bytes, bytes], bytes]) -> Corruption:
    return lambda client, name, value, other: client.set(name, transform(value, other))


def flip(offset: int) -> Corruption:
    def transform(value: bytes, other: bytes) -> bytes:
        data = bytearray(value)
        data[offset] ^= 0x04
        return bytes(data)
    return rewrite(transform)


def as_list(client: redis_sync.Redis, name: str, value: bytes, other: bytes) -> None:
    client.delete(name)
    client.rpush(name, value)


CORRUPTIONS: dict[str, Corruption] = {
    "payload bit flip": flip(serde.HEADER_SIZE + 77),
    "last byte bit flip": flip(-1),
    "header key bit flip": flip(10),
    "truncated payload": rewrite(lambda value, other: value[:-100]),
    "truncated header": rewrite(lambda value, other: value[: serde.HEADER_SIZE - 5]),
    "extra bytes": rewrite(lambda value, other: value + b"\0" * 8),
    "another key's value": rewrite(lambda value, other: other),
    "garbage": rewrite(lambda value, other: b"not a chunk at all" * 300),
    "empty": rewrite(lambda value, other: b""),
    "a list, not a string": as_list,
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupted_value_is_a_counted_miss(redis_server: RedisServer, name: str) -> None:
    keys = keys_of(4)
    victim, other = keys[1], keys[2]
    client = sync_client(redis_server.url)

    async def main() -> None:
        async with opened(redis_server.url, tier_timeout_ms=TIMEOUT_MS) as backend:
            await put_keys(backend, keys)
            victim_name = f"kvlayer:{victim.hex}"
            CORRUPTIONS[name](client, victim_name, client.get(victim_name), client.get(f"kvlayer:{other.hex}"))
            assert check_and_release(await backend.get_many(keys), keys) == [True, False, True, True]
            assert backend.stats()["checksum_errors"] == 1
            await wait_until_gone(client, victim)
            assert check_and_release(await backend.get_many(keys), keys) == [True, False, True, True]
            assert backend.stats()["checksum_errors"] == 1  # now a plain miss
            assert backend._staging.used_count == 0

    run(main())


async def wait_until_gone(client: redis_sync.Redis, key: ChunkKey) -> None:
    for _ in range(200):
        if not client.exists(f"kvlayer:{key.hex}"):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the corrupt value was not deleted")


# --- Redis Cluster ----------------------------------------------------------------------------
def node_ports(cluster: RedisClusterNodes, keys: list[ChunkKey]) -> list[int]:
    """The port of the node holding each key's chunk."""
    where = {}
    for node in cluster.nodes:
        for name in sync_client(node.url).keys("kvlayer:*"):
            where[name.decode()] = node.port
    return [where[f"kvlayer:{k.hex}"] for k in keys]


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_cluster_spreads_chunks_and_survives_a_failed_node(redis_cluster: RedisClusterNodes, fault: str) -> None:
    """A killed node refuses connections at once; a frozen one answers nothing until the deadline."""
    keys = keys_of(12)

    async def main() -> None:
        async with opened(redis_cluster.url, redis_cluster=True, tier_timeout_ms=TIMEOUT_MS) as backend:
            await put_keys(backend, keys)
            assert await backend.contains_prefix(keys) == 12
            assert check_and_release(await backend.get_many(keys), keys) == [True] * 12
            assert sorted(backend.keys()) == sorted(k.digest for k in keys)
            assert (await sampled_usage(backend))[0] > 3 * 12 * CHUNK_BYTES  # summed over the primaries
            ports = node_ports(redis_cluster, keys)
            assert len(set(ports)) == 3, "chunks should spread over every node"
            assert all(len(v) == serde.HEADER_SIZE + CHUNK_BYTES for v in [
                sync_client(redis_cluster.node_of(p).url).get(f"kvlayer:{k.hex}") for k, p in zip(keys, ports)])

            dead = ports[0]
            getattr(redis_cluster.node_of(dead), fault)()
            for _ in range(2):
                start = time.monotonic()
                got = await backend.get_many(keys)
                assert time.monotonic() - start < TIMEOUT_MS / 1000 + SLACK_S
                assert check_and_release(got, keys) == [p != dead for p in ports]
            assert backend.stats()["node_errors"] == 2 * ports.count(dead)
            assert await backend.contains_prefix(keys) == 0  # the first key is on the dead node
            alive = [k for k, p in zip(keys, ports) if p != dead]
            assert await backend.contains_prefix(alive) == len(alive)
            await fails_fast(backend.get_many([k for k, p in zip(keys, ports) if p == dead]))
            assert backend._staging.used_count == 0

            node = redis_cluster.node_of(dead)
            if fault == "pause":
                node.resume()
            else:
                node.start()  # empty: it lost its chunks
            redis_cluster.wait_ok()
            await put_keys(backend, keys)
            assert check_and_release(await backend.get_many(keys), keys) == [True] * 12

    run(main())
