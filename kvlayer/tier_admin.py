"""The coroutines behind ``TierManager``'s admin operations (the controller agent's commands):
listing every tier's chunks and copying a prefix from one tier into another."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj
from kvlayer.memory import release_all as _release
from kvlayer.storage import StorageBackend
from kvlayer.tier_guard import GuardedTier, TierFailure

log = logging.getLogger(__name__)


async def list_chunks(tiers: list[GuardedTier], timeout: float) -> dict[str, list[bytes]]:
    """The digests each of ``tiers`` holds, by name; [] (logged) for a tier whose listing fails
    or takes over ``timeout`` s. Memory tiers are listed on the loop, the others' ``keys()``
    (which may block: a Redis scan) on a worker thread."""
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


async def copy_prefix(keys: list[ChunkKey], sources: list[GuardedTier], target: GuardedTier,
                      put: Callable[[GuardedTier, list[ChunkKey], list[MemoryObj]], Awaitable[None]]) -> int:
    """Copy the longest prefix of ``keys`` one of ``sources`` holds into ``target`` with
    ``put``; how many leading ``keys`` ``target`` holds afterwards (0 if it cannot say)."""
    objs = await _read_prefix(keys, sources)
    try:
        if objs:
            await put(target, keys[: len(objs)], objs)
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
        got = await best.call("get_many", get_many_checked(best.backend, keys[:n]))
    except TierFailure:
        return []
    lead = got.index(None) if None in got else len(got)
    _release([obj for obj in got[lead:] if obj is not None])
    return [obj for obj in got[:lead] if obj is not None]


async def get_many_checked(backend: StorageBackend, keys: list[ChunkKey]) -> list[MemoryObj | None]:
    """``backend.get_many`` with its answer checked (a wrong length is the backend's error)."""
    got = await backend.get_many(keys)
    if len(got) != len(keys):
        _release([obj for obj in got if obj is not None])
        raise ValueError(f"get_many returned {len(got)} results for {len(keys)} keys")
    return got
