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
def kv():
    with KVCacheEngine({"chunk_size": 8, "cpu_capacity": "1MiB"}, LAYOUT, model_name="m",
                       model_fingerprint="f") as eng:
        yield eng


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as ex:
        yield ex


def save(kv: KVCacheEngine, tokens: list[int], src: list[torch.Tensor], slots: torch.Tensor,
         rid: str = "r", failed: dict[str, int] | None = None) -> int:
    job = SaveJob(kv.tiers, kv.chunk_staging, [SaveItem(rid, tuple(kv.keys(tokens)), slots)])
    staged = len(job)
    for layer, cache in reversed(list(enumerate(src))):  # any order
        job.layer(layer, cache)
    job.finish(failed)
    return staged


def item(kv: KVCacheEngine, rid: str, keys: list, slots: torch.Tensor, start: int, end: int) -> LoadItem:
    """A load of tokens ``[start, end)``, its sources from a lookup now (as the scheduler's)."""
    return LoadItem(rid, tuple(keys), kv.tiers.lookup(keys).sources, slots, start, end)


def load(kv: KVCacheEngine, dst: list[torch.Tensor], items: list[LoadItem], executor=None) -> LoadJob:
    return LoadJob(kv.tiers, kv.chunk_staging, kv.groups, dst, items, executor)


def test_save_then_load_layer_by_layer(kv, executor):
    tokens = list(range(40))  # 5 chunks of 8
    src, src_slots = caches(), slots_for(40, 1)
    assert save(kv, tokens, src, src_slots) == 5
    assert kv.lookup(tokens).num_tokens == 40
    assert save(kv, tokens, src, src_slots) == 0, "held chunks are not staged again"
    dst, dst_slots = caches(fill=False), slots_for(40, 2)
    job = load(kv, dst, [item(kv, "r", kv.keys(tokens), dst_slots, 4, 37)], executor)
    for layer in range(LAYOUT.num_layers):
        job.wait_layer(layer)
    assert job.failures() == {}
    assert torch.equal(kv_at(dst, dst_slots[4:37]), kv_at(src, src_slots[4:37]))
    assert not kv_at(dst, dst_slots[:4]).any() and not kv_at(dst, dst_slots[37:]).any()


def test_layer_zero_is_ready_while_later_layers_are_still_copied(kv, executor, monkeypatch):
    tokens = list(range(16))
    src, slots = caches(), slots_for(16, 3)
    save(kv, tokens, src, slots)
    dst = caches(fill=False)
    gate = threading.Event()
    real = pipeline.CopyPlan.scatter_layer

    def slow_last_layer(plan, layer, cache):
        if cache is dst[-1]:
            assert gate.wait(10), "the test never opened the gate"
        real(plan, layer, cache)

    monkeypatch.setattr(pipeline.CopyPlan, "scatter_layer", slow_last_layer)
    job = load(kv, dst, [item(kv, "r", kv.keys(tokens), slots, 0, 16)], executor)
    job.wait_layer(0)  # returns although the last layer is held back
    assert torch.equal(kv_at(dst[:1], slots), kv_at(src[:1], slots))
    assert not dst[-1].any()
    gate.set()
    job.wait_layer(LAYOUT.num_layers - 1)
    assert job.failures() == {}
    assert torch.equal(kv_at(dst, slots), kv_at(src, slots))


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_missing_chunk_is_a_failure_with_the_valid_prefix(kv, executor, layerwise):
    tokens = list(range(32))
    src, slots = caches(), slots_for(32, 4)
    save(kv, tokens, src, slots)
    keys = kv.keys(tokens)
    items = [item(kv, "a", keys, slots, 0, 32), item(kv, "b", keys[:2], slots, 8, 16)]
    assert kv.remove([keys[2]]) == 1  # chunk 2 of 4 is gone after the lookup
    dst = caches(fill=False)
    job = load(kv, dst, items, executor if layerwise else None)
    for layer in range(LAYOUT.num_layers):
        job.wait_layer(layer)
    assert job.failures() == {"a": 16}, "b wanted only what is held"
    assert torch.equal(kv_at(dst, slots[:16]), kv_at(src, slots[:16]))
    assert not kv_at(dst, slots[16:]).any(), "nothing after the missing chunk is written"


