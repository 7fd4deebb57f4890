"""Fault injection for the Redis tier: dead, frozen and restarted servers, corrupted values, and
a Redis Cluster losing a node.

A dead or frozen server makes calls raise within ``tier_timeout_ms`` (the tier manager turns
that into misses), never hang; the same backend object serves hits again once the server is
back. A corrupted value, in either of a chunk's two keys, is a miss and a ``checksum_errors``
count, never wrong data, and both keys are deleted; a chunk that lost one of its keys (Redis
evicts and expires keys one by one) is a miss and a ``half_chunks`` count, deleted too, and can
be stored again; both whether the tier's fast read path or redis-py reads the values. In
a cluster, a dead node's chunks fail fast while the other nodes' chunks still read.
Run: ``.venv/bin/python -m pytest tests/backends/test_redis_faults.py`` (skips without redis-server).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import pytest
import redis as redis_sync

from kvlayer import serde
from kvlayer.backends.redis_pairs import ChunkNames
from kvlayer.keys import ChunkKey
from tests.backends.test_redis import (
    CHUNK_BYTES,
    READERS,
    check_and_release,
    chunk_bytes,
    keys_of,
    names_of,
    opened,
    put_keys,
    run,
    sampled_usage,
    store_bytes,
    sync_client,
    through_redis_py,
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
    deadline, every hit is the key's exact data, every hit and miss is counted, and whole
    rounds of hits come both before the kill and after the restart."""
    keys = keys_of(8)
    rounds: list[Round] = []

    async def workload(backend: Any, stop: asyncio.Event) -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                await put_keys(backend, keys)
                got = await backend.get_many(keys)
            except (ConnectionError, TimeoutError, OSError, redis_sync.RedisError) as e:  # the dead server
                rounds.append(Round(start, time.monotonic() - start, None, type(e).__name__))
            else:  # outside the try: a wrong byte fails the test
                rounds.append(Round(start, time.monotonic() - start, check_and_release(got, keys), ""))
            await asyncio.sleep(0.005)

    async def main() -> tuple[float, float, dict[str, int]]:
        async with opened(redis_server.url, tier_timeout_ms=TIMEOUT_MS) as backend:
            stop = asyncio.Event()
            task = asyncio.ensure_future(workload(backend, stop))
            await asyncio.sleep(0.2)
            killed = time.monotonic()
            redis_server.kill()
            await asyncio.sleep(0.3)
            restarted = time.monotonic()
            redis_server.restart()
            await asyncio.sleep(0.3)
            stop.set()
            await task
            assert backend._staging.used_count == 0
            return killed, restarted, backend.stats()

    killed, restarted, stats = run(main())
    assert max(r.duration for r in rounds) < 2 * TIMEOUT_MS / 1000 + SLACK_S  # a put and a get
    assert any(r.hits is None for r in rounds), "the kill should fail some rounds"
    everything = [True] * len(keys)
    assert any(r.hits == everything for r in rounds if r.start + r.duration < killed), "hits before the kill"
    assert any(r.hits == everything for r in rounds if r.start > restarted), "hits resume after the restart"
    served = [h for r in rounds if r.hits is not None for h in r.hits]
    assert (stats["hits"], stats["misses"]) == (served.count(True), served.count(False))


class Round(NamedTuple):
    """One put-then-get round of ``test_server_killed_mid_workload``."""

    start: float
    duration: float
    hits: list[bool] | None
    """Which keys hit (each checked exact); None when a call failed."""
    error: str


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


# --- corrupted values and half chunks ------------------------------------------------------
Corruption = Callable[[redis_sync.Redis, ChunkNames, ChunkNames], Any]
"""Spoils a chunk in Redis, given the client, the chunk's names and another chunk's."""


def edit(transform: Callable[[bytes, bytes], bytes]) -> Corruption:
    """The chunk's bytes (header + payload, as in a file) replaced by ``transform(them, another
    chunk's)``, then stored split as the tier splits them."""
    def corrupt(client: redis_sync.Redis, names: ChunkNames, other: ChunkNames) -> None:
        data, theirs = chunk_bytes(client, names), chunk_bytes(client, other)
        assert data is not None and theirs is not None
        store_bytes(client, names, transform(data, theirs))
    return corrupt


def flip(offset: int) -> Corruption:
    def transform(data: bytes, other: bytes) -> bytes:
        b = bytearray(data)
        b[offset] ^= 0x04
        return bytes(b)
    return edit(transform)


def one_key(which: int, transform: Callable[[bytes, bytes], bytes | None]) -> Corruption:
    """One key (0: head, 1: body) replaced by ``transform(its value, the other chunk's same key)``;
    None deletes it."""
    def corrupt(client: redis_sync.Redis, names: ChunkNames, other: ChunkNames) -> None:
        value = transform(client.get(names[which]), client.get(other[which]))
        client.delete(names[which]) if value is None else client.set(names[which], value)
    return corrupt


def as_list(which: int) -> Corruption:
    def corrupt(client: redis_sync.Redis, names: ChunkNames, other: ChunkNames) -> None:
        client.delete(names[which])
        client.rpush(names[which], b"not a string")
    return corrupt


