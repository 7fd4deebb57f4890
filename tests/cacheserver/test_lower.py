"""The server's own lower tiers (``cacheserver/lower.py``), with real server processes: chunks
written through to NVMe and Redis, found again after a SIGKILL, corrupt files and dead tiers."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import xxhash

from kvlayer.backends.nvme_files import chunk_path
from kvlayer.cacheserver.protocol import DEFAULT_TENANT, Key, Reserve, Status
from kvlayer.cacheserver.sync_client import SyncClient

from ..redis_server import RedisServer
from .conftest import ROOT, ServerProcess

SIZES = (4096, 6000)


class ConfiguredServer(ServerProcess):
    """A ``kvlayer cache-server`` started with ``--config`` (its lower tiers), restartable on one socket."""

    def __init__(self, socket_path: str, config: Path) -> None:
        super().__init__(socket_path, "1MiB")
        self.config = config

    def start(self) -> ConfiguredServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvlayer.cli", "cache-server", "--socket",
                                      self.socket_path, "--cpu-capacity", self.capacity, "--config", str(self.config)],
                                     env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        assert "listening on" in line, line + self.proc.stdout.read()
        return self

    def output(self) -> str:
        """Everything the server printed, once it stopped (SIGTERM)."""
        self.stop()
        assert self.proc is not None
        return self.proc.stdout.read()


def keys(n: int, tag: bytes = b"k") -> list[Key]:
    return [Key(xxhash.xxh3_128_digest(tag + bytes([i])) * 2, xxhash.xxh3_128_digest(tag + b"t" + bytes([i])))
            for i in range(n)]


def payloads(n: int) -> list[bytes]:
    return [os.urandom(SIZES[i % len(SIZES)]) for i in range(n)]


def sizes(datas: list[bytes]) -> list[int]:
    return [len(d) for d in datas]


def arena(client: SyncClient) -> mmap.mmap:
    fd = os.open(client.welcome.path, os.O_RDWR)
    try:
        return mmap.mmap(fd, client.welcome.arena_bytes)
    finally:
        os.close(fd)


def store(client: SyncClient, ks: list[Key], datas: list[bytes]) -> None:
    """Reserve, write into the arena, commit: what an engine's save does."""
    view = arena(client)
    slots = client.reserve([(k, len(d)) for k, d in zip(ks, datas)])
    assert [s.status for s in slots] == [Status.OK] * len(ks)
    for s, d in zip(slots, datas):
        view[s.offset:s.offset + len(d)] = d
    assert client.commit([(k.digest, xxhash.xxh3_64_intdigest(d)) for k, d in zip(ks, datas)]) == len(ks)
    view.close()


def loaded(client: SyncClient, ks: list[Key], sizes: list[int], tenant: bytes = DEFAULT_TENANT) -> list[bytes | None]:
    """Lease each key as a chunk of its size (what a lower tier must hold, of ``tenant``) and read
    its bytes from the arena (None for a miss), checking the checksum."""
    view = arena(client)
    out: list[bytes | None] = []
    for lease in client.lease([Reserve(k, n, tenant) for k, n in zip(ks, sizes)]):
        if lease.status is not Status.OK:
            out.append(None)
            continue
        data = bytes(view[lease.offset:lease.offset + lease.size])
        assert xxhash.xxh3_64_intdigest(data) == lease.checksum
        out.append(data)
    view.close()
    return out