def test_a_failing_read_fails_every_load_and_releases_the_waiters(kv, executor, monkeypatch):
    def boom(*args):
        raise RuntimeError("injected")

    tokens = list(range(16))
    assert save(kv, tokens, caches(), slots_for(16, 4)) == 2  # held: only the failure stops the load
    monkeypatch.setattr(pipeline.ChunkReads, "open", boom)
    dst, slots = caches(fill=False), slots_for(16, 5)
    job = load(kv, dst, [item(kv, "r", kv.keys(tokens), slots, 8, 16)], executor)
    for layer in range(LAYOUT.num_layers):
        job.wait_layer(layer)
    assert job.failures() == {"r": 8}
    assert not any(c.any() for c in dst)


def test_finish_drops_the_chunks_a_failed_load_left_unwritten(kv):
    tokens = list(range(32))
    src, slots = caches(), slots_for(32, 6)
    assert save(kv, tokens, src, slots, rid="r", failed={"r": 16}) == 4
    assert kv.lookup(tokens).num_tokens == 16, "chunks after the failed load's valid tokens are not stored"
    assert kv.staging.used_count == 0
    assert save(kv, tokens, src, slots) == 2


def test_staging_is_returned_after_every_job(kv, executor):
    tokens = list(range(24))
    src, slots = caches(), slots_for(24, 7)
    save(kv, tokens, src, slots)
    job = load(kv, caches(fill=False), [item(kv, "r", kv.keys(tokens), slots, 0, 24)], executor)
    assert job.failures() == {}
    kv.flush()
    assert kv.staging.used_count == 0


def test_a_save_stages_only_what_the_tiers_lack_for_each_request(kv):
    a, b = list(range(24)), list(range(500, 516))
    kv.store(a[:16], caches(), slots_for(16, 11))  # the first 2 of a's 3 chunks are held
    src, slots = caches(), slots_for(24, 12)
    cpu = kv.tiers.guarded[0].backend.arena
    held = cpu.used_count
    job = SaveJob(kv.tiers, kv.chunk_staging, [SaveItem("a", tuple(kv.keys(a)), slots),
                                               SaveItem("b", tuple(kv.keys(b)), slots[:16])])
    assert len(job) == 1 + 2
    assert (cpu.used_count, kv.staging.used_count) == (held + 3, 0), "gathered into the cpu tier's own memory"
    for layer, cache in enumerate(src):
        job.layer(layer, cache)
    job.finish()
    assert (cpu.used_count, kv.staging.used_count) == (held + 3, 0), "the tier adopted them: no second copy"
    assert (kv.lookup(a).num_tokens, kv.lookup(b).num_tokens) == (24, 16)
    out = caches(fill=False)
    assert kv.retrieve(b, out, slots_for(16, 13)) == 16
    assert torch.equal(kv_at(out, slots_for(16, 13)), kv_at(src, slots[:16]))


@pytest.mark.parametrize("cpu_capacity", [0, 2 * LAYOUT.chunk_bytes(8)])
def test_a_save_stages_what_the_top_tier_cannot_take(cpu_capacity, tmp_path):
    """No cpu tier (nvme only), or a cpu tier of 2 chunks whose both are in use by a load: the
    save's chunks go through staging, and the tiers still get every one of them."""
    config = {"chunk_size": 8, "cpu_capacity": cpu_capacity, "nvme_path": str(tmp_path), "nvme_capacity": "1MiB"}
    with KVCacheEngine(config, LAYOUT, model_name="m", model_fingerprint="f") as kv:
        busy = []
        if cpu_capacity:
            kv.store(list(range(16)), caches(), slots_for(16, 14))
            busy = [o for o in kv.tiers.run(kv.tiers.guarded[0].get_many(kv.keys(list(range(16)))), "t", [])]
            assert len(busy) == 2 and all(busy), "both cpu slots referenced: none can be evicted"
        tokens, src, slots = list(range(100, 124)), caches(), slots_for(24, 15)
        job = SaveJob(kv.tiers, kv.chunk_staging, [SaveItem("r", tuple(kv.keys(tokens)), slots)])
        assert (len(job), kv.staging.used_count) == (3, 3)
        for layer, cache in enumerate(src):
            job.layer(layer, cache)
        job.finish()
        kv.flush()
        for obj in busy:
            obj.release()
        assert kv.staging.used_count == 0
        out = caches(fill=False)
        assert kv.retrieve(tokens, out, slots_for(24, 16)) == 24
        assert torch.equal(kv_at(out, slots_for(24, 16)), kv_at(src, slots))


