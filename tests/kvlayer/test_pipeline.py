"""``kvlayer.pipeline``: layer-by-layer loads and saves between kvlayer and paged caches."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kvlayer.pipeline as pipeline
from kvlayer import KVCacheEngine
from kvlayer.pipeline import LoadItem, LoadJob, SaveItem, SaveJob
from tests.kvlayer.test_cache_engine import LAYOUT, caches, kv_at, slots_for


@pytest.fixture
def engine():
    with KVCacheEngine({"chunk_size": 8, "cpu_capacity": "1MiB"}, LAYOUT, model_name="m",
                       model_fingerprint="f") as eng:
        yield eng


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as ex:
        yield ex


def save(engine: KVCacheEngine, tokens: list[int], src: list[torch.Tensor], slots: torch.Tensor,
         rid: str = "r", failed: dict[str, int] | None = None) -> int:
    job = SaveJob(engine, [SaveItem(rid, tuple(engine.keys(tokens)), slots)])
    staged = len(job)
    for layer, cache in reversed(list(enumerate(src))):  # any order
        job.layer(layer, cache)
    job.finish(failed)
    return staged


def test_save_then_load_layer_by_layer(engine, executor):
    tokens = list(range(40))  # 5 chunks of 8
    src, src_slots = caches(), slots_for(40, 1)
    assert save(engine, tokens, src, src_slots) == 5
    assert engine.lookup(tokens) == 40
    assert save(engine, tokens, src, src_slots) == 0, "held chunks are not staged again"
    dst, dst_slots = caches(fill=False), slots_for(40, 2)
    job = LoadJob(engine, dst, [LoadItem("r", tuple(engine.keys(tokens)), dst_slots, 4, 37)], executor)
    for layer in range(LAYOUT.num_layers):
        job.wait_layer(layer)
    assert job.failures() == {}
    assert torch.equal(kv_at(dst, dst_slots[4:37]), kv_at(src, src_slots[4:37]))
    assert not kv_at(dst, dst_slots[:4]).any() and not kv_at(dst, dst_slots[37:]).any()


def test_layer_zero_is_ready_while_later_layers_are_still_copied(engine, executor, monkeypatch):
    tokens = list(range(16))
    src, slots = caches(), slots_for(16, 3)
    save(engine, tokens, src, slots)
    dst = caches(fill=False)
    gate = threading.Event()
    real = pipeline.scatter_layer

    def slow_last_layer(chunk, cache, s):
        if cache is dst[-1]:
            assert gate.wait(10), "the test never opened the gate"
        real(chunk, cache, s)

    monkeypatch.setattr(pipeline, "scatter_layer", slow_last_layer)
    job = LoadJob(engine, dst, [LoadItem("r", tuple(engine.keys(tokens)), slots, 0, 16)], executor)
    job.wait_layer(0)  # returns although the last layer is held back
    assert torch.equal(kv_at(dst[:1], slots), kv_at(src[:1], slots))
    assert not dst[-1].any()
    gate.set()
    job.wait_layer(LAYOUT.num_layers - 1)
    assert job.failures() == {}
    assert torch.equal(kv_at(dst, slots), kv_at(src, slots))


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_missing_chunk_is_a_failure_with_the_valid_prefix(engine, executor, layerwise):
    tokens = list(range(32))
    src, slots = caches(), slots_for(32, 4)
    save(engine, tokens, src, slots)
    keys = engine.keys(tokens)
    assert engine.tiers.remove([keys[2]]) == 1  # chunk 2 of 4 is gone
    dst = caches(fill=False)
    items = [LoadItem("a", tuple(keys), slots, 0, 32), LoadItem("b", tuple(keys[:2]), slots, 8, 16)]
    job = LoadJob(engine, dst, items, executor if layerwise else None)
    for layer in range(LAYOUT.num_layers):
        job.wait_layer(layer)
    assert job.failures() == {"a": 16}, "b wanted only what is held"
    assert torch.equal(kv_at(dst, slots[:16]), kv_at(src, slots[:16]))
    assert not kv_at(dst, slots[16:]).any(), "nothing after the missing chunk is written"


def test_a_failing_fetch_fails_every_load_and_releases_the_waiters(engine, executor, monkeypatch):
    def boom(requests):
        raise RuntimeError("injected")

    tokens = list(range(16))
    assert save(engine, tokens, caches(), slots_for(16, 4)) == 2  # held: only the failure stops the load
    monkeypatch.setattr(engine, "fetch_layers", boom)
    dst, slots = caches(fill=False), slots_for(16, 5)
    job = LoadJob(engine, dst, [LoadItem("r", tuple(engine.keys(tokens)), slots, 8, 16)], executor)
    for layer in range(LAYOUT.num_layers):
        job.wait_layer(layer)
    assert job.failures() == {"r": 8}
    assert not any(c.any() for c in dst)


def test_finish_drops_the_chunks_a_failed_load_left_unwritten(engine):
    tokens = list(range(32))
    src, slots = caches(), slots_for(32, 6)
    assert save(engine, tokens, src, slots, rid="r", failed={"r": 16}) == 4
    assert engine.lookup(tokens) == 16, "chunks after the failed load's valid tokens are not stored"
    assert engine.staging.used_count == 0
    assert save(engine, tokens, src, slots) == 2


def test_staging_is_returned_after_every_job(engine, executor):
    tokens = list(range(24))
    src, slots = caches(), slots_for(24, 7)
    save(engine, tokens, src, slots)
    job = LoadJob(engine, caches(fill=False), [LoadItem("r", tuple(engine.keys(tokens)), slots, 0, 24)], executor)
    assert job.failures() == {}
    engine.flush()
    assert engine.staging.used_count == 0
