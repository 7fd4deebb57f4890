"""The tiers' admin operations (the controller agent's commands, docs/architecture.md section 7),
called through ``KVCacheEngine``: pin, unpin and remove keys, list every tier's chunks and its
pinned ones, copy or move a prefix from one tier into another, and empty a tier.

``evict``, ``copy_prefix`` and ``move`` answer an ``Outcome``: what was done,
what was left because it is pinned, and what was not there, each counted apart. Pins are
counted: a chunk pinned twice needs two unpins before it can be evicted or moved away.

Each runs on the tier manager's I/O loop under its last-guard timeout, from the caller's thread
(never the loop's); a tier's failure counts as nothing done in that tier, never an exception.
``ValueError`` for an unknown tier name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj
from kvlayer.memory import release_all as _release
from kvlayer.storage import StorageBackend
from kvlayer.tier_guard import GuardedTier, TierFailure
from kvlayer.tier_manager import TierManager

log = logging.getLogger(__name__)

REMOVE_BATCH = 1024
"""Chunks ``remove_all`` removes per backend call (each call has one tier deadline)."""


class Outcome(NamedTuple):
    """What an admin operation did, counted per tier copy of a chunk.

    ``done``: chunks evicted, copied (the destination holds them from the source's copy) or
    moved (copied, then removed from the source). ``skipped_pinned``: chunks left where they
    are because they are pinned there (evict; move: copied, but not removed from the source).
    ``missing``: keys none of the tiers acted on held (copy, move: from the first key the
    source lacks, as a prefix is read up to its first gap). ``held``: copy, move: the leading
    keys the destination holds afterwards (0 where it cannot say).
    """

    done: int = 0
    skipped_pinned: int = 0
    missing: int = 0
    held: int = 0


_KeysOp = Callable[[StorageBackend], Callable[[list[ChunkKey]], Awaitable[int]]]
"""Picks a backend's batched method that answers a count (pin, unpin, remove)."""
Pinned = dict[str, list[tuple[bytes, int, int]]]
"""Tier name -> its pinned chunks as ``(digest, pin count, end)``; ``end`` is the key's ``end``
when listed for given keys, else 0."""


def can_pin(backend: StorageBackend) -> bool:
    """Whether ``backend`` can pin: ``StorageBackend.pin`` pins nothing by default, and a tier that
    can pin overrides it (the Redis tier does not: Redis evicts by its own maxmemory policy)."""
    return type(backend).pin is not StorageBackend.pin


def pin(tiers: TierManager, keys: Sequence[ChunkKey], tier: str | None = None) -> int:
    """Pin the present ``keys`` in ``tier`` (every tier if None); returns how many were pinned.
    Pins are counted: each pin of a chunk needs its own ``unpin``."""
    return _broadcast(tiers, keys, tier, "pin", lambda b: b.pin)


def unpin(tiers: TierManager, keys: Sequence[ChunkKey], tier: str | None = None) -> int:
    """Undo one pin of each pinned key in ``tier`` (every tier if None); returns how many."""
    return _broadcast(tiers, keys, tier, "unpin", lambda b: b.unpin)


def remove(tiers: TierManager, keys: Sequence[ChunkKey], tier: str | None = None) -> int:
    """Remove the present, unpinned ``keys`` from ``tier`` (every tier if None); returns how many."""
    return _broadcast(tiers, keys, tier, "remove", lambda b: b.remove)


def evict(tiers: TierManager, keys: Sequence[ChunkKey], names: Sequence[str] | None = None) -> Outcome:
    """Remove the present, unpinned ``keys`` from the tiers ``names`` (every tier if None).
    ``done``: chunks removed; ``skipped_pinned``: held but pinned, so kept; ``missing``: keys
    none of those tiers held."""
    chosen = [t for name in names for t in tiers.select(name)] if names is not None else tiers.select(None)
    keys = list(keys)
    if not keys or not chosen:
        return Outcome(missing=len(keys))
    return tiers.run(_evict(chosen, keys), "evict", Outcome(missing=len(keys)))


def pinned(tiers: TierManager, tier: str | None = None, keys: Sequence[ChunkKey] | None = None) -> Pinned:
    """Per tier (``tier`` only, if given): its pinned chunks and their pin counts; with ``keys``,
    only theirs, in their order."""
    chosen = tiers.select(tier)

    async def listing() -> Pinned:
        out: Pinned = {}
        for t in chosen:
            pins = t.backend.pinned()
            if keys is None:
                out[t.name] = [(d, n, 0) for d, n in pins.items()]
            else:
                out[t.name] = [(k.digest, pins[k.digest], k.end) for k in keys if k.digest in pins]
        return out

    return tiers.run(listing(), "listing the pinned chunks", {})


def snapshot(tiers: TierManager, timeout: float = 30.0, tier: str | None = None) -> dict[str, list[bytes]]:
    """The digests each tier (``tier`` only, if given) holds, by tier name; a tier whose listing
    fails or takes more than ``timeout`` s answers [] (logged). Memory tiers are listed on the
    I/O loop; the others' ``keys()`` may block (a Redis scan), so they run on a worker thread."""
    chosen = tiers.select(tier)
    return tiers.run(_list_chunks(chosen, timeout), "listing the tiers' chunks", {}, timeout=2 * timeout)


def copy_prefix(tiers: TierManager, keys: Sequence[ChunkKey], dst: str, src: str | None = None) -> Outcome:
    """Put the longest prefix of ``keys`` that tier ``src`` holds (None: that any other tier
    holds, the upper one on a tie) into tier ``dst``, and wait until it is there.

    ``done``: the chunks of that prefix ``dst`` holds afterwards; ``missing``: the keys past
    it; ``held``: the leading ``keys`` ``dst`` holds afterwards (a tier failure counts as a
    miss). ``ValueError`` for an unknown tier, or ``src == dst``.
    """
    keys = list(keys)
    target = tiers.select(dst)[0]
    sources = tiers.select(src) if src is not None else [t for t in tiers.guarded if t is not target]
    if target in sources:
        raise ValueError(f"cannot copy tier {dst!r} into itself")
    if not keys:
        return Outcome()
    copied, held = tiers.run(_copy_prefix(keys, sources, target), "copy", (0, 0))
    return Outcome(done=min(copied, held), missing=len(keys) - copied, held=held)


def move(tiers: TierManager, keys: Sequence[ChunkKey], dst: str, src: str) -> Outcome:
    """``copy_prefix`` from ``src`` into ``dst``, then remove from ``src`` the chunks ``dst`` now
    holds. ``done``: chunks moved; ``skipped_pinned``: copied but kept in ``src``, pinned there;
    ``missing`` and ``held``: as ``copy_prefix``'s."""
    copied = copy_prefix(tiers, keys, dst, src)
    reached = list(keys)[: copied.done]
    dropped = evict(tiers, reached, [src]) if reached else Outcome()
    return copied._replace(done=dropped.done, skipped_pinned=dropped.skipped_pinned)


def remove_all(tiers: TierManager, tier: str | None = None) -> int:
    """Remove every unpinned chunk ``snapshot`` lists in ``tier`` (every tier if None); returns how
    many were removed (``pinned`` lists what is left). A shared tier (Redis) loses the chunks of
    every instance using it. Backends find chunks by digest alone (see ``kvlayer.storage``), so
    each listed digest stands in for its full key."""
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


async def _evict(chosen: list[GuardedTier], keys: list[ChunkKey]) -> Outcome:
    """``evict`` on the loop: per tier, which keys it holds and which of those are pinned, then the removal."""
    async def each(t: GuardedTier) -> tuple[list[bool], int, int] | None:
        if not t.usable():
            return None
        try:
            held = await t.call("contains_prefix", _holds(t.backend, keys))
            pins = t.backend.pinned()
            removed = int(await t.call("remove", t.backend.remove(keys)))
        except TierFailure:
            return None
        return held, removed, sum(1 for k, h in zip(keys, held) if h and k.digest in pins)

    answers = [a for a in await asyncio.gather(*(each(t) for t in chosen)) if a is not None]
    present = [any(a[0][i] for a in answers) for i in range(len(keys))]
    return Outcome(done=sum(a[1] for a in answers), skipped_pinned=sum(a[2] for a in answers),
                   missing=present.count(False))


async def _holds(backend: StorageBackend, keys: list[ChunkKey]) -> list[bool]:
    """Per key, whether ``backend`` holds it (``contains_prefix`` of each alone)."""
    return [n == 1 for n in await asyncio.gather(*(backend.contains_prefix([k]) for k in keys))]


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


async def _copy_prefix(keys: list[ChunkKey], sources: list[GuardedTier], target: GuardedTier) -> tuple[int, int]:
    """Copy the longest prefix of ``keys`` one of ``sources`` holds into ``target``: how many
    keys that prefix has, and how many leading ``keys`` ``target`` holds afterwards (0 if it
    cannot say)."""
    objs = await _read_prefix(keys, sources)
    copied = len(objs)
    try:
        if objs:
            await target.put(keys[:copied], objs, skip_present=True)
    finally:
        _release(objs)
    try:
        return copied, int(await target.call("contains_prefix", target.backend.contains_prefix(keys)))
    except TierFailure:
        return copied, 0


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
