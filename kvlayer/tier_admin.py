"""The tiers' admin operations (the controller agent's commands, docs/architecture.md section 7),
called through ``KVCacheEngine``: pin, unpin and remove keys, list every tier's chunks, copy a
prefix from one tier into another, and empty a tier.

Each runs on the tier manager's I/O loop under its last-guard timeout, from the caller's thread
(never the loop's); a tier's failure counts as nothing done in that tier, never an exception.
``ValueError`` for an unknown tier name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj
from kvlayer.memory import release_all as _release
from kvlayer.storage import StorageBackend
from kvlayer.tier_guard import GuardedTier, TierFailure
from kvlayer.tier_manager import TierManager

log = logging.getLogger(__name__)

REMOVE_BATCH = 1024
"""Chunks ``remove_all`` removes per backend call (each call has one tier deadline)."""

_KeysOp = Callable[[StorageBackend], Callable[[list[ChunkKey]], Awaitable[int]]]
"""Picks a backend's batched method that answers a count (pin, unpin, remove)."""


def can_pin(backend: StorageBackend) -> bool:
    """Whether ``backend`` can pin: ``StorageBackend.pin`` pins nothing by default, and a tier that
    can pin overrides it (the Redis tier does not: Redis evicts by its own maxmemory policy)."""
    return type(backend).pin is not StorageBackend.pin


def pin(tiers: TierManager, keys: Sequence[ChunkKey], tier: str | None = None) -> int:
    """Pin the present ``keys`` in ``tier`` (every tier if None); returns how many were pinned."""
    return _broadcast(tiers, keys, tier, "pin", lambda b: b.pin)


def unpin(tiers: TierManager, keys: Sequence[ChunkKey], tier: str | None = None) -> int:
    """Undo one pin of each pinned key in ``tier`` (every tier if None); returns how many."""
    return _broadcast(tiers, keys, tier, "unpin", lambda b: b.unpin)


def remove(tiers: TierManager, keys: Sequence[ChunkKey], tier: str | None = None) -> int:
    """Remove the present, unpinned ``keys`` from ``tier`` (every tier if None); returns how many."""
    return _broadcast(tiers, keys, tier, "remove", lambda b: b.remove)


def snapshot(tiers: TierManager, timeout: float = 30.0, tier: str | None = None) -> dict[str, list[bytes]]:
    """The digests each tier (``tier`` only, if given) holds, by tier name; a tier whose listing
    fails or takes more than ``timeout`` s answers [] (logged). Memory tiers are listed on the
    I/O loop; the others' ``keys()`` may block (a Redis scan), so they run on a worker thread."""
    chosen = tiers.select(tier)
    return tiers.run(_list_chunks(chosen, timeout), "listing the tiers' chunks", {}, timeout=2 * timeout)


def copy(tiers: TierManager, keys: Sequence[ChunkKey], dst: str, src: str | None = None) -> int:
    """Put the longest prefix of ``keys`` that tier ``src`` holds (None: that any other tier
    holds, the upper one on a tie) into tier ``dst``, and wait until it is there.

    Returns how many leading ``keys`` ``dst`` holds afterwards (a tier failure counts as a
    miss). ``ValueError`` for an unknown tier, or ``src == dst``.
    """
    keys = list(keys)
    target = tiers.select(dst)[0]
    sources = tiers.select(src) if src is not None else [t for t in tiers.guarded if t is not target]
    if target in sources:
        raise ValueError(f"cannot copy tier {dst!r} into itself")
    if not keys:
        return 0
    return tiers.run(_copy_prefix(keys, sources, target), "copy", 0)


def remove_all(tiers: TierManager, tier: str | None = None) -> int:
    """Remove every unpinned chunk ``snapshot`` lists in ``tier`` (every tier if None); returns how
    many were removed. A shared tier (Redis) loses the chunks of every instance using it.
    Backends find chunks by digest alone (see ``kvlayer.storage``), so each listed digest stands
    in for its full key."""
    removed = 0
    for name, digests in snapshot(tiers, tier=tier).items():
        for i in range(0, len(digests), REMOVE_BATCH):
            removed += remove(tiers, [ChunkKey(d, b"", 0, 0) for d in digests[i : i + REMOVE_BATCH]], name)
    return removed


def _broadcast(tiers: TierManager, keys: Sequence[ChunkKey], tier: str | None, what: str, pick: _KeysOp) -> int:
    """Sum of ``pick(backend)(keys)`` over the selected usable tiers (a failure counts 0)."""
    chosen = tiers.select(tier)
    keys = list(keys)

    async def each() -> int:
        calls = (t.call(what, pick(t.backend)(keys)) for t in chosen if t.usable())
        answers = await asyncio.gather(*calls, return_exceptions=True)
        return sum(int(a) for a in answers if not isinstance(a, BaseException))

    return tiers.run(each(), what, 0) if keys else 0


async def _list_chunks(tiers: list[GuardedTier], timeout: float) -> dict[str, list[bytes]]:
    async def listing(t: GuardedTier) -> list[bytes]:
        if t.in_memory:
            return list(t.backend.keys())
        return list(await asyncio.wait_for(asyncio.to_thread(t.backend.keys), timeout))

    answers = await asyncio.gather(*(listing(t) for t in tiers), return_exceptions=True)
    out = {}
    for t, answer in zip(tiers, answers):
        if isinstance(answer, BaseException):
            log.warning("kvlayer tier %s: listing its chunks failed: %r", t.name, answer)
            answer = []
        out[t.name] = answer
    return out


async def _copy_prefix(keys: list[ChunkKey], sources: list[GuardedTier], target: GuardedTier) -> int:
    """Copy the longest prefix of ``keys`` one of ``sources`` holds into ``target``; how many
    leading ``keys`` ``target`` holds afterwards (0 if it cannot say)."""
    objs = await _read_prefix(keys, sources)
    try:
        if objs:
            await target.put(keys[: len(objs)], objs, skip_present=True)
    finally:
        _release(objs)
    try:
        return int(await target.call("contains_prefix", target.backend.contains_prefix(keys)))
    except TierFailure:
        return 0


async def _read_prefix(keys: list[ChunkKey], sources: list[GuardedTier]) -> list[MemoryObj]:
    """The chunks of the longest prefix one of ``sources`` holds (a reference each, the caller's)."""
    best, n = None, 0
    for t in sources:
        if not t.usable():
            continue
        try:
            count = await t.call("contains_prefix", t.backend.contains_prefix(keys))
        except TierFailure:
            continue
        if count > n:
            best, n = t, min(int(count), len(keys))
    if best is None:
        return []
    try:
        got = await best.get_many(keys[:n])
    except TierFailure:
        return []
    lead = got.index(None) if None in got else len(got)
    _release([obj for obj in got[lead:] if obj is not None])
    return [obj for obj in got[:lead] if obj is not None]
