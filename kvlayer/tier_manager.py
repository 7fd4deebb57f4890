"""``TierManager``: the tiers seen as one prefix store, from the engine thread.

Each call runs coroutines on the ``IOLoop`` and waits only for what the caller needs now
(docs/architecture.md section 5):

- ``lookup``: the longest prefix of keys present in the union of the tiers (chunk i may be in
  one tier and chunk i+1 in another). Rounds ask the usable tiers ``contains_prefix(rest)``
  (the memory tiers first, the others together only if the memory tiers lack part of
  ``rest``) and advance by the best answer, until no tier advances.
  Each found chunk's tier is in ``LookupResult.sources``: the read path (``kvlayer.read_plan``)
  reads it from there without asking again.
- ``promote``: chunks a load verified from a lower tier are put into every tier above theirs in
  the background (through each memory tier's admission policy).
- ``store``: puts into the top tier now when it is a memory tier, and writes through to the
  other tiers in the background (skipping the leading keys a tier already holds).

Failures (``kvlayer.tier_guard``): every backend call has the deadline
``config.tier_timeout_ms``; an exception or a timeout is a miss for that tier (for that chunk
and every later one in the call), a counter and a rate-limited log line, never an exception
for the caller; a tier failing ``config.unhealthy_after`` times in a row is skipped until its
backoff expires (``kvlayer.health``). A failing tier costs a call at most one deadline; as a
last guard against a blocked loop, a call gives up (a miss) after (tiers + 1) deadlines.

The admin operations (listing, copying, pinning, removing) are ``kvlayer.tier_admin``'s,
called through ``KVCacheEngine``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from kvlayer.config import KVLayerConfig
from kvlayer.health import Clock, LogThrottle
from kvlayer.io_loop import IOLoop
from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj
from kvlayer.memory import release_all as _release
from kvlayer.metrics import Metrics
from kvlayer.storage import StorageBackend
from kvlayer.tier_guard import LOG_EVERY_S, GuardedTier

log = logging.getLogger(__name__)

T = TypeVar("T")
VERIFY_COUNTERS = ("verified_hits", "verify_mismatches")
"""Per-tier counters of sampled hit verification (``kvlayer.verify``) also summed in ``stats()``."""
_Plan = list[tuple[GuardedTier, list[ChunkKey], list[MemoryObj]]]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The cached prefix: ``num_chunks`` leading keys (``num_tokens`` tokens); per tier name,
    how many of them were found first (topmost) in that tier (every asked tier listed); and
    ``sources[i]``, the index (in ``TierManager.tier_names``) of the tier chunk i was found in."""

    num_chunks: int
    num_tokens: int
    per_tier: dict[str, int]
    sources: tuple[int, ...] = ()


