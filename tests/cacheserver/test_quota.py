"""Per-salt quotas: the tenant tag of a key, the index's eviction rules, and a real server with two tenants."""

from __future__ import annotations

import mmap
import os

import pytest
import torch
import xxhash

from kvlayer import ConfigError, KVLayerConfig
from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.index import ChunkIndex, Session
from kvlayer.cacheserver.protocol import Key, Reserve, Status
from kvlayer.cacheserver.settings import quota_bytes
from kvlayer.keys import DEFAULT_TENANT, TENANT_BYTES, Namespace, chunk_keys, group_key, tenant_tag
from kvlayer.layout import KVLayout, WindowGroup

from .test_ops import FlaggedServer

A, B = b"A" * 8, b"B" * 8


def key(i: int) -> Key:
    return Key(i.to_bytes(32, "little"), b"t" * 16)


def store(index: ChunkIndex, tenant: bytes, ids: range, size: int = 1000) -> list[Status]:
    """Reserve, commit and release (the writer's lease) each id, one frame per chunk."""
    s, out = Session(), []
    for i in ids:
        (slot,) = index.reserve(s, [Reserve(key(i), size, tenant)])
        if slot.status is Status.OK:
            assert index.commit(s, [(key(i).digest, 0)]) == 1 and index.release(s, [key(i).digest]) == 1
        out.append(slot.status)
    return out


def held(index: ChunkIndex, ids: range) -> list[int]:
    return [i for i in ids if index.lookup([key(i)]) == 1]


def usage(index: ChunkIndex) -> dict[bytes, tuple[int, int, int]]:
    return {t.tenant: (t.used_bytes, t.chunks, t.refused) for t in index.tenants()}


def test_the_tenant_tag_comes_from_the_salt_and_keys_compare_without_it():
    ns = Namespace("m", "fp", KVLayout(2, 1, 4, torch.float32, 4), chunk_size=4)
    plain, salted, other = (chunk_keys(ns.with_salt(s), list(range(12))) for s in ("", "alice", "bob"))
    assert {k.tenant for k in plain} == {DEFAULT_TENANT} and tenant_tag("") == DEFAULT_TENANT
    assert {k.tenant for k in salted} == {tenant_tag("alice")} != {tenant_tag("bob")} == {k.tenant for k in other}
    assert len(tenant_tag("alice")) == TENANT_BYTES == wire.TENANT_BYTES and b"alice" not in tenant_tag("alice")
    assert salted[0] != plain[0]  # the salt enters the digest as before
    same = chunk_keys(ns.with_salt("alice"), list(range(12)))
    assert same == salted and hash(same[0]) == hash(salted[0])
    import dataclasses

    assert dataclasses.replace(salted[0], tenant=DEFAULT_TENANT) == salted[0]  # not part of equality
    assert group_key(salted[0], WindowGroup(2, (1,)), 2).tenant == tenant_tag("alice")
    assert chunk_keys(ns.with_salt("alice"), list(range(12)), prefix=salted[:2])[2].tenant == tenant_tag("alice")


def test_the_reserve_frame_carries_the_tenant():
    body = wire.reserve([Reserve(key(1), 700, A), (key(2), 9)])
    assert wire.parse_reserve(body) == [Reserve(key(1), 700, A), Reserve(key(2), 9, DEFAULT_TENANT)]
    with pytest.raises(ValueError, match="8 bytes"):
        wire.reserve([Reserve(key(1), 700, b"short")])
    assert wire.VERSION == 3  # 3: LEASE items carry size and tenant too


def test_a_tenant_at_its_quota_evicts_its_own_chunks_never_anothers():
    index = ChunkIndex(0, 8 * 1024, quota=3 * 1024)  # 8 chunks of 1000 (1024 aligned); 3 per tenant
    assert store(index, B, range(100, 102)) == [Status.OK] * 2
    assert store(index, A, range(20)) == [Status.OK] * 20
    assert held(index, range(100, 102)) == [100, 101]  # B's chunks stayed
    assert held(index, range(20)) == [17, 18, 19]  # A's newest 3; its older ones went for them
    assert usage(index) == {A: (3 * 1024, 3, 0), B: (2 * 1024, 2, 0)} and index.used == 5 * 1024
    assert index.evictions == 17


def test_a_tenant_at_its_quota_with_only_leased_chunks_is_refused():
    index = ChunkIndex(0, 8 * 1024, quota=2 * 1024)
    store(index, A, range(2))
    reader = Session()
    assert [x.status for x in index.lease(reader, [key(0), key(1)])] == [Status.OK] * 2
    s = Session()
    got = index.reserve(s, [Reserve(key(5), 1000, A), Reserve(key(6), 1000, A)])
    assert [x.status for x in got] == [Status.FULL, Status.FULL]  # room in the arena, none in A's quota
    assert store(index, B, range(100, 102)) == [Status.OK] * 2  # B has its own quota
    assert usage(index) == {A: (2048, 2, 1), B: (2048, 2, 0)} and index.refused == 1
    index.end(reader)
    assert store(index, A, range(5, 6)) == [Status.OK] and held(index, range(2)) == [0]  # A's LRU went
    # (the lease touched its batch tail first: key 1 was the least recent)


def test_a_chunk_larger_than_the_quota_is_refused_and_the_default_tenant_has_one_too():
    index = ChunkIndex(0, 8 * 1024, quota=1024)
    assert store(index, A, range(1), size=2000) == [Status.FULL]
    s = Session()
    assert index.reserve(s, [(key(1), 1000)])[0].status is Status.OK  # a bare item: the default tenant
    assert index.reserve(s, [(key(2), 1000)])[0].status is Status.FULL  # its reservation is not evictable
    assert usage(index) == {DEFAULT_TENANT: (1024, 0, 1), A: (0, 0, 1)}
    index.end(s)
    assert usage(index) == {DEFAULT_TENANT: (0, 0, 1), A: (0, 0, 1)} and index.used == 0


