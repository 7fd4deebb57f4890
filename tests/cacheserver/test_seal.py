"""The server verifies its own arena (``cacheserver/scrub.py``), with real server processes: commits
sealed, a stray write found by the re-scrub, leases taken on the seal without hashing, and chunks
promoted from the NVMe tier at the size and tenant their ``LEASE`` names."""

from __future__ import annotations

import os
import time

import pytest
import xxhash

from kvlayer import KVCacheEngine
from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.index import ChunkIndex, Session
from kvlayer.cacheserver.protocol import DEFAULT_TENANT, Key, Reserve, Status

from . import worker
from .test_lower import arena, configured, files, keys, payloads, wait_for
from .test_ops import FlaggedServer, free_port, scrape


def _kv(sock: str, **extra: object) -> KVCacheEngine:
    return KVCacheEngine({**worker.kv_config(sock), **extra}, worker.layout(), model_name="m", model_fingerprint="f")


def _backend(kv: KVCacheEngine) -> dict:
    return kv.stats()["tiers"]["cache"]["backend"]


def test_the_index_seals_drops_and_spoils_what_the_scrub_hashed():
    index, s = ChunkIndex(0, 1 << 16), Session()
    ks = [Key(bytes([i]) * 32, b"t" * 16) for i in range(3)]
    index.reserve(s, [(k, 1000) for k in ks])
    index.commit(s, [(k.digest, 100 + i) for i, k in enumerate(ks)])
    index.release(s, [ks[0].digest, ks[1].digest])  # the third stays leased by its writer
    line = index.to_seal(1)
    assert [d for d, _ in line] == [ks[0].digest]  # the oldest commit, one chunk past the budget
    todo = index.to_seal(1 << 20)
    assert [d for d, _ in todo] == [k.digest for k in ks]
    assert index.lease(s, [ks[0]])[0].sealed is False
    bad = index.checked([(todo[0][0], todo[0][1], 100), (todo[1][0], todo[1][1], 7), (todo[2][0], todo[2][1], 8)])
    assert bad == [ks[1].digest, ks[2].digest] and index.checksum_errors == 2 and index.sealed == 1
    assert index.lease(s, [ks[0]])[0].sealed is True and index.to_seal(1 << 20) == []
    assert index.lookup(ks) == 1  # the second dropped, the third spoiled: a miss while still leased
    assert index.lease(s, [ks[2]])[0].status is Status.MISSING
    assert index.counts() == (2, 0, 3)  # the spoiled one stays until its writer's lease goes
    index.release(s, [ks[2].digest])
    assert index.counts() == (1, 0, 2) and index.used == 1024
    assert [d for d, _ in index.to_rescrub(1)] == [ks[0].digest]
    stale = index.to_rescrub(1)
    index.release(s, [ks[0].digest] * 2)
    index.remove([ks[0].digest])
    index.reserve(s, [(ks[0], 1000)])  # stored anew while the old entry was being hashed
    index.commit(s, [(ks[0].digest, 5)])
    assert index.checked([(stale[0][0], stale[0][1], 0)]) == [] and index.checksum_errors == 2  # skipped


def test_a_stray_write_into_a_sealed_chunk_is_found_by_the_scrub(server):
    src = worker.kv_caches(1)
    with _kv(server.socket_path) as kv:
        assert kv.store(worker.TOKENS, src, worker.slots(40, 0)) == 5
        server.wait_stats(lambda s: s.sealed == 5 and s.leases == 0)
        with server.client() as c:
            key = kv.keys(worker.TOKENS)[2]
            path, offset = c.welcome.path, c.lease([Key(key.digest, key.tokens_digest)])[0].offset
        with open(path, "r+b") as f:  # a stray write into the third chunk's bytes
            f.seek(offset + 100)
            f.write(b"\xff\xfe")
        t0 = time.monotonic()
        stats = server.wait_stats(lambda s: s.checksum_errors == 1 and s.chunks == 4, timeout=5)
        assert time.monotonic() - t0 < 2 and stats.sealed == 4  # 4 MiB at 512 MiB/s: milliseconds
        dst = worker.kv_caches(None)
        assert kv.retrieve(worker.TOKENS, dst, worker.slots(40, 20)) == 16  # a partial hit, never the damage
        assert worker.rows(dst, worker.slots(16, 20)) == worker.rows(src, worker.slots(16, 0))
        backend = _backend(kv)
        assert (backend["checksum_errors"], backend["verified"], backend["sealed_leases"]) == (0, 0, 2)
        kv.store(worker.TOKENS, src, worker.slots(40, 0))  # the dropped chunk is stored again
        assert kv.retrieve(worker.TOKENS, dst, worker.slots(40, 20)) == 40
        assert worker.rows(dst, worker.slots(40, 20)) == worker.rows(src, worker.slots(40, 0))


