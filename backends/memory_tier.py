"""``MemoryTier``: the one implementation behind the in-memory tiers (``gpu``, ``cpu``).

A tier holds chunks in an ``Arena`` of its capacity (one slot per chunk), indexed by key
digest with the chunk's tokens digest; ``get_many`` returns the stored objects themselves
(zero copy, one reference for the caller). Subclasses only say where the arena lives.

Eviction (when a put finds no free slot): least recently used first, never a pinned chunk
nor one somebody else still references (``ref_count > 1``), never a chunk of the batch being
put. Chunks touched together (one get or put) are equally recent; among them the tail of a
prefix chain should go first, since a chunk without its predecessor is useless. So a batch
is touched in descending ``key.start`` order: the chunk with the largest start ends up least
recent of its batch and is evicted first, its head last. A put that finds no room even after
evicting skips that chunk (``stats()['skipped_full']``); it never raises for lack of room.

Thread-safety: methods run on the I/O loop; the objects returned are used on the engine
thread (their counts are guarded by the arena lock). ``usage()``/``stats()`` read plain ints
and may be called from any thread; ``keys()`` must be called on the I/O loop.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.storage import BackendContext, StorageBackend, check_batch

AGING = 8
"""Ask counts are halved after this many asks per slot, so old popularity fades."""
_POLL_S = 0.0002
"""How often a put polls its asynchronous device copies (the loop keeps running meanwhile)."""


@dataclass(slots=True)
class _Entry:
    obj: MemoryObj
    tokens_digest: bytes


class MemoryTier(StorageBackend):
    """A tier whose chunks live in an arena; subclasses set ``name``, ``rank`` and the placement."""

    in_memory = True
    capacity_setting: ClassVar[str] = ""
    """The flat config key of this tier's ``capacity`` setting, ``<name>_capacity`` (declared in
    ``backends/settings.py``; bytes, 0 disables the tier): how messages name it."""
    pin_host: ClassVar[bool] = False
    """Whether a host arena should be page-locked (where CUDA exists)."""

    def __init__(self, arena: Arena, layout: KVLayout) -> None:
        self._arena = arena
        self._layout = layout
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._counts = {"evictions": 0, "skipped_full": 0, "tokens_mismatches": 0, "promotions_declined": 0}
        self._asked: Counter[bytes] = Counter()
        """How often each digest was asked for (``get_many``), halved every ``AGING`` x slots asks."""
        self._asks = 0

    @classmethod
    def arena_device(cls, ctx: BackendContext) -> torch.device:
        """Where this tier's arena lives."""
        raise NotImplementedError

    @classmethod
    def create(cls, ctx: BackendContext) -> MemoryTier | None:
        """The tier with an arena of its ``capacity`` setting (``ctx.tier_settings``), None when that is 0.

        ``ValueError`` (naming the setting) if the capacity holds not even one chunk.
        """
        capacity = ctx.tier_settings(cls.name)["capacity"]
        if capacity <= 0:
            return None
        slot_bytes = ctx.layout.chunk_bytes(ctx.config.chunk_size)
        arena = Arena(capacity, slot_bytes, cls.arena_device(ctx), pin=cls.pin_host, name=f"{cls.name} tier")
        if arena.num_slots == 0:
            raise ValueError(f"{cls.capacity_setting}={capacity} bytes holds no chunk of {slot_bytes} bytes")
        return cls(arena, ctx.layout)

    # --- reads --------------------------------------------------------------------------
    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for key in keys:
            if self._lookup(key) is None:
                break
            n += 1
        return n

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """The stored objects (one new reference each, owned by the caller) or None for misses.

        Zero copy: the caller reads the tier's own slot, so it must release its reference only
        once the device work reading it has completed (a released slot may be refilled).
        """
        out: list[MemoryObj | None] = []
        hits = []
        self._count_asks(keys)
        for key in keys:
            entry = self._lookup(key)
            out.append(None if entry is None else entry.obj.ref())
            if entry is not None:
                hits.append(key)
        self._touch(hits)
        return out

    # --- writes -------------------------------------------------------------------------
    async def put_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        """Copy each chunk not yet present into a slot, or adopt it (a new reference) where it is
        one of this tier's own (``reserve``); the caller keeps its references.

        The chunks' data must be ready (producing kernels finished or ordered on the current
        stream). ``ValueError`` if lengths, shapes or dtypes do not match the layout.
        """
        await self._put(keys, chunks, selective=False)

    async def promote_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> list[bool]:
        """``put_many`` for chunks read from a lower tier, with TinyLFU-style admission: a chunk
        that needs an eviction is admitted only if it was asked for (``get_many``) more often
        than the chunk it would evict, else declined (``stats()['promotions_declined']``).

        Under LRU, requests cycling over more chunks than the tier holds would evict each
        chunk just before it is asked for again (no hit ever); this keeps a stable part of the
        cycle resident, and still lets a chunk asked for often displace a rarely asked one.
        Answers which chunks it stored (false: declined, or already held).
        """
        return await self._put(keys, chunks, selective=True)

    async def _put(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj], selective: bool) -> list[bool]:
        check_batch(keys, chunks, self._layout)
        batch = {key.digest for key in keys}
        fresh: list[tuple[ChunkKey, MemoryObj]] = []
        stored = [False] * len(keys)
        evicted: list[bytes] = []
        try:
            devices = set()
            for i, (key, chunk) in enumerate(zip(keys, chunks)):
                if key.digest in self._index:
                    continue
                if chunk.arena is self._arena:  # written in place (``reserve``): adopted, no copy
                    fresh.append((key, chunk.ref()))
                    stored[i] = True
                    continue
                obj = self._allocate(chunk.shape, chunk.dtype, batch, evicted, key.digest if selective else None)
                if obj is None:
                    self._counts["promotions_declined" if selective else "skipped_full"] += 1
                    continue
                if _copy(obj, chunk):
                    devices.add(obj.tensor.device if obj.tensor.is_cuda else chunk.tensor.device)
                fresh.append((key, obj))
                stored[i] = True
            await _copies_done(devices)
        except BaseException:
            for _, obj in fresh:
                obj.release()
            raise
        finally:
            self._evicted(evicted)
        self._admit(fresh)
        self._touch([key for key in keys if key.digest in self._index])
        return stored

    async def reserve(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Slots of a host arena for ``keys``' chunks, evicting as a put would (never one of
        ``keys``); a later ``put_many`` of them adopts them without a copy. None from the first
        key no slot can be freed for, and for every key of a device arena (a save gathers into
        host memory)."""
        out: list[MemoryObj | None] = [None] * len(keys)
        if self._arena.device.type != "cpu":
            return out
        protect = {key.digest for key in keys}
        evicted: list[bytes] = []
        try:
            for i, key in enumerate(keys):
                shape = self._layout.chunk_shape(key.num_tokens, len(key.layers))
                out[i] = self._allocate(shape, self._layout.dtype, protect, evicted)
                if out[i] is None:
                    self._counts["skipped_full"] += 1
                    break
        finally:
            self._evicted(evicted)
        return out

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        removed = []
        for key in keys:
            entry = self._index.get(key.digest)
            if entry is not None and entry.obj.pin_count == 0:
                del self._index[key.digest]
                entry.obj.release()
                removed.append(key.digest)
        self._evicted(removed)
        return len(removed)

    async def pin(self, keys: Sequence[ChunkKey]) -> int:
        entries = [e for e in map(self._index.get, (k.digest for k in keys)) if e is not None]
        for entry in entries:
            entry.obj.pin()
        return len(entries)

    async def unpin(self, keys: Sequence[ChunkKey]) -> int:
        entries = [e for e in map(self._index.get, (k.digest for k in keys)) if e is not None]
        pinned = [e for e in entries if e.obj.pin_count > 0]
        for entry in pinned:
            entry.obj.unpin()
        return len(pinned)

    def pinned(self) -> dict[bytes, int]:
        return {digest: e.obj.pin_count for digest, e in self._index.items() if e.obj.pin_count > 0}

    async def close(self) -> None:
        """Drop every chunk (pins included); objects still referenced elsewhere live until released."""
        index, self._index = self._index, OrderedDict()
        for entry in index.values():
            for _ in range(entry.obj.pin_count):
                entry.obj.unpin()
            entry.obj.release()
        self._evicted(list(index))

    # --- introspection ------------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        """Bytes of occupied slots (including evicted chunks still referenced) and the arena's capacity."""
        return self._arena.used_count * self._arena.slot_bytes, self._arena.capacity_bytes

    def keys(self) -> list[bytes]:
        return list(self._index)

    def stats(self) -> dict[str, int]:
        """evictions, skipped_full (puts that found no room), tokens_mismatches, chunks, and
        borrowed: stored chunks somebody else still references (a load in flight; 0 between steps)."""
        borrowed = sum(1 for e in list(self._index.values()) if e.obj.ref_count > 1)
        return {**self._counts, "chunks": len(self._index), "borrowed": borrowed}

    @property
    def arena(self) -> Arena:
        return self._arena

    # --- internals ----------------------------------------------------------------------
    def _lookup(self, key: ChunkKey) -> _Entry | None:
        entry = self._index.get(key.digest)
        if entry is not None and entry.tokens_digest != key.tokens_digest:
            self._counts["tokens_mismatches"] += 1
            return None
        return entry

    def _touch(self, keys: Iterable[ChunkKey]) -> None:
        """Mark keys most recently used, the batch's tail least recent of them (see module doc)."""
        for key in sorted(keys, key=lambda k: k.start, reverse=True):
            self._index.move_to_end(key.digest)

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, protect: set[bytes], evicted: list[bytes],
                  candidate: bytes | None = None) -> MemoryObj | None:
        """A free slot for a chunk of ``shape``, evicting as needed; None if nothing can be evicted,
        or (given the ``candidate``'s digest) if it was asked for no more often than the victim."""
        while True:
            obj = self._arena.allocate(shape, dtype)
            if obj is not None:
                return obj
            victim = self._victim(protect)
            if victim is None or (candidate is not None and self._asked[candidate] <= self._asked[victim]):
                return None
            self._index.pop(victim).obj.release()
            self._counts["evictions"] += 1
            evicted.append(victim)

    def _count_asks(self, keys: Sequence[ChunkKey]) -> None:
        self._asked.update(k.digest for k in keys)
        self._asks += len(keys)
        if self._asks > AGING * max(1, self._arena.num_slots):
            self._asked = Counter({d: n // 2 for d, n in self._asked.items() if n > 1})
            self._asks = 0

    def _victim(self, protect: set[bytes]) -> bytes | None:
        for digest, entry in self._index.items():
            if digest not in protect and entry.obj.ref_count == 1 and entry.obj.pin_count == 0:
                return digest
        return None

    def _admit(self, fresh: list[tuple[ChunkKey, MemoryObj]]) -> None:
        admitted = []
        for key, obj in fresh:
            if key.digest in self._index:  # a concurrent put of the same key landed first
                obj.release()
                continue
            self._index[key.digest] = _Entry(obj, key.tokens_digest)
            admitted.append(key.digest)
        self._admitted(admitted)


def _copy(dst: MemoryObj, src: MemoryObj) -> bool:
    """Copy ``src`` into ``dst``; True if issued asynchronously (host side pinned, one side CUDA)."""
    asynchronous = (dst.tensor.is_cuda or src.tensor.is_cuda) and _async_ok(dst) and _async_ok(src)
    dst.tensor.copy_(src.tensor, non_blocking=asynchronous)
    return asynchronous


def _async_ok(obj: MemoryObj) -> bool:
    return obj.tensor.is_cuda or obj.arena.pinned


async def _copies_done(devices: set[torch.device]) -> None:
    """Wait, without blocking the loop, for the copies issued on each device's current stream."""
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        while not event.query():
            await asyncio.sleep(_POLL_S)
