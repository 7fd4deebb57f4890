"""Chunk reads that arrive layer group by layer group, so loads overlap compute (ARCHITECTURE.md section 6).

A chunk is ``[layers, 2, tokens, kv_heads, head_dim]``, layer-major: the bytes of layers
``[lo, hi)`` are one contiguous slice of its payload. ``TierManager.stream_many`` opens a
``LayerStream`` for one step's loads: on the I/O loop it takes what the memory tiers hold
(whole chunks, at once), gives each chunk they lack to the first lower tier holding it
(``contains_prefix``), allocates a staging chunk for each and starts one
``StorageBackend.read_layers`` per lower tier, which fills them group by group of layers
(``layer_groups``) for all chunks at once. The caller (a loader thread) calls
``wait_layer(i)`` before copying layer i out, ``finish()`` for the verified prefixes (which
also promotes them), and ``release()`` once its copies are done.

Verification comes last: a lower tier checks a chunk's checksum once all its bytes arrived,
so early layers are used before their chunk is verified. A chunk that then fails ends the
verified prefix ``finish`` reports; the engine recomputes from there and discards what its
step computed over those tokens (the connector's failed-load path), so wrong KV never reaches
an output or a tier.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from kvlayer.io_loop import IOLoop
from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj
from kvlayer.memory import release_all as _release
from kvlayer.tier_guard import GuardedTier, TierFailure

log = logging.getLogger(__name__)

MIN_GROUP_BYTES = 256 << 10
"""The smallest slice of a chunk read per layer group: smaller reads cost more than they overlap."""

LayerGroups = list[tuple[int, int]]
Collect = Callable[[list[ChunkKey], int], Awaitable[tuple[list[MemoryObj | None], list[int]]]]
"""``collect(keys, n)``: per key, its chunk from the first ``n`` tiers that has it (or None) and that tier's index."""
Promote = Callable[[list[ChunkKey], list[MemoryObj], list[int]], None]


