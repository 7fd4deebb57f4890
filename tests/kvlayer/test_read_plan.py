"""``kvlayer.read_plan``: each chunk read from the tier the lookup found it in (no second
presence check), memory tiers' chunks at once, lower tiers' layer group by layer group,
verified prefixes, promotions, failures, and no leaked references."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest
import torch

from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj
from kvlayer.read_plan import ChunkReads, ReadPlan, layer_groups
from kvlayer.staging import Staging
from tests.fakes import LAYOUT, FakeBackend, chunk_data, make_keys
from tests.kvlayer.test_tier_manager import Setup, loop, make  # noqa: F401 - fixtures

GROUPS = [(0, 1), (1, 2)]


class GatedBackend(FakeBackend):
    """Reads group 0 at once, then waits for ``gate`` before each later group; the keys in
    ``corrupt`` fail verification at the end; ``read_fault`` "raise"/"hang" strikes after group 0."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)
        self.gate = asyncio.Event()
        self.corrupt: set[bytes] = set()
        self.read_fault: str | None = None

    async def read_layers(self, keys: Sequence[ChunkKey], outs: Sequence[MemoryObj],
                          groups: Sequence[tuple[int, int]], on_group: Callable[[int], None]) -> list[bool]:
        await self._enter("read_layers")
        for g, (lo, hi) in enumerate(groups):
            if g and self.read_fault == "raise":
                raise OSError("injected failure mid-read")
            if g and self.read_fault == "hang":
                await asyncio.Event().wait()
            if g:
                await self.gate.wait()
            for key, out in zip(keys, outs):
                if key.digest in self.data:
                    out.tensor[lo:hi] = self.data[key.digest][1][lo:hi]
            on_group(g)
        return [k.digest in self.data and k.digest not in self.corrupt for k in keys]


def gated(s: Setup) -> GatedBackend:
    backend = s.tiers["fake"]
    assert isinstance(backend, GatedBackend)
    return backend


@pytest.fixture
def setup(make, monkeypatch) -> Setup:  # noqa: F811
    monkeypatch.setattr("tests.kvlayer.test_tier_manager.FakeBackend", GatedBackend)
    return make(fake={})


def open_plans(s: Setup, plans: Sequence[ReadPlan], staging: Staging | None = None) -> ChunkReads:
    return ChunkReads.open(s.mgr, plans, staging or Staging(s.staging, LAYOUT, s.metrics), GROUPS)


def open_reads(s: Setup, requests: Sequence[Sequence[ChunkKey]], staging: Staging | None = None) -> ChunkReads:
    """Look each key list up, then open the reads of what was found (as ``LoadJob`` does)."""
    plans = []
    for keys, found in zip(requests, s.mgr.lookup_many(requests, record=False)):
        plans.append(ReadPlan(tuple(keys[: found.num_chunks]), found.sources))
    return open_plans(s, plans, staging)


class ScarceStaging(Staging):
    """Staging whose ``allocate`` answers None where ``budget`` says False."""

    def __init__(self, s: Setup, budget: list[bool]) -> None:
        super().__init__(s.staging, LAYOUT, s.metrics)
        self.budget = iter(budget)

    def allocate(self, key: ChunkKey) -> MemoryObj | None:
        return super().allocate(key) if next(self.budget) else None


def test_layer_groups() -> None:
    assert layer_groups(3, 512 << 10) == [(0, 1), (1, 2), (2, 3)]
    assert layer_groups(4, 100, min_bytes=250) == [(0, 3), (3, 4)]
    assert layer_groups(2, 0) == [(0, 2)]
    assert layer_groups(5, 10, min_bytes=1000) == [(0, 5)]


def test_layers_are_usable_as_they_arrive_and_lower_chunks_promoted(setup: Setup) -> None:
    s = setup
    keys = make_keys(3)
    s.place("gpu", keys[:1])
    s.place("fake", keys[1:])
    reads = open_reads(s, [keys, []])
    assert reads.wait_layer(0, timeout=5)
    assert not reads.wait_layer(1, timeout=0.1), "layer 1 is still being read"
    for key, obj in zip(keys, reads.objs[0]):
        assert torch.equal(obj.tensor[0], chunk_data(key)[0])
    s.loop.loop.call_soon_threadsafe(gated(s).gate.set)
    assert reads.wait_layer(1, timeout=5)
    assert reads.finish() == [3, 0]
    for key, obj in zip(keys, reads.objs[0]):
        assert torch.equal(obj.tensor, chunk_data(key))
    reads.release()
    assert s.counter("fake", "hit_tokens") == 2 * keys[0].num_tokens
    assert s.counter("gpu", "hit_tokens") == keys[0].num_tokens
    s.mgr.flush(5)
    assert s.holds("gpu", keys) == [True, True, True]
    s.assert_no_leaks()