def test_a_tenant_within_its_quota_may_evict_another_tenants_lru_chunks():
    index = ChunkIndex(0, 4 * 1024, quota=3 * 1024)
    store(index, B, range(100, 103))
    assert store(index, A, range(2)) == [Status.OK] * 2  # the arena is full, A is within its quota
    assert held(index, range(100, 103)) == [101, 102] and usage(index)[A] == (2048, 2, 0)  # B's oldest went


def test_quota_settings():
    assert quota_bytes("0.25", 4000) == 1000 and quota_bytes("1.0", 4000) == 4000
    assert quota_bytes("2GiB", 1) == 2 * 1024**3 and quota_bytes("4096", 1) == 4096
    for bad in ("0", "0.0", "1.5", "-0.5", "lots"):
        with pytest.raises(ValueError, match="cache_salt_quota"):
            quota_bytes(bad, 4000)
    assert KVLayerConfig.load({"cache_salt_quota": "0.5"}).cache_salt_quota == "0.5"
    with pytest.raises(ConfigError, match="cache_salt_quota"):
        KVLayerConfig.load({"cache_salt_quota": "2 bananas"})
    with pytest.raises(ValueError, match="salt_quota"):
        ChunkIndex(0, 4096, quota=0)


def test_one_tenant_storing_far_past_its_quota_never_pushes_anothers_chunks_out(sock_path):
    """A real server, two tenants: B stores 16 chunks; A stores 64 (4x its quota of 1 MiB) in
    frames of 4. B's chunks all stay with their exact bytes; A holds at most its quota."""
    chunk, quota = 64 * 1024, 1024**2
    proc = FlaggedServer(sock_path, "4MiB", "--salt-quota", "0.25").start()
    try:
        with proc.client() as b, proc.client() as a:
            fd = os.open(b.welcome.path, os.O_RDWR)
            arena = mmap.mmap(fd, b.welcome.arena_bytes)
            os.close(fd)

            def put(client, tenant: bytes, ids: list[int]) -> list[Status]:
                keys = [key(i) for i in ids]
                slots = client.reserve([Reserve(k, chunk, tenant) for k in keys])
                done = [(k, s) for k, s in zip(keys, slots) if s.status is Status.OK]
                for k, s in done:
                    arena[s.offset:s.offset + chunk] = k.digest[:1] * chunk
                assert client.commit([(k.digest, xxhash.xxh3_64_intdigest(k.digest[:1] * chunk))
                                      for k, _ in done]) == len(done)
                assert client.release([k.digest for k, _ in done]) == len(done)
                return [s.status for s in slots]

            bs = list(range(200, 216))
            assert put(b, B, bs) == [Status.OK] * 16
            for start in range(0, 64, 4):
                assert put(a, A, list(range(start, start + 4))) == [Status.OK] * 4
                quota_now, tenants = wire.parse_tenants(a.call(wire.Op.TENANTS))
                used = {t.tenant: t.used_bytes for t in tenants}
                assert quota_now == quota and used[A] <= quota and used[B] == 16 * chunk
                assert sum(used.values()) == a.stats().used_bytes
            assert b.lookup([key(i) for i in bs]) == 16
            leases = b.lease([key(i) for i in bs])
            for i, lease in zip(bs, leases):
                assert (lease.status, lease.size, lease.checksum) == (Status.OK, chunk,
                                                                       xxhash.xxh3_64_intdigest(bytes([i]) * chunk))
                assert arena[lease.offset:lease.offset + chunk] == bytes([i]) * chunk
            newest = [key(i) for i in range(48, 64)]
            assert a.lookup(newest) == 16 and a.lookup([key(47)]) == 0
            stats = a.stats()
            assert (stats.chunks, stats.used_bytes, stats.evictions, stats.refused) == (32, 32 * chunk, 48, 0)
            arena.close()
    finally:
        assert proc.stop() == 0


def test_engine_clients_are_accounted_to_their_salts_tenant(sock_path, tmp_path):
    """Real ``KVCacheEngine`` processes: each salt's chunks count against its own tenant (the
    empty salt's included), whose quota (2 chunks of 3 KiB) bounds them; neither evicts the other's."""
    from .test_clients import run_worker

    proc = FlaggedServer(sock_path, "64KiB", "--salt-quota", "8KiB").start()
    try:
        run_worker("store", sock_path, "")
        run_worker("store", sock_path, "alice")
        with proc.client() as c:
            quota, tenants = wire.parse_tenants(c.call(wire.Op.TENANTS))
            stats = c.stats()
        assert quota == 8192 and (stats.used_bytes, stats.chunks, stats.evictions) == (4 * 3072, 4, 0)
        assert {t.tenant: (t.used_bytes, t.chunks) for t in tenants} == {DEFAULT_TENANT: (2 * 3072, 2),
                                                                         tenant_tag("alice"): (2 * 3072, 2)}
        refused = {t.tenant: t.refused for t in tenants}  # each store's third chunk, once per reserve it sent
        assert min(refused.values()) > 0 and sum(refused.values()) == stats.refused
        assert run_worker("retrieve", sock_path, "", str(tmp_path / "a.bin"))["tokens"] == 16
        assert run_worker("retrieve", sock_path, "alice", str(tmp_path / "b.bin"))["tokens"] == 16
    finally:
        assert proc.stop() == 0