@pytest.mark.parametrize(("mode", "hashed"), [("server", 0), ("first", 5), ("always", 10)])
def test_a_restarted_client_takes_sealed_chunks_without_hashing(server, mode, hashed):
    src = worker.kv_caches(2)
    with _kv(server.socket_path) as kv:
        assert kv.store(worker.TOKENS, src, worker.slots(40, 0)) == 5
    server.wait_stats(lambda s: s.sealed == 5)
    with _kv(server.socket_path, cache_server_verify=mode) as kv:  # a new process's connection: no records
        for _ in range(2):
            dst = worker.kv_caches(None)
            assert kv.retrieve(worker.TOKENS, dst, worker.slots(40, 20)) == 40
            assert worker.rows(dst, worker.slots(40, 20)) == worker.rows(src, worker.slots(40, 0))
        backend = _backend(kv)
        assert (backend["verified"], backend["checksum_errors"]) == (hashed, 0)
        assert backend["sealed_leases"] == (10 if mode == "server" else 0)


def test_the_scrub_is_paced_and_shows_in_the_metrics(sock_path):
    """3 sealed chunks of 4 KiB, re-scrubbed for a second at 1 MiB/s: at most 20 hand-offs to the
    thread per second however few bytes there are (no spin)."""
    port = free_port()
    proc = FlaggedServer(sock_path, "4MiB", "--scrub-mib-s", "1", "--metrics-port", str(port)).start()
    try:
        ks = [Key(bytes([i]) * 32, b"t" * 16) for i in range(3)]
        with proc.client() as c:
            c.reserve([(k, 4096) for k in ks])
            assert c.commit([(k.digest, xxhash.xxh3_64_intdigest(bytes(4096))) for k in ks]) == 3
        proc.wait_stats(lambda s: s.sealed == 3)
        before = scrape(port)
        time.sleep(1.0)
        after = scrape(port)
    finally:
        assert proc.stop() == 0
    assert after[("kvlayer_cache_server_sealed_chunks", ())] == 3
    assert after[("kvlayer_cache_server_checksum_errors_total", ())] == 0
    scrubbed = after[("kvlayer_cache_server_scrubbed_bytes_total", ())] - \
        before[("kvlayer_cache_server_scrubbed_bytes_total", ())]
    assert 0 < scrubbed <= 25 * 3 * 4096  # one pass of 12 KiB per 50 ms hop (the rate alone would allow 1 MiB)


def _promoted_server(tmp_path, sock_path, tenant: bytes):
    """A server with an NVMe tier that holds 2 chunks of ``tenant``, restarted with an empty arena."""
    root = tmp_path / "nvme"
    server = configured(tmp_path, sock_path, nvme_path=root, nvme_capacity="8MiB")
    ks, datas = keys(2), payloads(2)
    with server.client() as c:
        view = arena(c)
        slots = c.reserve([Reserve(k, len(d), tenant) for k, d in zip(ks, datas)])
        for s, d in zip(slots, datas):
            view[s.offset:s.offset + len(d)] = d
        assert c.commit([(k.digest, xxhash.xxh3_64_intdigest(d)) for k, d in zip(ks, datas)]) == 2
        view.close()
        wait_for(lambda: all(os.path.exists(f) for f in files(root, ks)), "the write-through")
    server.kill()
    server.start()
    return server, root, ks, datas


def test_a_promoted_chunk_is_sealed_and_counts_under_its_tenant(tmp_path, sock_path):
    tenant = b"T" * wire.TENANT_BYTES
    server, _, ks, datas = _promoted_server(tmp_path, sock_path, tenant)
    with server.client() as c:
        leases = c.lease([Reserve(k, len(d), tenant) for k, d in zip(ks, datas)])
        assert [(x.status, x.size, x.sealed) for x in leases] == [(Status.OK, len(d), True) for d in datas]
        view = arena(c)
        assert [view[x.offset:x.offset + x.size] for x in leases] == datas
        view.close()
        _, tenants = wire.parse_tenants(c.call(wire.Op.TENANTS))
        assert {t.tenant: t.chunks for t in tenants} == {tenant: 2}  # not the default tenant's
        assert c.stats().sealed == 2
    server.output()


def test_a_lower_tier_chunk_is_read_at_the_size_the_lease_names(tmp_path, sock_path):
    """No size is probed: a lease that names none (0) is not promoted, one of another size than
    the stored chunk's is a miss (the backend counts a corrupt chunk and deletes it)."""
    server, root, ks, datas = _promoted_server(tmp_path, sock_path, DEFAULT_TENANT)
    with server.client() as c:
        assert c.lookup(ks) == 2  # the NVMe tier holds both
        assert [x.status for x in c.lease(ks)] == [Status.MISSING] * 2  # bare keys: size 0, arena only
        assert c.lease([Reserve(ks[0], len(datas[0]))])[0].status is Status.OK
        assert c.lease([Reserve(ks[1], len(datas[1]) + 256)])[0].status is Status.MISSING
        assert c.stats().chunks == 1
    assert not os.path.exists(files(root, ks)[1])
    out = server.output()
    assert "checksum_errors" in out and "a raw chunk" in out, out  # the file's size is not the lease's
