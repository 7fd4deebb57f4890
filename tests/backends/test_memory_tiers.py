"""Tests of the in-memory tiers (backends/memory_tier.py through cpu.py and gpu.py).

Both tiers run on the CPU here (the gpu tier's arena lives on ``ctx.device``); the last test
repeats the round trip on CUDA where it exists.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

from kvlayer.backends.cpu import CpuBackend
from kvlayer.backends.gpu import GpuBackend
from kvlayer.backends.memory_tier import MemoryTier
from kvlayer.keys import ChunkKey
from tests.fakes import CHUNK_BYTES, LAYOUT, chunk_data, context, make_chunk, make_chunks, make_keys, staging

Run = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture
def run():
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture(params=[CpuBackend, GpuBackend], ids=["cpu", "gpu"])
def make_tier(request) -> Callable[[int], MemoryTier]:
    cls = request.param

    def build(num_chunks: int, device: str = "cpu") -> MemoryTier:
        ctx = context(device=device, **{cls.capacity_setting: num_chunks * CHUNK_BYTES})
        tier = cls.create(ctx)
        assert isinstance(tier, cls)
        return tier

    return build


@pytest.fixture
def src():
    """Where test chunks are made before being put (a staging arena)."""
    return staging(256)


class Recorder:
    def __init__(self) -> None:
        self.admitted: list[bytes] = []
        self.evicted: list[bytes] = []

    def on_admit(self, tier: str, digests) -> None:
        self.admitted += digests

    def on_evict(self, tier: str, digests) -> None:
        self.evicted += digests


def put(run: Run, tier: MemoryTier, src, keys: list[ChunkKey]) -> None:
    """Put fresh chunks for ``keys`` and release the caller's references, as a caller would."""
    chunks = make_chunks(src, keys)
    run(tier.put_many(keys, chunks))
    for c in chunks:
        c.release()


def present(run: Run, tier: MemoryTier, keys: list[ChunkKey]) -> list[bool]:
    return [run(tier.contains_prefix([k])) == 1 for k in keys]


def check_index_refs(tier: MemoryTier) -> None:
    """Only the index holds the stored objects; every occupied slot belongs to it."""
    assert tier.arena.used_count == len(tier.keys())
    for entry in tier._index.values():
        assert entry.obj.ref_count == 1


def test_put_get_exact_and_zero_copy(run: Run, make_tier, src) -> None:
    tier = make_tier(8)
    keys = make_keys(5)
    put(run, tier, src, keys)
    assert src.used_count == 0  # the tier copied; the caller's objects are gone
    got = run(tier.get_many(keys))
    for key, obj in zip(keys, got):
        assert obj is not None and obj.ref_count == 2
        assert torch.equal(obj.tensor.cpu(), chunk_data(key))
    again = run(tier.get(keys[0]))
    assert again is got[0]  # the stored object itself
    again.release()
    for obj in got:
        obj.release()
    check_index_refs(tier)
    assert run(tier.contains_prefix(keys)) == 5
    assert tier.usage() == (5 * CHUNK_BYTES, 8 * CHUNK_BYTES)


def test_misses_and_prefix(run: Run, make_tier, src) -> None:
    tier = make_tier(8)
    keys = make_keys(4)
    put(run, tier, src, [keys[0], keys[1], keys[3]])
    assert run(tier.contains_prefix(keys)) == 2
    got = run(tier.get_many(keys))
    assert [g is None for g in got] == [False, False, True, False]
    for g in got:
        if g is not None:
            g.release()


def test_tokens_digest_mismatch_is_a_miss(run: Run, make_tier, src) -> None:
    tier = make_tier(4)
    key = make_keys(1)[0]
    put(run, tier, src, [key])
    forged = dataclasses.replace(key, tokens_digest=bytes(16))
    assert run(tier.get(forged)) is None
    assert run(tier.contains_prefix([forged])) == 0
    assert tier.stats()["tokens_mismatches"] == 2


def test_putting_a_present_key_is_a_no_op(run: Run, make_tier, src) -> None:
    tier = make_tier(4)
    key = make_keys(1)[0]
    put(run, tier, src, [key])
    other = make_chunk(src, make_keys(1, seed=9)[0])
    run(tier.put_many([key], [other]))
    other.release()
    obj = run(tier.get(key))
    assert torch.equal(obj.tensor, chunk_data(key))
    obj.release()
    assert tier.arena.used_count == 1


def test_lru_eviction(run: Run, make_tier, src) -> None:
    tier = make_tier(3)
    a, b, c, d = (make_keys(1, seed=s)[0] for s in range(4))
    for k in (a, b, c):
        put(run, tier, src, [k])
    run(tier.get(a)).release()  # a is now the most recent
    put(run, tier, src, [d])
    assert present(run, tier, [a, b, c, d]) == [True, False, True, True]
    assert tier.stats()["evictions"] == 1