def wait_for(ok, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def files(root: Path, ks: list[Key]) -> list[str]:
    return [chunk_path(str(root), k.digest, 0) for k in ks]


def configured(tmp_path: Path, sock_path: str, **settings: object) -> ConfiguredServer:
    config = tmp_path / "server.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in settings.items()))
    return ConfiguredServer(sock_path, config).start()


def stored_on_nvme(server: ConfiguredServer, root: Path, n: int) -> tuple[list[Key], list[bytes]]:
    """``n`` chunks stored through a client, once the server wrote them all to its NVMe tier."""
    ks, datas = keys(n), payloads(n)
    with server.client() as c:
        store(c, ks, datas)
        wait_for(lambda: all(os.path.exists(f) for f in files(root, ks)), "the write-through")
    return ks, datas


def test_restarted_server_serves_its_nvme_chunks(tmp_path, sock_path):
    root = tmp_path / "nvme"
    server = configured(tmp_path, sock_path, nvme_path=root, nvme_capacity="8MiB")
    ks, datas = stored_on_nvme(server, root, 3)
    server.kill()
    server.start()
    stranger = keys(1, b"other")
    with server.client() as c:
        assert c.stats().chunks == 0  # a new arena
        assert c.lookup(ks + stranger) == 3
        assert c.lookup(stranger + ks) == 0
        assert loaded(c, ks + stranger, [*sizes(datas), 4096]) == [*datas, None]
        stats = c.stats()
        assert (stats.chunks, stats.leases) == (3, 3)
        assert loaded(c, ks, [0] * 3) == datas  # now arena hits (of whatever size)
    with server.client() as c:
        assert c.stats().leases == 0  # the promoted leases went with their connection
    server.output()


def test_corrupt_nvme_file_is_a_counted_miss(tmp_path, sock_path):
    from .test_ops import free_port, scrape

    root = tmp_path / "nvme"
    port = free_port()
    server = configured(tmp_path, sock_path, nvme_path=root, nvme_capacity="8MiB", cache_metrics_port=port)
    ks, datas = stored_on_nvme(server, root, 2)
    server.kill()
    bad = files(root, ks)[1]
    with open(bad, "r+b") as f:  # flip one payload byte
        f.seek(os.path.getsize(bad) - 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    server.start()
    with server.client() as c:
        assert loaded(c, ks, sizes(datas)) == [datas[0], None]
        assert not os.path.exists(bad)  # a corrupt file is deleted
        assert c.lookup(ks) == 1
    lower = {labels[0][1]: v for (name, labels), v in scrape(port).items()
             if name == "kvlayer_cache_server_lower_events_total"}
    assert lower["nvme_checksum_errors"] == 1 and lower["promoted"] == 1 and lower["promote_misses"] == 1, lower
    assert "checksum_errors" in server.output()


def test_redis_serves_what_the_nvme_lost(tmp_path, sock_path):
    root = tmp_path / "nvme"
    with RedisServer() as redis:
        server = configured(tmp_path, sock_path, nvme_path=root, nvme_capacity="8MiB", redis_url=redis.url)
        ks, datas = keys(2), payloads(2)
        import redis as redis_py

        r = redis_py.Redis.from_url(redis.url)
        names = [f"kvlayer:{{{k.digest.hex()}}}" for k in ks]
        with server.client() as c:
            store(c, ks, datas)
            wait_for(lambda: all(os.path.exists(f) for f in files(root, ks)) and r.exists(*names) == 2,
                     "the write-through")
        server.kill()
        os.unlink(files(root, ks)[0])
        server.start()
        with server.client() as c:
            assert c.lookup(ks) == 2  # the first in Redis, the second on NVMe
            assert loaded(c, ks, sizes(datas)) == datas
        r.close()
        server.output()


def test_dead_redis_and_full_nvme_keep_serving(tmp_path, sock_path):
    root = tmp_path / "nvme"
    with RedisServer() as redis:
        # 5000 bytes of files hold the 4096-byte chunk, not the 6000-byte one
        server = configured(tmp_path, sock_path, nvme_path=root, nvme_capacity=5000, redis_url=redis.url,
                            tier_timeout_ms=300)
        redis.kill()
        ks, datas = keys(2), payloads(2)
        with server.client() as c:
            store(c, ks, datas)
            wait_for(lambda: os.path.exists(files(root, ks)[0]), "the write-through")
            assert loaded(c, ks, sizes(datas)) == datas  # arena hits
            assert c.release([k.digest for k in ks] * 2) == 4
        server.kill()
        server.start()
        with server.client() as c:
            t0 = time.monotonic()
            assert c.lookup(ks) == 1
            assert loaded(c, ks, sizes(datas)) == [datas[0], None]
            assert c.lookup(keys(1, b"other")) == 0
            assert time.monotonic() - t0 < 3
            store(c, keys(1, b"new"), payloads(1))  # and stores still land in the arena
        out = server.output()
        assert "redis failed" in out


def test_a_redis_cluster_below_the_server_serves_a_restarted_server(tmp_path, sock_path):
    """``redis_cluster: true``: the server writes each chunk through to a 3-node Redis Cluster (the
    keys land on the cluster's nodes) and a restarted server, its arena empty and no NVMe tier,
    promotes them back, byte for byte."""
    from redis.cluster import RedisCluster

    from ..redis_server import RedisClusterNodes

    with RedisClusterNodes() as cluster:
        server = configured(tmp_path, sock_path, redis_url=cluster.url, redis_cluster="true")
        ks, datas = keys(4, b"cluster"), payloads(4)
        names = [f"kvlayer:{{{k.digest.hex()}}}" for k in ks]
        r = RedisCluster.from_url(cluster.url)
        try:
            with server.client() as c:
                store(c, ks, datas)
                wait_for(lambda: sum(r.exists(n) for n in names) == len(ks), "the write-through")
            slots = {r.keyslot(n) for n in names}
            nodes = {r.get_node_from_key(n).port for n in names}
            assert len(slots) == len(ks) and len(nodes) > 1, "the chunks spread over the cluster's nodes"
            server.kill()
            server.start()
            with server.client() as c:
                assert c.stats().chunks == 0 and c.lookup(ks) == len(ks)
                got = loaded(c, ks, sizes(datas))
            assert got == datas, server.output()[-3000:]
        finally:
            r.close()
        server.output()
