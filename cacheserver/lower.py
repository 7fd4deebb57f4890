"""The cache server's own lower tiers: NVMe files and Redis below its shared arena (docs/cache-server.md).

The server cannot interpret a chunk's bytes, so a chunk of ``n`` bytes goes down as a raw chunk of
the fixed layout ``BYTES_LAYOUT`` (``n / 2`` float16 values, ``(1, 1, n / 2, 1, 1)``) through the
project's own backends (``backends/nvme.py``, ``backends/redis.py``): the ``kvlayer.serde``
header keeps the key, tokens digest, size and xxh3 checksum, and every read is the one
checksummed ranged read (``backends/byte_reads.py``). Chunk files are named with start 0, so a
restarted server finds them again; a chunk's size comes with the ``LEASE`` that asks for it.

- ``write_through``: a committed chunk is held in the arena (``ChunkIndex.hold``) until every
  lower tier wrote it, in the background; its bytes are first checked against the checksum the
  writer committed. A failed write (a full disk, a dead Redis) is counted, never raised.
- ``count``: how many keys past the arena's prefix the lower tiers hold, tier by tier.
- ``promote``: a lease of a chunk the arena lacks reads it, at the size the lease names, into a
  fresh range of the arena (the session's reservation, of the lease's tenant, committed into its
  lease and sealed once the read verified). A failed or corrupt read, or a stored chunk of
  another size (its header disagrees), is a miss, and the next tier is tried; a lease of size 0
  (not known) or of a size no chunk can have is not promoted.

A tier without ranged reads (a Redis Cluster: ``RedisBackend.ranged_reads`` is false) reads
whole chunks through a staging slot of ``STAGING_BYTES``, one chunk at a time; a bigger chunk is
not promoted from it (``oversized_leases``).

A tier that raised is skipped for ``BACKOFF_S`` (its calls would each wait out a timeout).
Faults are counted in ``stats()`` and logged once per kind.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import time
from collections import Counter
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import torch
import xxhash

from kvlayer.cacheserver.client import MappedArena
from kvlayer.cacheserver.index import ChunkIndex, Entry, Session
from kvlayer.cacheserver.protocol import Key, Lease, Reserve, Status
from kvlayer.config import KVLayerConfig
from kvlayer.keys import ChunkKey
from kvlayer.layout import LATENT_CACHE_LAYOUT, KVLayout
from kvlayer.memory import Arena, MemoryObj, release_all
from kvlayer.storage import StorageBackend

log = logging.getLogger(__name__)
T = TypeVar("T")

BYTES_LAYOUT = KVLayout(1, 1, 1, torch.float16, 1, LATENT_CACHE_LAYOUT)
"""Chunk shape ``(1, 1, tokens, 1, 1)`` of float16: a chunk of ``n`` bytes is ``n / 2`` "tokens"."""
ITEM = 2
BACKOFF_S = 5.0
STAGING_BYTES = 64 << 20
"""The staging slot a tier without ranged reads reads a chunk through (its pages are touched only
when used); the largest chunk such a tier promotes."""
COUNTERS = ("written", "write_errors", "skipped_writes", "bad_checksums", "odd_sizes", "lookup_errors", "promoted",
            "promote_misses", "unsized_leases", "oversized_leases", "read_errors")


def bytes_key(key: Key, size: int = ITEM) -> ChunkKey:
    """The backend key of a server chunk of ``size`` bytes (digest and tokens digest as sent)."""
    return ChunkKey(key.digest, key.tokens_digest, 0, size // ITEM)


class LowerTier:
    """One backend below the arena, and its backoff after a failure."""

    def __init__(self, backend: StorageBackend) -> None:
        self.backend = backend
        self.down_until = 0.0

    @property
    def up(self) -> bool:
        """False while the tier is in its backoff after a failure."""
        return time.monotonic() >= self.down_until


class LowerTiers:
    """The server's lower tiers, top first, over the arena file mapped at ``path`` (``size`` bytes)."""

    def __init__(self, tiers: Sequence[LowerTier]) -> None:
        self.tiers = list(tiers)
        self._view: MappedArena | None = None
        self._mapping: mmap.mmap | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._stats: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._logged: set[str] = set()

    @classmethod
    def from_config(cls, config: KVLayerConfig) -> LowerTiers | None:
        """The tiers ``config`` names (``nvme_path``/``nvme_capacity``, ``redis_url`` and its
        settings), raw whatever its ``compression``; None when it names none."""
        tiers: list[LowerTier] = []
        # ranged reads land in the arena; a tier without them reads through this one slot
        staging = Arena(STAGING_BYTES, STAGING_BYTES, name="cache-server staging")
        nvme = config.tiers.get("nvme")
        if nvme is not None and nvme.enabled:
            from kvlayer.backends.nvme import NvmeBackend

            root = os.path.abspath(os.path.expanduser(nvme["path"]))
            tiers.append(LowerTier(NvmeBackend(root, nvme["capacity"], BYTES_LAYOUT, staging, fsync=nvme["fsync"])))
        redis = config.tiers.get("redis")
        if redis is not None and redis.enabled:
            from kvlayer.backends.redis import RedisBackend
            from kvlayer.backends.redis_clients import RedisSettings

            settings = RedisSettings(redis["url"], redis["cluster"], redis["ttl_s"], redis["key_prefix"],
                                     "none", config.tier_timeout_ms / 1000, "none")
            tiers.append(LowerTier(RedisBackend(settings, BYTES_LAYOUT, staging)))
        return cls(tiers) if tiers else None

    def attach(self, path: str, size: int) -> None:
        """Map the server's arena file (the chunks' bytes are read and written there)."""
        fd = os.open(path, os.O_RDWR)
        try:
            self._mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._view = MappedArena(torch.frombuffer(self._mapping, dtype=torch.uint8), "cache-server arena",
                                 lambda offset: None)

    def names(self) -> list[str]:
        """The tiers' names, top first."""
        return [t.backend.name for t in self.tiers]

    def stats(self) -> dict[str, int]:
        """This layer's counters, and each backend's prefixed with its name."""
        out = dict(self._stats)
        for t in self.tiers:
            out.update({f"{t.backend.name}_{k}": v for k, v in t.backend.stats().items()})
        return out

    async def close(self) -> None:
        """Finish the writes under way, then close the backends (the mapping goes with the process)."""
        await asyncio.gather(*self._writes, return_exceptions=True)
        for t in self.tiers:
            await t.backend.close()

    # --- writes ---------------------------------------------------------------------------
    def write_through(self, index: ChunkIndex, digests: Sequence[bytes]) -> None:
        """Write the just committed ``digests`` to every tier in the background, each held in the
        arena until then."""
        entries = index.hold(digests)
        if not entries:
            return
        task = asyncio.ensure_future(self._write(entries))
        self._writes.add(task)
        task.add_done_callback(lambda t: (self._writes.discard(t), index.unhold(entries)))

    async def _write(self, entries: Sequence[tuple[bytes, Entry]]) -> None:
        keys, objs = [], []
        try:
            for digest, entry in entries:
                if entry.size % ITEM:
                    self._count("odd_sizes", "a chunk of an odd size stays in the arena only")
                    continue
                obj = self._obj(entry.offset, entry.size)
                got = await asyncio.to_thread(xxhash.xxh3_64_intdigest, obj.byte_view())
                if got != entry.checksum:
                    obj.release()
                    self._count("bad_checksums", "a committed chunk does not match its checksum; not written down")
                    continue
                keys.append(bytes_key(Key(digest, entry.tokens_digest), entry.size))
                objs.append(obj)
            for tier in self.tiers:
                if keys and tier.up:
                    await self._guard(tier, "write_errors", tier.backend.put_many(keys, objs))
                elif keys:  # in its backoff after a failure
                    self._stats["skipped_writes"] += len(keys)
            self._stats["written"] += len(keys)
        finally:
            release_all(objs)

    # --- reads ----------------------------------------------------------------------------
    async def count(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` the tiers hold between them (each key in any one tier)."""
        n = 0
        moved = True
        while moved and n < len(keys):
            moved = False
            for tier in self.tiers:
                if not tier.up:
                    continue
                got = await self._guard(tier, "lookup_errors",
                                        tier.backend.contains_prefix([bytes_key(k) for k in keys[n:]]))
                if got:
                    n, moved = n + got, True
        return n

    async def promote(self, index: ChunkIndex, session: Session, items: Sequence[Reserve],
                      leases: Sequence[Lease]) -> list[Lease]:
        """``leases`` with each MISSING item that a tier holds, at the item's size, read into the
        arena (of the item's tenant), sealed and leased to ``session``; an item no tier gives a
        verified chunk of that size for stays MISSING. An item of size 0 (not known), past the
        capacity or odd is not looked for (counted in ``unsized_leases``)."""
        out = list(leases)
        missing = [i for i, x in enumerate(out) if x.status is Status.MISSING]
        todo = [i for i in missing if 0 < items[i].size <= index.capacity and not items[i].size % ITEM]
        self._stats["unsized_leases"] += len(missing) - len(todo)
        for tier in self.tiers:
            if not todo or not tier.up:
                continue
            if getattr(tier.backend, "ranged_reads", True):
                todo = await self._promote_from(tier, index, session, items, out, todo)
                continue
            fits = [i for i in todo if items[i].size <= STAGING_BYTES]  # through staging, one at a time
            self._stats["oversized_leases"] += len(todo) - len(fits)
            left = [i for i in todo if i not in fits]
            for i in fits:
                left += await self._promote_from(tier, index, session, items, out, [i])
            todo = sorted(left)
        self._stats["promote_misses"] += len(todo)
        return out

    async def _promote_from(self, tier: LowerTier, index: ChunkIndex, session: Session, items: Sequence[Reserve],
                            out: list[Lease], todo: list[int]) -> list[int]:
        """Promote ``items[i]`` for each ``i`` in ``todo`` from ``tier`` into ``out``; the ones left."""
        slots = index.reserve(session, [items[i] for i in todo])
        taken = [(i, slot.offset) for i, slot in zip(todo, slots) if slot.status is Status.OK]
        objs = [self._obj(offset, items[i].size) for i, offset in taken]
        try:
            flags = await self._guard(tier, "read_errors", tier.backend.read_layers(
                [bytes_key(items[i].key, items[i].size) for i, _ in taken], objs, [(0, 1)], lambda g: None))
            flags = flags or [False] * len(taken)
            for (i, offset), obj, ok in zip(taken, objs, flags):
                digest, size = items[i].key.digest, items[i].size
                if not ok:  # not there, unreadable, corrupt, or stored at another size
                    index.release(session, [digest])
                    continue
                # the read verified the stored checksum; this hash is of the arena's bytes, as a commit's
                checksum = await asyncio.to_thread(xxhash.xxh3_64_intdigest, obj.byte_view())
                if index.commit(session, [(digest, checksum)]):
                    index.seal(digest)
                    out[i] = Lease(Status.OK, offset, size, checksum, True)
                    self._stats["promoted"] += 1
        finally:
            release_all(objs)
        return [i for i in todo if out[i].status is Status.MISSING]

    # --- helpers --------------------------------------------------------------------------
    def _obj(self, offset: int, size: int) -> MemoryObj:
        """A view of ``size`` bytes of the arena at ``offset`` as a chunk of ``BYTES_LAYOUT``."""
        assert self._view is not None, "attach() first"
        return MemoryObj(self._view, offset, BYTES_LAYOUT.chunk_shape(size // ITEM), BYTES_LAYOUT.dtype)

    async def _guard(self, tier: LowerTier, kind: str, call: Awaitable[T]) -> T | None:
        """``await call``, or None when it raised: counted, logged once, the tier backed off."""
        try:
            return await call
        except Exception as e:  # a dead Redis, an unusable folder: a miss, never a crash
            tier.down_until = time.monotonic() + BACKOFF_S
            self._count(kind, f"{tier.backend.name} failed ({e!r}); skipped for {BACKOFF_S:.0f} s")
            return None

    def _count(self, kind: str, message: str) -> None:
        self._stats[kind] += 1
        log.log(logging.DEBUG if kind in self._logged else logging.WARNING, "cache-server lower tiers: %s", message)
        self._logged.add(kind)