class TierManager:
    """Synchronous tiered store for the engine thread; see the module docstring for the policy.

    ``backends`` (distinct names) are ordered by ``rank``, top first. The manager uses but does
    not own ``loop``: close the manager, then the loop. Never call it on the loop thread.
    """

    def __init__(self, backends: Sequence[StorageBackend], loop: IOLoop, config: KVLayerConfig,
                 metrics: Metrics, clock: Clock = time.monotonic) -> None:
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        deadline = config.tier_timeout_ms / 1000
        backoff = (config.unhealthy_backoff_ms / 1000, config.unhealthy_backoff_max_ms / 1000)
        self._tiers = [GuardedTier(b, metrics.tier(b.name), deadline, config.unhealthy_after, clock, backoff)
                       for b in sorted(backends, key=lambda b: b.rank)]
        self._loop = loop
        self._metrics = metrics
        self._deadline = deadline
        self._op_timeout = deadline * (len(self._tiers) + 1)
        self._op_throttle = LogThrottle(LOG_EVERY_S, clock=clock)
        self._idle = threading.Condition()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closed = False
        metrics.set_gauge_source(self._gauges)

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    @property
    def guarded(self) -> list[GuardedTier]:
        """The tiers behind their guards, top first (index i is ``LookupResult.sources``' i)."""
        return list(self._tiers)

    @property
    def metrics(self) -> Metrics:
        """The counters every tier and load reports to."""
        return self._metrics

    @property
    def loop(self) -> IOLoop:
        return self._loop

    @property
    def op_timeout(self) -> float:
        """The last-guard timeout of one operation: (tiers + 1) tier deadlines."""
        return self._op_timeout

    # --- the engine-facing calls --------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey], record: bool = True) -> LookupResult:
        """How many leading ``keys`` the tiers hold together; no data moves; never raises for a tier.

        ``record=False`` leaves the lookup counters alone (an internal presence check).
        """
        return self.lookup_many([keys], record)[0]

    def lookup_many(self, requests: Sequence[Sequence[ChunkKey]], record: bool = True) -> list[LookupResult]:
        """``lookup`` for several key lists, answered together in one trip to the I/O loop."""
        lists = [list(keys) for keys in requests]
        miss = [LookupResult(0, 0, {}) for _ in lists]
        if not any(lists):
            return miss
        return self.run(self._lookup_all(lists, record), "lookup", miss)

    def store(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        """Store ``chunks[i]`` under ``keys[i]`` in every tier; returns once the top memory tier has them.

        The caller keeps its references and may release them as soon as this returns (the
        manager holds its own for the background writes). ``ValueError`` if lengths differ.
        """
        keys, chunks = list(keys), list(chunks)
        if len(keys) != len(chunks):
            raise ValueError(f"{len(keys)} keys but {len(chunks)} chunks")
        self._check_open()
        if not keys or not self._tiers:
            return
        top = self._tiers[0] if self._tiers[0].in_memory else None
        if top is not None:
            self.run(top.put(keys, chunks, skip_present=False), "store", None)
        rest = [t for t in self._tiers if t is not top]
        if rest:
            self._background(self._write_through(rest, keys, chunks), chunks)

    def reserve(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Memory of the top memory tier for chunks about to be ``store``d, written in place so the
        store adopts them without a copy (``StorageBackend.reserve``; one reference each, the
        caller's). None for each key it cannot give (no memory tier on top, a device one, full,
        failing): the caller then stages that chunk in its own memory."""
        keys = list(keys)
        miss: list[MemoryObj | None] = [None] * len(keys)
        self._check_open()
        if not keys or not self._tiers or not self._tiers[0].in_memory:
            return miss
        return self.run(self._tiers[0].reserve(keys), "reserve", miss,
                        discard=lambda objs: _release(o for o in objs if o is not None))

    def warm_up(self) -> None:
        """Let every tier do its start-up work (e.g. the NVMe index scan) in the background now."""
        self._check_open()
        if self._tiers:
            self._background(self._warm_up(), [])

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until background writes and promotions are done (their references released);
        False if ``timeout`` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def stats(self) -> dict[str, Any]:
        """Plain data: ``{"tiers": {name: {<every counter and histogram of kvlayer.metrics>,
        rank, in_memory, used_bytes, capacity_bytes, health: {...}, backend: {...}}},
        "pending_writes": int, "loaded_tokens": {layer group: tokens}, "verified_hits": int,
        "verify_mismatches": int}`` (the last two summed over the tiers; ``backend`` is the
        backend's own ``stats()``; ``loaded_tokens`` counts the tokens whose KV loads wrote into
        the engine's cache, per ``WindowGroup.name``)."""
        tiers = {}
        for t in self._tiers:
            t.sync_stats()
            used, capacity = t.backend.usage()
            tiers[t.name] = {**t.metrics.snapshot(), "rank": t.backend.rank, "in_memory": t.in_memory,
                             "used_bytes": used, "capacity_bytes": capacity, "health": t.health.snapshot(),
                             "backend": t.backend.stats()}
        with self._idle:
            pending = len(self._pending)
        return {"tiers": tiers, "pending_writes": pending, "loaded_tokens": self._metrics.loaded_tokens(),
                **{name: sum(t[name] for t in tiers.values()) for name in VERIFY_COUNTERS}}

    def close(self, timeout: float | None = None) -> None:
        """Wait for background writes (up to ``timeout`` s), then close every backend; idempotent."""
        if self._closed:
            return
        if not self.flush(timeout):
            log.warning("kvlayer: closing with background writes still running")
        self.run(self._close_all(), "close", None)
        self._closed = True
        self._metrics.set_gauge_source(None)

    # --- coroutines on the loop ---------------------------------------------------------
    async def _lookup_all(self, lists: list[list[ChunkKey]], record: bool) -> list[LookupResult]:
        miss = LookupResult(0, 0, {})
        if len(lists) == 1:  # the common case, without gather's task
            return [await self._lookup(lists[0], record) if lists[0] else miss]
        return list(await asyncio.gather(*(self._lookup(keys, record) if keys else _value(miss) for keys in lists)))

    async def _lookup(self, keys: list[ChunkKey], record: bool) -> LookupResult:
        tiers = [t for t in self._tiers if t.usable()]
        for t in tiers if record else ():
            t.metrics.inc("lookups")
            t.metrics.inc("lookup_chunks", len(keys))
        per_tier = {t.name: 0 for t in tiers}
        sources: list[int] = []
        n = 0
        while n < len(keys) and tiers:
            counts = await self._contains_round(tiers, keys[n:])
            tiers = [t for t in tiers if t in counts]
            covered = 0
            for t in tiers:  # chunk i is found first in the topmost tier holding more than i
                if counts[t] > covered:
                    if record:
                        t.metrics.inc("lookup_hit_chunks", counts[t] - covered)
                    per_tier[t.name] += counts[t] - covered
                    sources += [self._tiers.index(t)] * (counts[t] - covered)
                    covered = counts[t]
            if covered == 0:
                break
            n += covered
        return LookupResult(n, sum(k.num_tokens for k in keys[:n]), per_tier, tuple(sources))

    async def _contains_round(self, tiers: list[GuardedTier], rest: list[ChunkKey]) -> dict[GuardedTier, int]:
        """Each tier's leading count of ``rest`` (0 if it was not asked); failed tiers are left out."""
        counts: dict[GuardedTier, int] = {}
        for wave in ([t for t in tiers if t.in_memory], [t for t in tiers if not t.in_memory]):
            if max(counts.values(), default=0) >= len(rest):
                counts.update(dict.fromkeys(wave, 0))
                continue
            answers = await _gather_answers([t.call("contains_prefix", t.backend.contains_prefix(rest)) for t in wave])
            for t, answer in zip(wave, answers):
                if not isinstance(answer, BaseException):
                    counts[t] = max(0, min(int(answer), len(rest)))
        return counts

    async def _write_through(self, tiers: list[GuardedTier], keys: list[ChunkKey],
                             chunks: list[MemoryObj]) -> None:
        await asyncio.gather(*(t.put(keys, chunks, skip_present=True) for t in tiers))

    async def _promote_into(self, plan: _Plan) -> None:
        await asyncio.gather(*(t.put(k, c, skip_present=False, promote=True, counter="promotions")
                               for t, k, c in plan))

    async def _warm_up(self) -> None:
        calls = (t.call("contains_prefix", t.backend.contains_prefix([])) for t in self._tiers)
        await asyncio.gather(*calls, return_exceptions=True)

    async def _close_all(self) -> None:
        calls = (asyncio.wait_for(t.backend.close(), self._deadline) for t in self._tiers)
        answers = await asyncio.gather(*calls, return_exceptions=True)
        for t, answer in zip(self._tiers, answers):
            if isinstance(answer, BaseException):
                log.warning("kvlayer tier %s: close failed: %r", t.name, answer)

    # --- engine-thread helpers ----------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T], what: str, miss: T,
            discard: Callable[[T], None] | None = None, timeout: float | None = None) -> T:
        """Run ``coro`` on the I/O loop and return its result; after ``timeout`` seconds (default:
        the last-guard ``op_timeout``), ``miss`` (logged as ``what``), and ``discard(result)`` if
        it finishes later. Its exceptions propagate; ``RuntimeError`` once closed."""
        if self._closed:
            coro.close()
            raise RuntimeError("the TierManager is closed")
        limit = self._op_timeout if timeout is None else timeout
        try:
            return self._loop.run(coro, limit, discard)
        except TimeoutError:
            if self._op_throttle.allow():
                log.warning("kvlayer: %s did not finish within %.1f s (is the I/O loop blocked?); "
                            "treated as a miss", what, limit)
            return miss

    def _background(self, job: Coroutine[Any, Any, None], hold: Sequence[MemoryObj]) -> None:
        """Run ``job`` on the loop, holding one reference to each of ``hold`` until it is done."""
        held = [obj.ref() for obj in hold]
        try:
            fut = self._loop.submit(job)
        except BaseException:
            _release(held)
            raise
        with self._idle:
            self._pending.add(fut)
        # Called once the job's task is over (finished, failed or cancelled, even before it
        # started), so the references are no longer in use when they are released.
        fut.add_done_callback(partial(self._job_done, held))

    def _job_done(self, held: list[MemoryObj], fut: concurrent.futures.Future[Any]) -> None:
        _release(held)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("kvlayer background write failed", exc_info=fut.exception())
        with self._idle:
            self._pending.discard(fut)
            self._idle.notify_all()

    def promote(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj], sources: Sequence[int]) -> None:
        """Start putting each chunk ``objs[j]`` (read from tier ``sources[j]``) into every tier above
        its source, in the background; the caller keeps its references."""
        plan: _Plan = []
        for i, tier in enumerate(self._tiers):
            idx = [j for j, s in enumerate(sources) if s > i]
            if idx:
                plan.append((tier, [keys[j] for j in idx], [objs[j] for j in idx]))
        if plan:
            self._background(self._promote_into(plan), [objs[j] for j, s in enumerate(sources) if s > 0])

    def select(self, tier: str | None) -> list[GuardedTier]:
        """The guarded tier named ``tier`` (every tier if None); ``ValueError`` for an unknown name."""
        if tier is None:
            return list(self._tiers)
        chosen = [t for t in self._tiers if t.name == tier]
        if not chosen:
            raise ValueError(f"unknown tier {tier!r}; tiers: {self.tier_names}")
        return chosen

    def _gauges(self) -> dict[str, dict[str, float]]:
        out = {}
        for t in self._tiers:
            used, capacity = t.backend.usage()
            out[t.name] = {"used_bytes": used, "capacity_bytes": capacity, "healthy": float(t.health.healthy)}
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the TierManager is closed")


async def _value(value: T) -> T:
    return value


async def _gather_answers(calls: list[Coroutine[Any, Any, T]]) -> list[T | BaseException]:
    """``asyncio.gather(*calls, return_exceptions=True)``, awaiting a single call in place."""
    if len(calls) == 1:
        try:
            return [await calls[0]]
        except Exception as e:  # as gather would hand it back
            return [e]
    return list(await asyncio.gather(*calls, return_exceptions=True))
