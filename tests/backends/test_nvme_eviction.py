"""Eviction in the NVMe tier (backends/nvme.py, backends/nvme_index.py): the capacity bound, LRU
order, pins, chain tails before heads, ``remove`` and the tier listener.

Run: ``.venv/bin/python -m pytest tests/backends/test_nvme_eviction.py``. The helpers come from
``test_nvme.py``.
"""

from __future__ import annotations

from pathlib import Path

from kvlayer import serde
from tests.backends.test_nvme import (
    CHUNK,
    LAYOUT,
    chain,
    expected,
    get_fingerprints,
    make_backend,
    put_keys,
    run,
)


def one_file_size() -> int:
    return serde.HEADER_SIZE + LAYOUT.chunk_bytes(CHUNK)


def test_capacity_bound_evicts_least_recently_used(tmp_path: Path) -> None:
    keys = [chain(1, seed=s)[0] for s in range(6)]  # unrelated chains, all start 0

    async def scenario() -> None:
        backend = make_backend(tmp_path, nvme_capacity=4 * one_file_size())
        for key in keys[:4]:  # one at a time: a batch's files land in any order
            await put_keys(backend, [key])
        await get_fingerprints(backend, keys[:1])  # keys[0] becomes the most recent
        await put_keys(backend, keys[4:6])
        held = backend.keys()
        present = [k.digest in held for k in keys]
        assert present == [True, False, False, True, True, True]
        assert backend.usage() == (4 * one_file_size(), 4 * one_file_size())
        assert backend.stats()["evictions"] == 2

    run(scenario())
    assert len(list(tmp_path.rglob("*.kvc"))) == 4


def test_pinned_chunks_survive_ten_times_the_capacity(tmp_path: Path) -> None:
    pinned = chain(2, seed=100)
    workload = [chain(1, seed=s)[0] for s in range(40)]

    async def scenario() -> None:
        backend = make_backend(tmp_path, nvme_capacity=4 * one_file_size())
        await put_keys(backend, pinned)
        assert await backend.pin(pinned) == 2
        for i in range(0, len(workload), 3):
            await put_keys(backend, workload[i : i + 3])
            assert backend.usage()[0] <= backend.usage()[1]
        assert await get_fingerprints(backend, pinned) == expected(pinned)
        assert await backend.remove(pinned) == 0
        assert await backend.unpin(pinned) == 2
        assert await backend.unpin(pinned) == 0
        await put_keys(backend, [chain(1, seed=999)[0]])
        assert backend.stats()["rejected"] == 0

    run(scenario())


def test_a_chunk_that_cannot_fit_beside_pinned_ones_is_rejected(tmp_path: Path) -> None:
    keys = chain(3)

    async def scenario() -> None:
        backend = make_backend(tmp_path, nvme_capacity=2 * one_file_size())
        await put_keys(backend, keys[:2])
        await backend.pin(keys[:2])
        await put_keys(backend, keys[2:])
        assert backend.stats()["rejected"] == 1
        assert await backend.contains_prefix(keys) == 2

    run(scenario())


def test_chain_tails_are_evicted_before_heads(tmp_path: Path) -> None:
    links = chain(4, seed=1)
    others = [chain(1, seed=s)[0] for s in (50, 51)]

    async def scenario() -> None:
        backend = make_backend(tmp_path, nvme_capacity=4 * one_file_size())
        for key in links:  # head first, so that plain LRU would evict the head
            await put_keys(backend, [key])
        await put_keys(backend, others[:1])
        assert await backend.contains_prefix(links) == 3
        await put_keys(backend, others[1:])
        assert await backend.contains_prefix(links) == 2

    run(scenario())


def test_remove_and_the_listener(tmp_path: Path) -> None:
    keys = chain(3)
    events: list[tuple[str, str, int]] = []

    class Listener:
        def on_admit(self, tier: str, digests: list[bytes]) -> None:
            events.append(("admit", tier, len(digests)))

        def on_evict(self, tier: str, digests: list[bytes]) -> None:
            events.append(("evict", tier, len(digests)))

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        backend.set_listener(Listener())
        await put_keys(backend, keys)
        await backend.pin(keys[:1])
        assert await backend.remove(keys) == 2
        assert await backend.contains_prefix(keys) == 1
        assert backend.usage()[0] == one_file_size()

    run(scenario())
    assert events == [("admit", "nvme", 1)] * 3 + [("evict", "nvme", 2)]
    assert len(list(tmp_path.rglob("*.kvc"))) == 1
