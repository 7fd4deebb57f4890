"""The cache tier connects while the engine is idle (at construction, on the I/O loop) and has its
mapping prepared before the first request; a server that is away at start neither fails nor
delays the engine, and is used once it is up. Real server processes, real sockets."""

from __future__ import annotations

import time

from kvlayer import KVCacheEngine

from . import worker
from .conftest import ServerProcess


def _kv(sock: str, **extra: object) -> KVCacheEngine:
    return KVCacheEngine({**worker.kv_config(sock), **extra}, worker.layout(), model_name="m", model_fingerprint="f")


def _backend(kv: KVCacheEngine) -> dict:
    return kv.stats()["tiers"]["cache"]["backend"]


def _wait_backend(kv: KVCacheEngine, ok, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while not ok(stats := _backend(kv)):
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)
    return stats


def test_an_idle_engine_is_connected_and_mapped_before_any_call(server):
    with _kv(server.socket_path) as kv:
        stats = _wait_backend(kv, lambda s: s["connects"] == 1 and s["mapped"] == 1)  # stats() asks no server
        assert stats["held"] == 0
        server.wait_stats(lambda s: s.connections == 2)  # the engine's link and this probe
        assert kv.store(worker.TOKENS, worker.kv_caches(1), worker.slots(40, 0)) == 5
        dst = worker.kv_caches(None)
        assert kv.retrieve(worker.TOKENS, dst, worker.slots(40, 20)) == 40
        assert worker.rows(dst, worker.slots(40, 20)) == worker.rows(worker.kv_caches(1), worker.slots(40, 0))
        assert _backend(kv)["connects"] == 1  # the link made at start served the calls


def test_a_server_away_at_start_does_not_fail_or_delay_the_engine(sock_path):
    t0 = time.monotonic()
    kv = _kv(sock_path, tier_timeout_ms=500)
    built = time.monotonic() - t0
    try:
        assert built < 1.0, built
        time.sleep(0.2)  # the start-up connect has failed by now
        stats = kv.stats()["tiers"]["cache"]
        assert stats["backend"]["connects"] == 0 and stats["errors"] == 1 and stats["health"]["healthy"]
        server = ServerProcess(sock_path, "4MiB").start()
        try:
            assert kv.store(worker.TOKENS, worker.kv_caches(1), worker.slots(40, 0)) == 5
            kv.flush(10)
            dst = worker.kv_caches(None)
            assert kv.retrieve(worker.TOKENS, dst, worker.slots(40, 20)) == 40  # from the server
            assert worker.rows(dst, worker.slots(40, 20)) == worker.rows(worker.kv_caches(1), worker.slots(40, 0))
            assert kv.stats()["tiers"]["cache"]["backend"]["connects"] == 1
        finally:
            kv.close()
            server.stop()
    finally:
        kv.close()