def test_opaque_blocks_round_trip_whole_blocks(tmp_path):
    """A ``blocks:`` layout: chunks hold the engine's blocks as bytes; a store reads blocks at
    their ids, a retrieve (also from NVMe, and of a part starting on a block) writes them whole."""
    import dataclasses

    lay = dataclasses.replace(LAYOUT, block_size=4, cache_layout="blocks:test")
    shape = (12, lay.num_kv_heads, lay.block_size, 2 * lay.head_dim)  # vLLM's CPU shape, 12 blocks
    src = [torch.randn(shape) for _ in range(lay.num_layers)]
    config = {"chunk_size": 8, "cpu_capacity": "1MiB", "nvme_path": str(tmp_path), "nvme_capacity": "1MiB"}
    with KVCacheEngine(config, lay, model_name="m", model_fingerprint="f") as kv:
        tokens, ids = list(range(24)), torch.tensor([3, 9, 1, 0, 5, 11])  # 3 chunks of 2 blocks
        assert kv.store(tokens, [lay.paged_view(c) for c in src], ids) == 3
        kv.flush()
        kv.tiers.run(kv.tiers.guarded[0].backend.remove(kv.keys(tokens)), "t", 0)  # now only on NVMe
        dst = [torch.zeros(shape) for _ in range(lay.num_layers)]
        back = torch.tensor([2, 4, 6, 8, 10, 7])
        assert kv.retrieve(tokens, [lay.paged_view(c) for c in dst], back, start=8) == 24
        for s, d in zip(src, dst):
            assert torch.equal(d[back[2:]], s[ids[2:]]), "every block after the start, whole"
            assert not d[back[:2]].any(), "the blocks before start are the engine's own"


@pytest.mark.parametrize("beside_compute", [True, False])
def test_a_whole_cpu_load_reads_each_file_whole(beside_compute, executor, tmp_path, monkeypatch):
    """Layer groups are read one at a time only where a layer is used as soon as it is in (a load
    beside compute); a load nobody waits on per layer reads each NVMe file in one range."""
    from kvlayer.backends.nvme import NvmeBackend

    seen = []
    real = NvmeBackend.read_layers

    async def spy(self, keys, outs, groups, on_group):
        seen.append(list(groups))
        return await real(self, keys, outs, groups, on_group)

    monkeypatch.setattr(NvmeBackend, "read_layers", spy)
    config = {"chunk_size": 8, "cpu_capacity": 0, "nvme_path": str(tmp_path), "nvme_capacity": "1MiB"}
    with KVCacheEngine(config, LAYOUT, model_name="m", model_fingerprint="f") as kv:
        tokens, src, slots = list(range(24)), caches(), slots_for(24, 21)
        kv.store(tokens, src, slots)
        kv.flush()
        dst = caches(fill=False)
        groups = [(0, 1), (1, 3)]
        job = LoadJob(kv.tiers, kv.chunk_staging, groups, dst, [item(kv, "r", kv.keys(tokens), slots, 0, 24)],
                      executor if beside_compute else None)
        assert job.failures() == {}
        assert torch.equal(kv_at(dst, slots), kv_at(src, slots))
    assert seen == [groups if beside_compute else [(0, LAYOUT.num_layers)]]