HEAD, BODY = 0, 1
CORRUPTIONS: dict[str, Corruption] = {
    "payload bit flip (body)": flip(serde.HEADER_SIZE + 77),
    "last body byte bit flip": flip(-129),
    "last byte bit flip (head)": flip(-1),
    "header key bit flip": flip(10),
    "truncated payload": edit(lambda data, other: data[:-100]),
    "truncated header": edit(lambda data, other: data[: serde.HEADER_SIZE - 5]),
    "extra bytes": edit(lambda data, other: data + b"\0" * 8),
    "another key's chunk": edit(lambda data, other: other),
    "another key's head": one_key(HEAD, lambda value, other: other),
    "another key's body": one_key(BODY, lambda value, other: other),
    "head and body swapped": lambda client, names, other: client.mset(
        dict(zip(names, reversed(client.mget(names))))),
    "truncated head": one_key(HEAD, lambda value, other: value[:-1]),
    "longer body": one_key(BODY, lambda value, other: value + b"x"),
    "garbage head": one_key(HEAD, lambda value, other: b"not a chunk at all" * 300),
    "garbage body": one_key(BODY, lambda value, other: b"not a chunk at all" * 300),
    "empty head": one_key(HEAD, lambda value, other: b""),
    "empty body": one_key(BODY, lambda value, other: b""),
}
HALVES: dict[str, Corruption] = {
    "head deleted": one_key(HEAD, lambda value, other: None),
    "body deleted": one_key(BODY, lambda value, other: None),
    "head is a list": as_list(HEAD),
    "body is a list": as_list(BODY),
}
"""Chunks left with one string key (MGET reads a key of another type as missing)."""


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", sorted(CORRUPTIONS) + sorted(HALVES))
def test_corrupted_value_is_a_counted_miss(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, name: str,
                                           reader: str) -> None:
    if reader == "redis-py":
        through_redis_py(monkeypatch)
    keys = keys_of(4)
    victim, other = keys[1], keys[2]
    client = sync_client(redis_server.url)
    counter = "checksum_errors" if name in CORRUPTIONS else "half_chunks"

    async def main() -> None:
        async with opened(redis_server.url, tier_timeout_ms=TIMEOUT_MS) as backend:
            await put_keys(backend, keys)
            {**CORRUPTIONS, **HALVES}[name](client, names_of(victim), names_of(other))
            assert check_and_release(await backend.get_many(keys), keys) == [True, False, True, True]
            stats = backend.stats()
            assert (stats[counter], stats["checksum_errors"] + stats["half_chunks"]) == (1, 1)
            await wait_until_gone(client, victim)
            assert check_and_release(await backend.get_many(keys), keys) == [True, False, True, True]
            errors = ("checksum_errors", "half_chunks")
            assert [backend.stats()[c] for c in errors] == [stats[c] for c in errors], "now a plain miss"
            await put_keys(backend, keys)
            assert check_and_release(await backend.get_many(keys), keys) == [True] * 4, "stored again"
            assert backend._staging.used_count == 0

    run(main())


@pytest.mark.parametrize("name", ["head deleted", "body deleted"])
def test_a_lookup_drops_a_half_chunk_so_it_can_be_stored_again(redis_server: RedisServer, name: str) -> None:
    """A half chunk blocks MSETNX; the lookup the tier manager makes before each write deletes it
    (a key of another type counts in EXISTS: that corruption is found by the read)."""
    keys = keys_of(3)
    client = sync_client(redis_server.url)

    async def main() -> None:
        async with opened(redis_server.url, tier_timeout_ms=TIMEOUT_MS) as backend:
            await put_keys(backend, keys)
            HALVES[name](client, names_of(keys[1]), names_of(keys[2]))
            await put_keys(backend, keys[1:2])
            assert backend.stats()["puts"] == 3, "MSETNX does not write over a half chunk"
            assert await backend.contains_prefix(keys) == 1
            assert backend.stats()["half_chunks"] == 1
            assert client.exists(*names_of(keys[1])) == 0, "deleted before contains_prefix returned"
            await put_keys(backend, keys[1:2])
            assert await backend.contains_prefix(keys) == 3
            assert check_and_release(await backend.get_many(keys), keys) == [True] * 3

    run(main())


async def wait_until_gone(client: redis_sync.Redis, key: ChunkKey) -> None:
    for _ in range(200):
        if not client.exists(*names_of(key)):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the corrupt chunk's keys were not deleted")


# --- Redis Cluster ----------------------------------------------------------------------------
def node_ports(cluster: RedisClusterNodes, keys: list[ChunkKey]) -> list[int]:
    """The port of the node holding each key's chunk (both of its keys)."""
    where = {}
    for node in cluster.nodes:
        for name in sync_client(node.url).keys("kvlayer:*"):
            where[name] = node.port
    assert all(where[names_of(k).head] == where[names_of(k).body] for k in keys), "one node per chunk"
    return [where[names_of(k).head] for k in keys]


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_cluster_spreads_chunks_and_survives_a_failed_node(redis_cluster: RedisClusterNodes, fault: str) -> None:
    """A killed node refuses connections at once; a frozen one answers nothing until the deadline."""
    keys = keys_of(12)

    async def main() -> None:
        async with opened(redis_cluster.url, redis_cluster=True, tier_timeout_ms=TIMEOUT_MS,
                          redis_ttl_s=1000) as backend:
            await put_keys(backend, keys)
            assert await backend.contains_prefix(keys) == 12
            assert check_and_release(await backend.get_many(keys), keys) == [True] * 12
            assert sorted(backend.keys()) == sorted(k.digest for k in keys)
            assert (await sampled_usage(backend))[0] > 3 * 12 * CHUNK_BYTES  # summed over the primaries
            ports = node_ports(redis_cluster, keys)
            assert len(set(ports)) == 3, "chunks should spread over every node"
            for k, p in zip(keys, ports):
                node = sync_client(redis_cluster.node_of(p).url)
                assert len(chunk_bytes(node, names_of(k)) or b"") == serde.HEADER_SIZE + CHUNK_BYTES
                assert all(0 < node.ttl(n) <= 1000 for n in names_of(k)), "the expiry follows MSETNX"

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
