"""Async loads (kvlayer/async_loads.py): which tiers load asynchronously, the thread the loads run
on, and ``AsyncLoader`` reading whole loads into random paged caches through a real
``KVCacheEngine`` (CPU tier; no model, no engine)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from kvlayer import KVCacheEngine, KVLayout
from kvlayer.async_loads import AsyncLoader, AsyncLoads, LoadResult, below_memory, lower_tiers
from kvlayer.config import KVLayerConfig
from kvlayer.io_loop import BACKGROUND_NICE, background, blocking_executor
from kvlayer.step import LoadSpec, StepCounts, slots_of
from kvlayer.step_stats import StepStats

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
NUM_BLOCKS = 32
TOKENS = list(range(100, 116))  # 2 full chunks of 8
BLOCKS = (5, 9, 2, 7)  # tokens 0..15


def caches(fill: bool = True) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [LAYOUT.paged_view(torch.randn(shape) if fill else torch.zeros(shape)) for _ in range(LAYOUT.num_layers)]


def kv_at(cs: list[torch.Tensor], blocks: tuple[int, ...]) -> torch.Tensor:
    return torch.stack([c[:, list(blocks)] for c in cs])


@pytest.fixture
def kv():
    with KVCacheEngine({"chunk_size": 8, "cpu_capacity": "1MiB"}, LAYOUT, model_name="m") as eng:
        yield eng


def wait_done(loader: AsyncLoader, finished: set[str] | None = None) -> set[str]:
    deadline = time.monotonic() + 10
    while not (done := loader.finished(finished or set())) and time.monotonic() < deadline:
        time.sleep(0.01)
    return done


def test_lower_tiers_are_the_enabled_tiers_below_memory() -> None:
    assert lower_tiers(KVLayerConfig(cpu_capacity="1MiB", nvme_path="/x", redis_url="redis://h:1")) == {1, 2}
    assert lower_tiers(KVLayerConfig(cpu_capacity=0, nvme_path="/x")) == {0}
    assert lower_tiers(KVLayerConfig(cpu_capacity="1MiB")) == set()
    cache = KVLayerConfig(cache_server="/s.sock", redis_url="redis://h:1")
    assert lower_tiers(cache) == {1}, "the cache server is memory"


def test_a_hit_loads_async_with_a_chunk_below_memory_or_unknown_sources() -> None:
    lower = frozenset({1, 2})
    assert not below_memory((0, 0), lower)
    assert below_memory((0, 1), lower)
    assert below_memory((), lower), "the ranks disagreed on the tiers"


def test_async_loads_report_each_load_once_and_cancel_those_not_started() -> None:
    jobs = AsyncLoads()
    gate = threading.Event()
    jobs.start("a", lambda: (gate.wait(10), ({3}, StepCounts(8, 16)))[1])
    jobs.start("b", lambda: (set(), StepCounts(16, 16)))  # queued behind "a"
    assert jobs.cancel({"b"}) == {"b"} and jobs.pending() == {"a"}
    assert jobs.take_done() == {}, "a running load is not done"
    assert jobs.cancel({"a"}) == set(), "a running load is waited for, never cut short"
    gate.set()
    deadline = time.monotonic() + 10
    while not (done := jobs.take_done()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(done) == ["a"] and done["a"][0] == {3}
    assert jobs.take_done() == {} and jobs.pending() == set()
    jobs.close()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")
def test_the_loads_run_on_a_thread_of_lower_cpu_priority() -> None:
    jobs = AsyncLoads()
    seen: list[tuple[str, int]] = []

    def load() -> LoadResult:
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return set(), StepCounts()

    jobs.start("a", load)
    jobs.close()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen[0][0].startswith("kvlayer-async-load")
    assert seen[0][1] == min(mine + BACKGROUND_NICE, 19)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")
def test_background_io_reads_files_on_lower_priority_threads(tmp_path) -> None:
    """Inside ``background()`` (an async load), the NVMe tier's file reads run on the shared pool of
    lower-priority threads; the bytes are the same; outside it, the loop's default threads."""
    src, dst = caches(), caches(fill=False)
    slots = slots_of(LAYOUT, BLOCKS, 16, torch.device("cpu"))
    cfg = {"chunk_size": 8, "cpu_capacity": 0, "nvme_path": str(tmp_path)}
    with KVCacheEngine(cfg, LAYOUT, model_name="m") as eng:
        assert eng.store(TOKENS, src, slots) == 2 and eng.flush(timeout=10)
        assert blocking_executor() is None
        with background():
            pool = blocking_executor()
            assert pool is not None
            assert eng.retrieve(TOKENS, dst, slots) == 16
            assert any(t.name.startswith("kvlayer-background") for t in threading.enumerate()), "the reads ran there"
            mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            names, nice = pool.submit(lambda: (threading.current_thread().name,
                                               os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))).result()
        assert torch.equal(kv_at(dst, BLOCKS), kv_at(src, BLOCKS))
        assert names.startswith("kvlayer-background") and nice == min(mine + BACKGROUND_NICE, 19)


