"""Tests of kvlayer/tier_manager.py over real gpu/cpu tiers (on the CPU) and a fake lower tier.

Covers: cross-tier prefix lookup, retrieval (``kvlayer.read_plan``) with promotion, background write-through,
failing and hanging tiers (misses and counters, no exception, bounded blocking), the
unhealthy/backoff/recovery cycle, pin/unpin/remove, and that every reference is released.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from kvlayer import tier_admin
from kvlayer.backends.cpu import CpuBackend
from kvlayer.backends.gpu import GpuBackend
from kvlayer.io_loop import IOLoop
from kvlayer.keys import ChunkKey
from kvlayer.memory import Arena, MemoryObj
from kvlayer.metrics import Metrics
from kvlayer.read_plan import ChunkReads, ReadPlan
from kvlayer.registry import build_backends
from kvlayer.staging import Staging
from kvlayer.storage import StorageBackend
from kvlayer.tier_manager import LookupResult, TierManager
from tests.fakes import CHUNK, CHUNK_BYTES, LAYOUT, FakeBackend, chunk_data, context, make_chunks, make_keys, staging

DEADLINE_MS = 200


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Setup:
    mgr: TierManager
    loop: IOLoop
    staging: Arena
    metrics: Metrics
    tiers: dict[str, StorageBackend]

    def place(self, tier: str, keys: list[ChunkKey]) -> None:
        """Put chunks for ``keys`` straight into one tier (not through the manager)."""
        chunks = make_chunks(self.staging, keys)
        self.loop.run(self.tiers[tier].put_many(keys, chunks), timeout=5)
        for c in chunks:
            c.release()

    def holds(self, tier: str, keys: list[ChunkKey]) -> list[bool]:
        return [self.loop.run(self.tiers[tier].contains_prefix([k]), timeout=5) == 1 for k in keys]

    def counter(self, tier: str, name: str) -> int:
        return self.metrics.tier(tier).get(name)

    def assert_no_leaks(self) -> None:
        assert self.mgr.flush(5)
        assert self.staging.used_count == 0
        for backend in self.tiers.values():
            if isinstance(backend, CpuBackend | GpuBackend):
                assert backend.arena.used_count == len(backend.keys())
                assert all(e.obj.ref_count == 1 for e in backend._index.values())


def retrieve(s: Setup, keys: list[ChunkKey]) -> list[MemoryObj]:
    """The verified prefix of ``keys``, looked up then read (one reference each, the caller's)."""
    found = s.mgr.lookup(keys, record=False)
    plan = ReadPlan(tuple(keys[: found.num_chunks]), found.sources)
    reads = ChunkReads.open(s.mgr, [plan], Staging(s.staging, LAYOUT, s.metrics), [(0, LAYOUT.num_layers)])
    n = reads.finish()[0]
    objs = [o.ref() for o in reads.objs[0][:n]]
    reads.release()
    return objs


@pytest.fixture
def loop():
    io = IOLoop()
    yield io
    io.close()


@pytest.fixture
def make(loop):
    made: list[TierManager] = []

    def build(gpu: int = 4, cpu: int = 8, fake: dict | None = None, clock=time.monotonic,
              unhealthy_after: int = 3, timeout_ms: int = DEADLINE_MS, backoff_ms: tuple[int, int] = (1000, 30000),
              ) -> Setup:
        stage = staging(64)
        ctx = context(stage, gpu_capacity=gpu * CHUNK_BYTES, cpu_capacity=cpu * CHUNK_BYTES,
                      tier_timeout_ms=timeout_ms, unhealthy_after=unhealthy_after,
                      unhealthy_backoff_ms=backoff_ms[0], unhealthy_backoff_max_ms=backoff_ms[1])
        backends = build_backends(ctx)
        if fake is not None:
            backends.append(FakeBackend(stage, **fake))
        metrics = Metrics("test")
        mgr = TierManager(backends, loop, ctx.config, metrics, clock=clock)
        made.append(mgr)
        return Setup(mgr, loop, stage, metrics, {b.name: b for b in backends})

    yield build
    for mgr in made:
        mgr.close(timeout=5)


def test_lookup_finds_a_prefix_spread_over_tiers(make) -> None:
    s = make(fake={})
    keys = make_keys(5)
    s.place("gpu", [keys[0], keys[4]])
    s.place("fake", [keys[1]])
    s.place("cpu", [keys[2]])
    res = s.mgr.lookup(keys)
    assert res == LookupResult(3, 3 * CHUNK, {"gpu": 1, "cpu": 1, "fake": 1}, (0, 2, 1))  # gpu, fake, cpu
    assert s.mgr.lookup([]) == LookupResult(0, 0, {})
    for tier in ("gpu", "cpu", "fake"):
        assert s.counter(tier, "lookups") == 1
        assert s.counter(tier, "lookup_chunks") == 5
        assert s.counter(tier, "lookup_hit_chunks") == 1
        assert s.counter(tier, "hit_tokens") == 0  # tokens count as hits when served, not when found
    s.mgr.lookup(keys, record=False)
    assert s.counter("gpu", "lookups") == 1
    assert s.counter("gpu", "lookup_chunks") == 5


def test_lookup_attributes_chunks_to_the_topmost_tier(make) -> None:
    s = make(fake={})
    keys = make_keys(4)
    s.place("fake", keys)
    s.place("gpu", keys[:1])
    s.place("cpu", keys[:2])
    assert s.mgr.lookup(keys).per_tier == {"gpu": 1, "cpu": 1, "fake": 2}


def test_lookup_skips_lower_tiers_when_memory_holds_everything(make) -> None:
    s = make(fake={})
    keys = make_keys(3)
    s.place("gpu", keys)
    assert s.mgr.lookup(keys).num_chunks == 3
    assert s.tiers["fake"].calls["contains_prefix"] == 0


def test_retrieve_is_exact_and_promotes_into_upper_tiers(make) -> None:
    s = make(fake={})
    keys = make_keys(4)
    s.place("gpu", keys[:1])
    s.place("fake", keys[1:2])
    s.place("cpu", keys[2:3])
    objs = retrieve(s, keys)
    assert len(objs) == 3
    for key, obj in zip(keys, objs):
        assert torch.equal(obj.tensor, chunk_data(key))
        obj.release()
    assert s.mgr.flush(5)
    assert s.holds("gpu", keys) == [True, True, True, False]
    assert s.holds("cpu", keys) == [False, True, True, False]
    assert s.counter("gpu", "promotions") == 2 and s.counter("cpu", "promotions") == 1
    assert s.counter("fake", "get_chunks") == 1 and s.counter("fake", "get_bytes") == CHUNK_BYTES
    assert [s.counter(t, "hit_tokens") for t in ("gpu", "fake", "cpu")] == [CHUNK, CHUNK, CHUNK]
    assert s.metrics.snapshot()["fake"]["get_seconds"]["count"] == 1
    s.assert_no_leaks()


def test_promotions_a_tier_declines_are_not_counted_as_puts(make, monkeypatch) -> None:
    s = make(fake={})
    keys = make_keys(3)
    s.place("fake", keys)
    cpu = s.tiers["cpu"]

    async def decline_all(keys: list[ChunkKey], chunks: list[MemoryObj]) -> list[bool]:
        return [False] * len(keys)

    monkeypatch.setattr(cpu, "promote_many", decline_all)
    for obj in retrieve(s, keys):
        obj.release()
    assert s.mgr.flush(5)
    assert s.counter("gpu", "promotions") == 3 and s.counter("gpu", "put_chunks") == 3
    assert s.counter("gpu", "put_bytes") == 3 * CHUNK_BYTES
    assert s.counter("cpu", "promotions") == 0 and s.counter("cpu", "put_chunks") == 0
    assert s.counter("cpu", "put_bytes") == 0
    s.assert_no_leaks()


def test_retrieve_stops_at_the_first_gap(make) -> None:
    s = make(fake={})
    keys = make_keys(4)
    s.place("gpu", [keys[0], keys[2], keys[3]])
    objs = retrieve(s, keys)
    assert len(objs) == 1
    objs[0].release()
    s.assert_no_leaks()


def test_store_writes_through_in_the_background(make) -> None:
    s = make(fake={}, timeout_ms=5000)
    fake = s.tiers["fake"]
    fake.paused = True
    keys = make_keys(3)
    chunks = make_chunks(s.staging, keys)
    s.mgr.store(keys, chunks)
    for c in chunks:
        c.release()  # the caller may release right away
    assert s.holds("gpu", keys) == [True] * 3
    assert not any(fake.holds(k) for k in keys)  # still being written
    assert not s.mgr.flush(0.05) and s.mgr.stats()["pending_writes"] == 1
    fake.paused = False
    assert s.mgr.flush(5)
    assert s.holds("cpu", keys) == [True] * 3 and s.holds("fake", keys) == [True] * 3
    assert all(torch.equal(s.tiers["fake"].data[k.digest][1], chunk_data(k)) for k in keys)
    assert s.counter("fake", "put_chunks") == 3 and s.counter("fake", "put_bytes") == 3 * CHUNK_BYTES
    puts = s.tiers["fake"].calls["put_many"]
    chunks = make_chunks(s.staging, keys)
    s.mgr.store(keys, chunks)  # already everywhere: skipped below the top tier
    for c in chunks:
        c.release()
    assert s.mgr.flush(5) and s.tiers["fake"].calls["put_many"] == puts
    s.assert_no_leaks()


def test_store_without_a_memory_tier_is_all_background(make) -> None:
    s = make(gpu=0, cpu=0, fake={}, timeout_ms=5000)
    s.tiers["fake"].paused = True
    keys = make_keys(2)
    chunks = make_chunks(s.staging, keys)
    s.mgr.store(keys, chunks)
    for c in chunks:
        c.release()
    assert not s.mgr.flush(0.05)
    s.tiers["fake"].paused = False
    assert s.mgr.flush(5) and s.holds("fake", keys) == [True, True]
    objs = retrieve(s, keys)
    assert [torch.equal(o.tensor, chunk_data(k)) for o, k in zip(objs, keys)] == [True, True]
    for o in objs:
        o.release()
    s.assert_no_leaks()


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_a_failing_tier_gives_misses_and_counters(make, fault: str, caplog) -> None:
    s = make(fake={"fault": fault}, unhealthy_after=100)
    keys = make_keys(4)
    s.place("gpu", keys[:1])
    s.place("cpu", keys[2:3])
    s.tiers["fake"].fault = None
    s.place("fake", keys[1:2])  # chunk 1 only in the failing tier: the prefix ends there
    s.tiers["fake"].fault = fault
    bound = 2 * DEADLINE_MS / 1000 + 0.3
    start = time.monotonic()
    assert s.mgr.lookup(keys).num_chunks == 1
    objs = retrieve(s, keys)
    assert len(objs) == 1
    objs[0].release()
    fresh = make_keys(2, seed=1)
    chunks = make_chunks(s.staging, fresh)
    s.mgr.store(fresh, chunks)
    for c in chunks:
        c.release()
    assert time.monotonic() - start < 3 * bound
    assert s.mgr.flush(bound)
    counter = "errors" if fault == "raise" else "timeouts"
    assert s.counter("fake", counter) == 3  # lookup, retrieve, write-through
    assert len([r for r in caplog.records if "tier fake" in r.getMessage()]) == 1  # logged once
    assert s.counter("gpu", "errors") == s.counter("gpu", "timeouts") == 0
    assert s.holds("cpu", fresh) == [True, True]
    s.assert_no_leaks()


def test_a_hanging_top_tier_does_not_block_store_past_the_deadline(make) -> None:
    s = make(gpu=0, fake={"name": "hot", "rank": -1, "in_memory": True, "fault": "hang"})
    keys = make_keys(2)
    chunks = make_chunks(s.staging, keys)
    start = time.monotonic()
    s.mgr.store(keys, chunks)
    assert time.monotonic() - start < DEADLINE_MS / 1000 + 0.5
    for c in chunks:
        c.release()
    assert s.mgr.flush(5) and s.holds("cpu", keys) == [True, True]
    assert s.counter("hot", "timeouts") == 1
    s.assert_no_leaks()


def test_unhealthy_tier_is_skipped_then_probed_with_backoff_and_recovers(make) -> None:
    clock = FakeClock()
    s = make(fake={"fault": "raise"}, clock=clock, unhealthy_after=2)
    fake = s.tiers["fake"]
    keys = make_keys(2)
    for _ in range(2):
        s.mgr.lookup(keys)
    assert fake.calls["contains_prefix"] == 2
    assert not s.mgr.stats()["tiers"]["fake"]["health"]["healthy"]
    s.mgr.lookup(keys)
    assert fake.calls["contains_prefix"] == 2 and s.counter("fake", "skipped_unhealthy") == 1
    clock.now += 1.0
    s.mgr.lookup(keys)  # the probe fails: the backoff doubles to 2 s
    assert fake.calls["contains_prefix"] == 3
    clock.now += 1.0
    s.mgr.lookup(keys)
    assert fake.calls["contains_prefix"] == 3
    clock.now += 1.0
    fake.fault = None
    s.place("fake", keys)
    assert s.mgr.lookup(keys).num_chunks == 2  # the probe succeeds
    assert s.mgr.stats()["tiers"]["fake"]["health"]["healthy"]
    assert s.mgr.lookup(keys).num_chunks == 2


def test_the_backoff_is_configurable(make) -> None:
    clock = FakeClock()
    s = make(fake={"fault": "raise"}, clock=clock, unhealthy_after=1, backoff_ms=(200, 300))
    fake = s.tiers["fake"]
    keys = make_keys(1)
    s.mgr.lookup(keys)  # fails: unhealthy, first probe after 0.2 s
    for step, probes in [(0.1, 1), (0.1, 2), (0.2, 2), (0.1, 3), (0.3, 4), (0.3, 5)]:  # 0.2, 0.3 (capped), 0.3
        clock.now += step
        s.mgr.lookup(keys)
        assert fake.calls["contains_prefix"] == probes, (step, probes)
    assert s.mgr.stats()["tiers"]["fake"]["health"]["backoff_s"] == pytest.approx(0.3)


def test_pin_unpin_remove(make) -> None:
    s = make(fake={})
    keys = make_keys(2)
    s.place("gpu", keys)
    s.place("fake", keys)
    assert tier_admin.pin(s.mgr, keys, tier="gpu") == 2
    assert tier_admin.remove(s.mgr, keys) == 2  # the fake's two; the gpu's are pinned
    assert s.holds("gpu", keys) == [True, True] and s.holds("fake", keys) == [False, False]
    assert tier_admin.unpin(s.mgr, keys) == 2 and tier_admin.remove(s.mgr, keys, tier="gpu") == 2
    with pytest.raises(ValueError, match="unknown tier"):
        tier_admin.pin(s.mgr, keys, tier="tape")


def test_backend_counters_reach_the_metrics(make) -> None:
    s = make(fake={})
    s.tiers["fake"].checksum_errors = 2  # the backend found two corrupt chunks
    assert s.mgr.lookup(make_keys(1)).num_chunks == 0
    assert s.counter("fake", "checksum_errors") == 2
    s.mgr.stats()
    assert s.counter("fake", "checksum_errors") == 2  # mirrored once, not again


def test_evictions_and_usage_reach_stats(make) -> None:
    s = make(gpu=2, cpu=8)
    for seed in range(4):
        keys = make_keys(1, seed=seed)
        chunks = make_chunks(s.staging, keys)
        s.mgr.store(keys, chunks)
        chunks[0].release()
    assert s.mgr.flush(5)
    stats = s.mgr.stats()
    assert stats["tiers"]["gpu"]["evictions"] == 2
    assert stats["tiers"]["gpu"]["used_bytes"] == 2 * CHUNK_BYTES
    assert stats["tiers"]["cpu"]["used_bytes"] == 4 * CHUNK_BYTES
    assert stats["pending_writes"] == 0
    assert s.metrics.snapshot()["gpu"]["gauges"]["capacity_bytes"] == 2 * CHUNK_BYTES
    s.assert_no_leaks()


def test_close_closes_backends_and_refuses_calls(make) -> None:
    s = make(fake={})
    s.mgr.close()
    s.mgr.close()
    assert s.tiers["fake"].closed and s.tiers["gpu"].keys() == []
    with pytest.raises(RuntimeError, match="closed"):
        s.mgr.lookup(make_keys(1))


def test_mismatched_store_and_duplicate_tiers_raise(make, loop) -> None:
    s = make()
    with pytest.raises(ValueError, match="2 keys but 0 chunks"):
        s.mgr.store(make_keys(2), [])
    gpu = s.tiers["gpu"]
    with pytest.raises(ValueError, match="distinct"):
        TierManager([gpu, gpu], loop, context(), Metrics())