def test_reserved_chunks_are_adopted_without_a_copy(run: Run, make_tier, src) -> None:
    """``reserve`` evicts as a put would and gives host slots; ``put_many`` of them stores those
    very slots (no second one)."""
    tier = make_tier(3)
    a, b, c, d = (make_keys(1, seed=s)[0] for s in range(4))
    for k in (a, b):
        put(run, tier, src, [k])
    got = run(tier.reserve([c, d]))
    assert all(o is not None for o in got) and tier.stats()["evictions"] == 1
    assert present(run, tier, [a, b, c, d]) == [False, True, False, False], "the least recent one went"
    for key, obj in zip([c, d], got):
        obj.tensor.copy_(chunk_data(key))
    run(tier.put_many([c, d], got))
    assert tier.arena.used_count == 3
    for key, obj in zip([c, d], got):
        held = run(tier.get(key))
        assert held is obj and torch.equal(held.tensor, chunk_data(key))
        held.release()
        obj.release()
    check_index_refs(tier)
    full = run(tier.reserve(make_keys(4, seed=20)))
    assert [o is None for o in full] == [False, False, False, True], "stops at what it cannot free"
    for o in full[:3]:
        o.release()


def test_chain_tails_are_evicted_before_heads(run: Run, make_tier, src) -> None:
    tier = make_tier(4)
    chain = make_keys(4)
    put(run, tier, src, chain)
    put(run, tier, src, make_keys(1, seed=1))
    assert present(run, tier, chain) == [True, True, True, False]
    put(run, tier, src, make_keys(1, seed=2))
    assert present(run, tier, chain) == [True, True, False, False]
    # A get touches the chain together too: its tail stays the oldest of it.
    got = run(tier.get_many(chain[:2]))
    for g in got:
        g.release()
    put(run, tier, src, make_keys(3, seed=3))  # evicts the two singles, then the chain's tail
    assert present(run, tier, chain) == [True, False, False, False]


def test_a_batch_larger_than_the_tier_keeps_its_head(run: Run, make_tier, src) -> None:
    tier = make_tier(3)
    keys = make_keys(5)
    put(run, tier, src, keys)  # never evicts its own batch: the head is kept, the tail skipped
    assert run(tier.contains_prefix(keys)) == 3
    assert tier.stats()["skipped_full"] == 2


def test_pinned_chunks_survive_a_workload_ten_times_the_capacity(run: Run, make_tier, src) -> None:
    tier = make_tier(4)
    pinned = make_keys(2, seed=100)
    put(run, tier, src, pinned)
    assert run(tier.pin(pinned)) == 2
    rng = random.Random(0)
    for i in range(40):
        put(run, tier, src, make_keys(rng.randint(1, 3), seed=i))
        used, capacity = tier.usage()
        assert used <= capacity
    assert run(tier.contains_prefix(pinned)) == 2
    for key, obj in zip(pinned, run(tier.get_many(pinned))):
        assert torch.equal(obj.tensor.cpu(), chunk_data(key))
        obj.release()
    assert run(tier.remove(pinned)) == 0  # pinned chunks are not removed either
    assert run(tier.unpin(pinned)) == 2 and run(tier.unpin(pinned)) == 0
    assert run(tier.remove(pinned)) == 2
    check_index_refs(tier)


def test_a_full_tier_of_pinned_chunks_skips_puts(run: Run, make_tier, src) -> None:
    tier = make_tier(2)
    keys = make_keys(2)
    put(run, tier, src, keys)
    run(tier.pin(keys))
    extra = make_keys(1, seed=5)
    put(run, tier, src, extra)  # no room, no exception
    assert run(tier.contains_prefix(extra)) == 0 and tier.stats()["skipped_full"] == 1


def test_chunks_held_by_readers_are_not_evicted(run: Run, make_tier, src) -> None:
    tier = make_tier(2)
    keys = make_keys(2)
    put(run, tier, src, keys)
    held = run(tier.get(keys[0]))
    put(run, tier, src, make_keys(2, seed=7))
    assert present(run, tier, keys) == [True, False]
    held.release()
    put(run, tier, src, make_keys(1, seed=8))
    assert present(run, tier, keys) == [False, False]
    check_index_refs(tier)


def test_removed_chunks_stay_valid_for_their_readers(run: Run, make_tier, src) -> None:
    tier = make_tier(2)
    key = make_keys(1)[0]
    put(run, tier, src, [key])
    held = run(tier.get(key))
    assert run(tier.remove([key])) == 1
    assert tier.usage()[0] == CHUNK_BYTES  # the slot stays in use until the reader releases
    assert torch.equal(held.tensor, chunk_data(key))
    held.release()
    assert tier.usage()[0] == 0 and tier.keys() == []


def test_listener_sees_admits_and_evictions(run: Run, make_tier, src) -> None:
    tier = make_tier(2)
    rec = Recorder()
    tier.set_listener(rec)
    a, b, c = (make_keys(1, seed=s)[0] for s in range(3))
    put(run, tier, src, [a, b])
    put(run, tier, src, [c])
    assert rec.admitted == [a.digest, b.digest, c.digest]
    assert rec.evicted == [a.digest]
    run(tier.remove([b]))
    assert rec.evicted == [a.digest, b.digest]
    run(tier.close())
    assert rec.evicted == [a.digest, b.digest, c.digest]


