"""The read path of a hit: each chunk read from the tier the lookup found it in (docs/architecture.md section 6).

A ``ReadPlan`` is one request's chunks to load and, per chunk, the tier to read it from: the
answer of ``TierManager.lookup`` (``LookupResult.sources``), so a load never asks a tier again
whether it holds a chunk. ``ChunkReads.open(tiers, plans, staging, groups)`` starts one step's
reads on the I/O loop, top down:

1. each memory tier (gpu, cpu) answers one ``get_many`` for all the plans' chunks it holds:
   whole chunks, at once;
2. each plan's chunks are taken in order while every one is there: a memory tier's chunk, or a
   staging chunk (``Staging.allocate``) for a lower tier to fill; the first chunk missing from
   its tier, or the first staging chunk that cannot be had, ends the plan's candidates;
3. each lower tier (nvme, redis) runs one ``StorageBackend.read_layers`` for all its
   candidates, which fills them layer group by layer group (``layer_groups``); the objects of
   a hybrid model's layer groups (``ChunkKey.layers``, ``kvlayer.windows``) are read whole, in
   a read of their own.

The caller (a loader thread) calls ``wait_layer(i)`` before it copies layer i out, ``finish()``
for each plan's verified prefix (counted as hits, the lower tiers' chunks then promoted into
the tiers above theirs by ``TierManager.promote``), and ``release()`` once its copies are done.

Verification comes last: a lower tier checks a chunk's checksum once all its bytes arrived, so
early layers are used before their chunk is verified. A chunk that then fails ends the
verified prefix ``finish`` reports; the engine recomputes from there and discards what its step
computed over those tokens (the connector's failed-load path), so wrong KV never reaches an
output or a tier. A chunk evicted between the lookup and the read is a miss in the same way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj
from kvlayer.memory import release_all as _release
from kvlayer.staging import Staging
from kvlayer.tier_guard import GuardedTier, TierFailure
from kvlayer.tier_manager import TierManager

log = logging.getLogger(__name__)

MIN_GROUP_BYTES = 256 << 10
"""The smallest slice of a chunk read per layer group: smaller reads cost more than they overlap."""

LayerGroups = list[tuple[int, int]]


def layer_groups(num_layers: int, layer_bytes: int, min_bytes: int | None = None) -> LayerGroups:
    """Consecutive ranges ``[lo, hi)`` covering ``range(num_layers)``, each holding at least
    ``min_bytes`` (default ``MIN_GROUP_BYTES``) of a chunk whose layers are ``layer_bytes`` each."""
    min_bytes = MIN_GROUP_BYTES if min_bytes is None else min_bytes
    per = max(1, -(-min_bytes // max(1, layer_bytes)))
    return [(lo, min(lo + per, num_layers)) for lo in range(0, num_layers, per)]


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Read ``keys`` (consecutive chunks of one request), ``keys[i]`` from tier ``sources[i]``
    (an index into ``TierManager.tier_names``); ``len(sources) == len(keys)``."""

    keys: tuple[ChunkKey, ...]
    sources: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.sources):
            raise ValueError(f"{len(self.keys)} keys but {len(self.sources)} sources")


@dataclass(eq=False)
class _Read:
    """One lower tier's share of the step: ``keys[i]`` lands in ``outs[i]``."""

    tier: GuardedTier
    layers: int = 0
    """The layers of each of its chunk objects: 0 for every layer, else a layer group's count."""
    keys: list[ChunkKey] = field(default_factory=list)
    outs: list[MemoryObj] = field(default_factory=list)
    groups_done: int = 0
    ok: list[bool] | None = None
    task: asyncio.Future[None] | None = None


@dataclass(eq=False)
class _Candidate:
    """A chunk of a plan: its object, its tier's index, and (a lower tier's) its read and position."""

    obj: MemoryObj
    source: int
    read: _Read | None = None
    index: int = 0

    def verified(self) -> bool:
        return self.read is None or (self.read.ok is not None and self.read.ok[self.index])