def test_a_chunk_failing_verification_ends_the_prefix(setup: Setup) -> None:
    s = setup
    keys = make_keys(4, seed=1)
    s.place("fake", keys)
    gated(s).corrupt.add(keys[2].digest)
    s.loop.loop.call_soon_threadsafe(gated(s).gate.set)
    reads = open_reads(s, [keys])
    assert len(reads.objs[0]) == 4, "every held chunk is a candidate until verified"
    assert reads.finish() == [2]
    reads.release()
    s.mgr.flush(5)
    assert s.holds("cpu", keys) == [True, True, False, False], "only verified chunks are promoted"
    s.assert_no_leaks()


def test_a_missing_chunk_ends_the_candidates(setup: Setup) -> None:
    s = setup
    keys = make_keys(4, seed=2)
    s.place("fake", [keys[0], keys[2], keys[3]])
    s.place("cpu", [keys[3]])
    s.loop.loop.call_soon_threadsafe(gated(s).gate.set)
    reads = open_reads(s, [keys])
    assert len(reads.objs[0]) == 1
    assert reads.finish() == [1]
    reads.release()
    s.assert_no_leaks()


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_a_failing_lower_tier_is_a_miss_and_never_blocks(setup: Setup, fault: str) -> None:
    s = setup
    keys = make_keys(3, seed=3)
    s.place("gpu", keys[:1])
    s.place("fake", keys[1:])
    gated(s).read_fault = fault
    reads = open_reads(s, [keys])
    assert len(reads.objs[0]) == 3
    for layer in range(LAYOUT.num_layers):
        assert reads.wait_layer(layer, timeout=5), "a failed read releases every layer"
    assert reads.finish() == [1]
    reads.release()
    s.assert_no_leaks()


def test_full_staging_ends_the_candidates(setup: Setup) -> None:
    s = setup
    keys = make_keys(3, seed=4)
    s.place("fake", keys)
    s.loop.loop.call_soon_threadsafe(gated(s).gate.set)
    reads = open_reads(s, [keys], ScarceStaging(s, [True, False, True]))
    assert reads.finish() == [1]
    reads.release()
    s.assert_no_leaks()


def test_reads_go_where_the_lookup_found_each_chunk_and_ask_no_tier_again(setup: Setup) -> None:
    s = setup
    keys = make_keys(4, seed=5)
    s.place("gpu", keys[:1])
    s.place("cpu", keys[1:2])
    s.place("fake", keys[2:])
    s.place("fake", keys[:1])  # also below the gpu: the topmost tier holding a chunk is the one read
    found = s.mgr.lookup(keys, record=False)
    assert found.sources == (0, 1, 2, 2)
    fake = gated(s)
    before = dict(fake.calls)
    s.loop.loop.call_soon_threadsafe(fake.gate.set)
    reads = open_plans(s, [ReadPlan(tuple(keys), found.sources)] * 2)
    assert reads.finish() == [4, 4]
    for objs in reads.objs:
        for key, obj in zip(keys, objs):
            assert torch.equal(obj.tensor, chunk_data(key))
    reads.release()
    assert fake.calls["contains_prefix"] == before.get("contains_prefix", 0), "a read asks no tier again"
    assert fake.calls["read_layers"] == before.get("read_layers", 0) + 1, "one read for the step's chunks"
    assert fake.calls["get_many"] == before.get("get_many", 0)
    assert s.counter("gpu", "get_chunks") == 1, "one get for the chunk both plans share"
    assert s.counter("fake", "hit_tokens") == 4 * keys[0].num_tokens
    s.assert_no_leaks()


def test_a_chunk_evicted_after_the_lookup_ends_the_candidates(setup: Setup) -> None:
    s = setup
    keys = make_keys(3, seed=6)
    s.place("gpu", keys[:1])
    s.place("cpu", keys[1:2])
    s.place("fake", keys[2:])
    found = s.mgr.lookup(keys, record=False)
    assert found.num_chunks == 3
    assert s.loop.run(s.tiers["cpu"].remove([keys[1]]), timeout=5) == 1
    reads = open_plans(s, [ReadPlan(tuple(keys), found.sources)])
    assert len(reads.objs[0]) == 1, "the chunks after the gone one are not read"
    assert gated(s).calls["read_layers"] == 0
    assert reads.finish() == [1]
    reads.release()
    s.assert_no_leaks()


def test_a_plan_needs_one_source_per_key() -> None:
    with pytest.raises(ValueError, match="2 keys but 1 sources"):
        ReadPlan(tuple(make_keys(2)), (0,))