def test_a_load_is_read_whole_into_its_blocks_counted_and_reported_once(kv) -> None:
    src, dst = caches(), caches(fill=False)
    assert kv.store(TOKENS, src, slots_of(LAYOUT, BLOCKS, 16, kv.device)) == 2
    found = kv.lookup(TOKENS, request_id="a", limit=16)
    assert found.num_tokens == 16
    stats = StepStats()
    loader = AsyncLoader(kv, stats)
    try:
        loader.start([LoadSpec("a", None, tuple(TOKENS), BLOCKS, 0, 16, found.sources)], dst)
        assert wait_done(loader) == {"a"}
        assert torch.equal(kv_at(dst, BLOCKS), kv_at(src, BLOCKS))
        assert loader.take_failed_blocks() == set() and loader.take_failed() == set()
        assert stats.take() == {**dict.fromkeys(stats.totals, 0), "loaded_tokens": 16, "async_loads": 1}
        assert loader.finished(set()) == set(), "reported once"
    finally:
        loader.close()


def test_a_load_of_chunks_gone_reports_its_blocks_and_request_failed(kv) -> None:
    dst = caches(fill=False)
    kv.lookup(TOKENS, request_id="a")  # a miss: nothing stored, the load's sources are stale
    stats = StepStats()
    loader = AsyncLoader(kv, stats)
    try:
        loader.start([LoadSpec("a", None, tuple(TOKENS), BLOCKS, 4, 16, (0, 0))], dst)
        assert wait_done(loader) == {"a"}
        assert loader.take_failed_blocks() == set(BLOCKS[1:]), "the blocks of tokens 4..15"
        assert loader.take_failed() == {"a"}
        assert loader.take_failed_blocks() == set() and loader.take_failed() == set(), "each reported once"
        assert stats.totals["failed_load_tokens"] == 12 and stats.totals["async_loads"] == 1
        assert not torch.stack(dst).any(), "nothing written"
    finally:
        loader.close()


def test_a_finished_requests_queued_load_is_dropped_and_a_running_one_waited_for(kv) -> None:
    src, dst = caches(), caches(fill=False)
    kv.store(TOKENS, src, slots_of(LAYOUT, BLOCKS, 16, kv.device))
    found = kv.lookup(TOKENS, request_id="b", limit=16)
    loader = AsyncLoader(kv, StepStats())
    gate = threading.Event()
    loader._jobs.start("a", lambda: (gate.wait(10), (set(), StepCounts()))[1])  # holds the load thread
    try:
        loader.start([LoadSpec("b", None, tuple(TOKENS), BLOCKS, 0, 16, found.sources)], dst)
        assert loader.finished({"a", "b"}) == {"b"}, "b's load had not started: dropped, reported at once"
        gate.set()
        assert wait_done(loader) == {"a"}, "a's load ran on: reported once it ended"
        assert not torch.stack(dst).any(), "b's load wrote nothing"
        assert loader.take_failed() == set()
    finally:
        loader.close()