class ChunkReads:
    """One step's reads for several plans, arriving layer group by layer group.

    ``objs[r]``: plan r's candidate chunks (a prefix of its keys), valid to read layer i of once
    ``wait_layer(i)`` returned. The reads own one reference to each until ``release``. Call
    ``wait_layer``/``finish``/``release`` from one thread other than the I/O loop's.
    """

    def __init__(self, tiers: TierManager, plans: Sequence[ReadPlan], groups: LayerGroups) -> None:
        self.plans = list(plans)
        self.groups = list(groups)
        self._tiers = tiers
        self._guarded = tiers.guarded
        self._candidates: list[list[_Candidate]] = [[] for _ in self.plans]
        self._reads: list[_Read] = []
        self._group_of = [g for g, (lo, hi) in enumerate(self.groups) for _ in range(lo, hi)]
        self._done = [threading.Event() for _ in self.groups]
        self._released = False

    @classmethod
    def open(cls, tiers: TierManager, plans: Sequence[ReadPlan], staging: Staging,
             groups: LayerGroups) -> ChunkReads:
        """Start reading every plan's chunks (see the module docstring). A timeout while opening
        leaves every plan without candidates (a miss); an error below propagates, with every
        reference already dropped."""
        if not any(plan.keys for plan in plans):
            return cls._nothing(tiers, plans, groups)
        reads = cls(tiers, plans, groups)
        return tiers.run(reads._open(staging), "load", cls._nothing(tiers, plans, groups), ChunkReads.release)

    @classmethod
    def _nothing(cls, tiers: TierManager, plans: Sequence[ReadPlan], groups: LayerGroups) -> ChunkReads:
        reads = cls(tiers, plans, groups)
        reads._mark_all_done()
        return reads

    @property
    def objs(self) -> list[list[MemoryObj]]:
        return [[c.obj for c in cands] for cands in self._candidates]

    # --- the loader thread's side -----------------------------------------------------------
    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` of every candidate is written (or its read failed);
        False if that took longer than ``timeout`` (default: the tier manager's operation
        timeout), the layer then holding garbage."""
        return self._done[self._group_of[layer]].wait(self._tiers.op_timeout if timeout is None else timeout)

    def finish(self, credit: bool = True) -> list[int]:
        """Wait for the reads; per plan, how many leading candidates are verified.

        With ``credit`` (a hit's reads; not a verification's, ``kvlayer.verify``) credits each
        verified chunk's tokens to its tier (``hit_tokens``) and has the tier manager promote
        the lower tiers' verified chunks into the tiers above theirs. A read still running
        after the timeout counts as failed.
        """
        pending = [r.task for r in self._reads if r.task is not None]
        if pending:
            try:
                self._tiers.loop.run(asyncio.wait(pending), self._tiers.op_timeout)
            except TimeoutError:
                log.warning("kvlayer: layer reads did not finish within %.1f s; treated as misses",
                            self._tiers.op_timeout)
        counts = []
        for plan, cands in zip(self.plans, self._candidates):
            n = 0
            while n < len(cands) and cands[n].verified():
                n += 1
            counts.append(n)
            if not credit:
                continue
            for key, cand in zip(plan.keys, cands[:n]):
                self._guarded[cand.source].metrics.inc("hit_tokens", key.num_tokens)
            if n:
                self._tiers.promote(plan.keys[:n], [c.obj for c in cands[:n]], [c.source for c in cands[:n]])
        for r in self._reads:
            hits = [i for i, ok in enumerate(r.ok or ()) if ok]
            r.tier.metrics.inc("get_chunks", len(hits))
            r.tier.metrics.inc("get_bytes", sum(r.outs[i].nbytes for i in hits))
        return counts

    def release(self) -> None:
        """Drop the reads' references (idempotent); the chunks of a read still running (after a
        timeout) are released on the I/O loop once it is over."""
        if self._released:
            return
        self._released = True
        busy = [r for r in self._reads if r.task is not None and not r.task.done()]
        later = {id(o) for r in busy for o in r.outs}
        _release(c.obj for cands in self._candidates for c in cands if id(c.obj) not in later)
        if busy:
            try:
                self._tiers.loop.loop.call_soon_threadsafe(_release_when_done, busy)
            except RuntimeError:  # the loop is closed: its reads are over
                _release(o for r in busy for o in r.outs)

    # --- the I/O loop's side --------------------------------------------------------------------
    async def _open(self, staging: Staging) -> ChunkReads:
        tiers = self._guarded
        wanted: dict[int, dict[bytes, ChunkKey]] = {}  # memory tier -> its chunks, once each
        for plan in self.plans:
            for key, src in zip(plan.keys, plan.sources):
                if tiers[src].in_memory:
                    wanted.setdefault(src, {})[key.digest] = key
        gets = [_get_all(tiers[src], list(keys.values())) for src, keys in wanted.items()]
        fetched = [await gets[0]] if len(gets) == 1 else await asyncio.gather(*gets)  # one: without a task
        found = {(src, digest): obj for (src, keys), got in zip(wanted.items(), fetched)
                 for digest, obj in zip(keys, got)}
        reads: dict[tuple[int, int], _Read] = {}  # one read per lower tier and chunk object shape
        try:
            for plan, cands in zip(self.plans, self._candidates):
                for key, src in zip(plan.keys, plan.sources):
                    cand = self._candidate(key, src, found, reads, staging)
                    if cand is None:
                        break
                    cands.append(cand)
        except BaseException:
            self.release()
            raise
        finally:
            _release(o for o in found.values() if o is not None)  # candidates took their own references
        self._reads = list(reads.values())
        for read in self._reads:
            read.task = asyncio.ensure_future(self._run_read(read))
        if not self._reads:
            self._mark_all_done()
        return self

    def _candidate(self, key: ChunkKey, src: int, found: dict[tuple[int, bytes], MemoryObj | None],
                   reads: dict[tuple[int, int], _Read], staging: Staging) -> _Candidate | None:
        tier = self._guarded[src]
        if tier.in_memory:
            obj = found.get((src, key.digest))
            return None if obj is None else _Candidate(obj.ref(), src)
        if not tier.usable():
            return None
        out = staging.allocate(key)
        if out is None:
            return None
        read = reads.setdefault((src, len(key.layers)), _Read(tier, len(key.layers)))
        read.keys.append(key)
        read.outs.append(out)
        return _Candidate(out, src, read, len(read.keys) - 1)

    async def _run_read(self, read: _Read) -> None:
        def on_group(g: int) -> None:
            read.groups_done = max(read.groups_done, g + 1)
            self._progress()

        # a layer group's objects hold some layers only: read whole, their layers ready at the end
        groups = self.groups if not read.layers else [(0, read.layers)]
        try:
            ok = await read.tier.call("read_layers", read.tier.backend.read_layers(
                read.keys, read.outs, groups, on_group if not read.layers else lambda g: None))
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


async def _get_all(tier: GuardedTier, keys: list[ChunkKey]) -> list[MemoryObj | None]:
    """One memory tier's chunks for ``keys`` (None for each miss; every key a miss if it fails)."""
    if not tier.usable():
        return [None] * len(keys)
    try:
        return await tier.get_many(keys)
    except TierFailure:
        return [None] * len(keys)


def _release_when_done(reads: list[_Read]) -> None:
    """On the loop: release each read's chunks now, or once its task is over."""
    for r in reads:
        outs = list(r.outs)
        if r.task is None or r.task.done():
            _release(outs)
        else:
            r.task.add_done_callback(lambda _t, outs=outs: _release(outs))
