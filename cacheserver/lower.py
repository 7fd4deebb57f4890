"""The cache server's own lower tiers: NVMe files and Redis below its shared arena (docs/cache-server.md).

The server cannot interpret a chunk's bytes, so a chunk of ``n`` bytes goes down as a raw chunk of
the fixed layout ``BYTES_LAYOUT`` (``n / 2`` float16 values, ``(1, 1, n / 2, 1, 1)``) through the
project's own backends (``backends/nvme.py``, ``backends/redis.py``): the ``kvlayer.serde``
header keeps the key, tokens digest, size and xxh3 checksum, and every read is the one
checksummed ranged read (``backends/byte_reads.py``). Chunk files are named with start 0, so a
chunk's size is found again from its file (or its two Redis values) after a restart.

- ``write_through``: a committed chunk is held in the arena (``ChunkIndex.hold``) until every
  lower tier wrote it, in the background; its bytes are first checked against the checksum the
  writer committed. A failed write (a full disk, a dead Redis) is counted, never raised.
- ``count``: how many keys past the arena's prefix the lower tiers hold, tier by tier.
- ``promote``: a lease of a chunk the arena lacks reads it into a fresh range of the arena (the
  session's reservation, committed into its lease once the read verified); a failed or corrupt
  read is a miss, and the next tier is tried.

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

from kvlayer import serde
from kvlayer.cacheserver.client import MappedArena
from kvlayer.cacheserver.index import ChunkIndex, Entry, Session
from kvlayer.cacheserver.protocol import Key, Lease, Status
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
COUNTERS = ("written", "write_errors", "skipped_writes", "bad_checksums", "odd_sizes", "lookup_errors", "promoted",
            "promote_misses", "read_errors")


def bytes_key(key: Key, size: int = ITEM) -> ChunkKey:
    """The backend key of a server chunk of ``size`` bytes (digest and tokens digest as sent)."""
    return ChunkKey(key.digest, key.tokens_digest, 0, size // ITEM)


class LowerTier:
    """One backend below the arena, and how to learn a stored chunk's size."""

    def __init__(self, backend: StorageBackend) -> None:
        self.backend = backend
        self.down_until = 0.0

    @property
    def up(self) -> bool:
        """False while the tier is in its backoff after a failure."""
        return time.monotonic() >= self.down_until

    async def sizes(self, keys: Sequence[Key]) -> list[int | None]:
        """The payload bytes of each key's stored chunk, None where it is not stored."""
        raise NotImplementedError


class NvmeLower(LowerTier):
    """The NVMe tier: a chunk's size from its file's (header, then payload)."""

    async def sizes(self, keys: Sequence[Key]) -> list[int | None]:
        from kvlayer.backends.nvme_files import chunk_path

        root = self.backend.root  # type: ignore[attr-defined]
        out: list[int | None] = []
        for key in keys:
            try:
                out.append(os.stat(chunk_path(root, key.digest, 0)).st_size - serde.HEADER_SIZE)
            except OSError:
                out.append(None)
        return out


class RedisLower(LowerTier):
    """The Redis tier: a chunk's size from the lengths of its two values."""

    async def sizes(self, keys: Sequence[Key]) -> list[int | None]:
        backend = self.backend
        names = [backend.redis_keys(bytes_key(k)) for k in keys]  # type: ignore[attr-defined]
        async with backend._deadline():  # type: ignore[attr-defined]
            lens = await backend._run([("STRLEN", n) for pair in names for n in pair])  # type: ignore[attr-defined]
        out: list[int | None] = []
        for head, body in zip(lens[::2], lens[1::2]):
            ok = isinstance(head, int) and isinstance(body, int) and head > serde.HEADER_SIZE and body > 0
            out.append(head + body - serde.HEADER_SIZE if ok else None)
        return out


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
        staging = Arena(0, 1, name="cache-server staging")  # reads land in the arena, never here
        nvme = config.tiers.get("nvme")
        if nvme is not None and nvme.enabled:
            from kvlayer.backends.nvme import NvmeBackend

            root = os.path.abspath(os.path.expanduser(nvme["path"]))
            tiers.append(NvmeLower(NvmeBackend(root, nvme["capacity"], BYTES_LAYOUT, staging, fsync=nvme["fsync"])))
        redis = config.tiers.get("redis")
        if redis is not None and redis.enabled:
            from kvlayer.backends.redis import RedisBackend
            from kvlayer.backends.redis_clients import RedisSettings

            settings = RedisSettings(redis["url"], redis["cluster"], redis["ttl_s"], redis["key_prefix"],
                                     "none", config.tier_timeout_ms / 1000, "none")
            tiers.append(RedisLower(RedisBackend(settings, BYTES_LAYOUT, staging)))
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

    async def promote(self, index: ChunkIndex, session: Session, keys: Sequence[Key],
                      leases: Sequence[Lease]) -> list[Lease]:
        """``leases`` with each MISSING key that a tier holds read into the arena and leased to
        ``session``; a key no tier gives a verified chunk for stays MISSING."""
        out = list(leases)
        todo = [i for i, x in enumerate(out) if x.status is Status.MISSING]
        for tier in self.tiers:
            if todo and tier.up:
                todo = await self._promote_from(tier, index, session, keys, out, todo)
        self._stats["promote_misses"] += len(todo)
        return out

    async def _promote_from(self, tier: LowerTier, index: ChunkIndex, session: Session, keys: Sequence[Key],
                            out: list[Lease], todo: list[int]) -> list[int]:
        """Promote ``keys[i]`` for each ``i`` in ``todo`` from ``tier`` into ``out``; the ones left."""
        sizes = await self._guard(tier, "read_errors", tier.sizes([keys[i] for i in todo]))
        if sizes is None:
            return todo
        found = [(i, s) for i, s in zip(todo, sizes) if s is not None and 0 < s <= index.capacity and not s % ITEM]
        slots = index.reserve(session, [(keys[i], s) for i, s in found]) if found else []
        taken = [(i, s, slot.offset) for (i, s), slot in zip(found, slots) if slot.status is Status.OK]
        objs = [self._obj(offset, s) for _, s, offset in taken]
        try:
            flags = await self._guard(tier, "read_errors", tier.backend.read_layers(
                [bytes_key(keys[i], s) for i, s, _ in taken], objs, [(0, 1)], lambda g: None))
            flags = flags or [False] * len(taken)
            for (i, s, offset), obj, ok in zip(taken, objs, flags):
                digest = keys[i].digest
                if not ok:
                    index.release(session, [digest])
                    continue
                checksum = await asyncio.to_thread(xxhash.xxh3_64_intdigest, obj.byte_view())
                index.commit(session, [(digest, checksum)])
                out[i] = Lease(Status.OK, offset, s, checksum)
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