def layer_groups(num_layers: int, layer_bytes: int, min_bytes: int | None = None) -> LayerGroups:
    """Consecutive ranges ``[lo, hi)`` covering ``range(num_layers)``, each holding at least
    ``min_bytes`` (default ``MIN_GROUP_BYTES``) of a chunk whose layers are ``layer_bytes`` each."""
    min_bytes = MIN_GROUP_BYTES if min_bytes is None else min_bytes
    per = max(1, -(-min_bytes // max(1, layer_bytes)))
    return [(lo, min(lo + per, num_layers)) for lo in range(0, num_layers, per)]


@dataclass(eq=False)
class _Read:
    """One lower tier's share of the stream: ``keys[i]`` lands in ``outs[i]``."""

    index: int
    tier: GuardedTier
    keys: list[ChunkKey] = field(default_factory=list)
    outs: list[MemoryObj] = field(default_factory=list)
    groups_done: int = 0
    ok: list[bool] | None = None
    task: asyncio.Future[None] | None = None


class LayerStream:
    """One step's chunks for several key lists, arriving layer group by layer group.

    ``objs[r]``: request r's candidate chunks (a prefix of its keys), valid to read layer i of
    once ``wait_layer(i)`` returned. The stream owns one reference to each until ``release``.
    Call ``wait_layer``/``finish``/``release`` from one thread other than the I/O loop's.
    """

    def __init__(self, requests: Sequence[Sequence[ChunkKey]], groups: LayerGroups, loop: IOLoop | None,
                 timeout: float, promote: Promote | None = None) -> None:
        self.keys = [list(keys) for keys in requests]
        self.groups = list(groups)
        self.objs: list[list[MemoryObj]] = [[] for _ in self.keys]
        self._sources: list[list[int]] = [[] for _ in self.keys]
        self._reads: list[_Read] = []
        self._tiers: list[GuardedTier] = []
        self._placed: dict[int, tuple[_Read, int]] = {}
        """``id(obj)`` of a lower-tier candidate -> its read and position there."""
        self._loop = loop
        self._timeout = timeout
        self._promote = promote
        self._group_of = [g for g, (lo, hi) in enumerate(self.groups) for _ in range(lo, hi)]
        self._done = [threading.Event() for _ in self.groups]
        self._released = False
        if loop is None:  # nothing to read (an empty or failed open)
            self._mark_all_done()

    @classmethod
    def empty(cls, requests: Sequence[Sequence[ChunkKey]], groups: LayerGroups) -> LayerStream:
        """A stream with no candidates (every request a miss)."""
        return cls([[] for _ in requests], groups, None, 0.0)

    # --- the loader thread's side -----------------------------------------------------------
    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` of every candidate is written (or its read failed);
        False if that took longer than ``timeout`` (default: the stream's own), the layer then
        holding garbage."""
        return self._done[self._group_of[layer]].wait(self._timeout if timeout is None else timeout)

    def finish(self) -> list[int]:
        """Wait for the reads; per request, how many leading candidates are verified.

        Counts each tier's hits, and hands the verified chunks to the stream's ``promote``
        (which copies those of lower tiers up). A read still running after the timeout counts
        as failed.
        """
        pending = [r.task for r in self._reads if r.task is not None]
        if pending and self._loop is not None:
            try:
                self._loop.run(_wait_all(pending), self._timeout)
            except TimeoutError:
                log.warning("kvlayer: layer reads did not finish within %.1f s; treated as misses", self._timeout)
        counts = []
        for keys, objs, sources in zip(self.keys, self.objs, self._sources):
            n = 0
            while n < len(objs) and self._verified(objs[n]):
                n += 1
            counts.append(n)
            for key, src in zip(keys[:n], sources[:n]):  # tokens served, credited to their tier
                self._tiers[src].metrics.inc("hit_tokens", key.num_tokens)
            if self._promote is not None and n:
                self._promote(keys[:n], objs[:n], sources[:n])
        for r in self._reads:
            hits = [i for i, ok in enumerate(r.ok or ()) if ok]
            r.tier.metrics.inc("get_chunks", len(hits))
            r.tier.metrics.inc("get_bytes", sum(r.outs[i].nbytes for i in hits))
        return counts

    def release(self) -> None:
        """Drop the stream's references (idempotent); the chunks of a read still running (after
        a timeout) are released on the I/O loop once it is over."""
        if self._released:
            return
        self._released = True
        busy = [r for r in self._reads if r.task is not None and not r.task.done()]
        later = {id(o) for r in busy for o in r.outs}
        for objs in self.objs:
            _release([o for o in objs if id(o) not in later])
        if busy and self._loop is not None:
            try:
                self._loop.loop.call_soon_threadsafe(_release_when_done, busy)
            except RuntimeError:  # the loop is closed: its reads are over
                _release([o for r in busy for o in r.outs])

    # --- the I/O loop's side --------------------------------------------------------------------
    async def open(self, tiers: Sequence[GuardedTier], collect: Collect,
                   allocate: Callable[[ChunkKey], MemoryObj | None]) -> LayerStream:
        """Take the memory tiers' chunks, place the rest in lower tiers and start their reads."""
        self._tiers = list(tiers)
        top = next((i for i, t in enumerate(tiers) if not t.in_memory), len(tiers))
        found = await asyncio.gather(*(collect(keys, top) for keys in self.keys), return_exceptions=True)
        try:
            for f in found:
                if isinstance(f, BaseException):
                    raise f
            owner: list[list[_Read | None]] = [[None] * len(keys) for keys in self.keys]
            for index in range(top, len(tiers)):
                if tiers[index].usable():
                    await self._place(_Read(index, tiers[index]), found, owner)  # type: ignore[arg-type]
        except BaseException:
            _release(o for f in found if not isinstance(f, BaseException) for o in f[0] if o is not None)
            raise
        for r, (keys, (got, sources)) in enumerate(zip(self.keys, found)):  # type: ignore[misc]
            self._take(r, keys, got, sources, owner[r], allocate)
        for read in self._reads:
            read.task = asyncio.ensure_future(self._run_read(read))
        if not self._reads:
            self._mark_all_done()
        return self

    async def _place(self, read: _Read, found: list[tuple[list[MemoryObj | None], list[int]]],
                     owner: list[list[_Read | None]]) -> None:
        """Give ``read`` the leading chunks its tier holds of each request's still-missing ones."""
        missing = [[j for j, obj in enumerate(got) if obj is None and owner[r][j] is None]
                   for r, (got, _) in enumerate(found)]

        async def held(r: int) -> int:
            if not missing[r]:
                return 0
            keys = [self.keys[r][j] for j in missing[r]]
            try:
                return await read.tier.call("contains_prefix", read.tier.backend.contains_prefix(keys))
            except TierFailure:
                return 0

        counts = await asyncio.gather(*(held(r) for r in range(len(self.keys))))
        for r, n in enumerate(counts):
            for j in missing[r][:n]:
                owner[r][j] = read
        if any(counts):
            self._reads.append(read)

    def _take(self, r: int, keys: list[ChunkKey], got: list[MemoryObj | None], sources: list[int],
              owner: list[_Read | None], allocate: Callable[[ChunkKey], MemoryObj | None]) -> None:
        """Request ``r``'s candidates: its keys in order while each is held or placed and staged."""
        n = 0
        while n < len(keys):
            obj, read = got[n], owner[n]
            if obj is None and read is not None:
                obj = allocate(keys[n])
                if obj is not None:
                    self._placed[id(obj)] = (read, len(read.keys))
                    read.keys.append(keys[n])
                    read.outs.append(obj)
                    sources[n] = read.index
            if obj is None:
                break
            self.objs[r].append(obj)
            self._sources[r].append(sources[n])
            n += 1
        _release([o for o in got[n:] if o is not None])

    async def _run_read(self, read: _Read) -> None:
        def on_group(g: int) -> None:
            read.groups_done = max(read.groups_done, g + 1)
            self._progress()

        try:
            ok = await read.tier.call("read_layers", read.tier.backend.read_layers(
                read.keys, read.outs, self.groups, on_group))
            if len(ok) != len(read.keys):
                raise ValueError(f"read_layers answered {len(ok)} flags for {len(read.keys)} keys")
            read.ok = [bool(x) for x in ok]
        except (TierFailure, ValueError) as e:
            if isinstance(e, ValueError):
                log.error("kvlayer tier %s: %s", read.tier.name, e)
            read.ok = [False] * len(read.keys)
        finally:
            read.groups_done = len(self.groups)
            self._progress()

    def _progress(self) -> None:
        done = min((r.groups_done for r in self._reads), default=len(self.groups))
        for event in self._done[:done]:
            event.set()

    def _mark_all_done(self) -> None:
        for event in self._done:
            event.set()

    def _verified(self, obj: MemoryObj) -> bool:
        placed = self._placed.get(id(obj))
        if placed is None:
            return True  # a memory tier's chunk
        read, i = placed
        return read.ok is not None and read.ok[i]


async def _wait_all(tasks: list[asyncio.Future[None]]) -> None:
    await asyncio.wait(tasks)


def _release_when_done(reads: list[_Read]) -> None:
    """On the loop: release each read's chunks now, or once its task is over."""
    for r in reads:
        outs = list(r.outs)
        if r.task is None or r.task.done():
            _release(outs)
        else:
            r.task.add_done_callback(lambda _t, outs=outs: _release(outs))