def test_close_returns_every_slot(run: Run, make_tier, src) -> None:
    tier = make_tier(4)
    keys = make_keys(3)
    put(run, tier, src, keys)
    run(tier.pin(keys[:1]))
    run(tier.close())
    assert tier.arena.used_count == 0 and tier.keys() == []


def test_bad_chunks_and_settings_raise(run: Run, make_tier, src) -> None:
    tier = make_tier(2)
    keys = make_keys(2)
    wrong = src.allocate((1, 2, 4, 2, 4), torch.float32)
    with pytest.raises(ValueError, match="does not fit key"):
        run(tier.put_many(keys[:1], [wrong]))
    with pytest.raises(ValueError, match="1 keys but 2 chunks"):
        run(tier.put_many(keys[:1], [wrong, wrong]))
    wrong.release()
    for cls in (CpuBackend, GpuBackend):
        assert cls.create(context(**{cls.capacity_setting: 0})) is None
        with pytest.raises(ValueError, match=cls.capacity_setting):
            cls.create(context(**{cls.capacity_setting: CHUNK_BYTES - 1}))


def test_partial_chunks_fit_a_slot(run: Run, make_tier, src) -> None:
    tier = make_tier(2)
    full = make_keys(1)[0]
    part = ChunkKey(b"p" * 32, b"t" * 16, 4, 6)
    obj = src.allocate(LAYOUT.chunk_shape(2), LAYOUT.dtype)
    obj.tensor.copy_(chunk_data(part))
    put(run, tier, src, [full])
    run(tier.put_many([part], [obj]))
    obj.release()
    got = run(tier.get(part))
    assert got.num_tokens == 2 and torch.equal(got.tensor, chunk_data(part))
    got.release()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_through_pinned_cpu_and_gpu(run: Run, src) -> None:
    cpu = CpuBackend.create(context(cpu_capacity=8 * CHUNK_BYTES))
    gpu = GpuBackend.create(context(device="cuda", gpu_capacity=8 * CHUNK_BYTES))
    assert cpu.arena.pinned and gpu.arena.device.type == "cuda"
    keys = make_keys(6)
    put(run, cpu, src, keys)
    host = run(cpu.get_many(keys))
    run(gpu.put_many(keys, host))  # pinned host -> device, asynchronous
    for obj in host:
        obj.release()
    back = CpuBackend.create(context(cpu_capacity=8 * CHUNK_BYTES))
    dev = run(gpu.get_many(keys))
    run(back.put_many(keys, dev))  # device -> pinned host, asynchronous
    for key, d, h in zip(keys, dev, run(back.get_many(keys))):
        assert d.tensor.is_cuda and torch.equal(h.tensor, chunk_data(key))
        d.release()
        h.release()


def _ask_and_promote(run: Run, tier: MemoryTier, src, key: ChunkKey) -> bool:
    """One request for ``key`` as the tier manager makes it: ask the tier, and on a miss
    promote the chunk (as if read from a lower tier). Whether the tier served it."""
    got = run(tier.get_many([key]))[0]
    if got is not None:
        got.release()
        return True
    chunk = make_chunk(src, key)
    (stored,) = run(tier.promote_many([key], [chunk]))
    assert stored == present(run, tier, [key])[0]  # it answers whether it took the chunk
    chunk.release()
    return False


def test_promotions_keep_part_of_a_cycle_resident(run: Run, make_tier, src) -> None:
    """Requests cycling over 8 chunks through a 4-chunk tier: plain LRU (put_many) would never
    hit; admission keeps the first 4 and declines the rest, so half the requests hit."""
    tier = make_tier(4)
    keys = make_keys(8, seed=3)
    served = [_ask_and_promote(run, tier, src, k) for _ in range(3) for k in keys]
    assert served[:8] == [False] * 8
    assert served[8:] == [True] * 4 + [False] * 4 + [True] * 4 + [False] * 4
    assert tier.stats()["promotions_declined"] == 12 and tier.stats()["evictions"] == 0
    check_index_refs(tier)


def test_a_popular_chunk_displaces_a_rare_one_and_stores_always_land(run: Run, make_tier, src) -> None:
    tier = make_tier(2)
    cold, hot, new = make_keys(2, seed=4), make_keys(1, seed=5)[0], make_keys(1, seed=6)[0]
    for k in cold:
        _ask_and_promote(run, tier, src, k)  # asked once each: they fill the tier
    assert present(run, tier, cold) == [True, True]
    assert not _ask_and_promote(run, tier, src, hot)  # asked once: no more than the victim, declined
    assert not present(run, tier, [hot])[0]
    assert not _ask_and_promote(run, tier, src, hot)  # asked twice: displaces the least recent cold one
    assert present(run, tier, [hot, cold[1], cold[0]]) == [True, True, False]
    put(run, tier, src, [new])  # a store is admitted whatever the counts
    assert present(run, tier, [new])[0]
    check_index_refs(tier)
