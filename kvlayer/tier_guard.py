"""``GuardedTier``: one storage backend behind a deadline, a health state and counters.

The tier manager and the read path make every backend call through ``GuardedTier.call`` (or
its ``get_many``/``put`` forms, which check the backend's answer and count what moved): the call
gets the deadline; an exception or a timeout is counted (``errors``/``timeouts``), fed to the tier's
``TierHealth``, logged at most once per ``LOG_EVERY_S`` per tier, and raised as
``TierFailure`` for the manager to turn into a miss. Runs on the I/O loop, except
``sync_stats``, which any thread may call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from kvlayer.health import Clock, LogThrottle, TierHealth
from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj, release_all
from kvlayer.metrics import TierMetrics
from kvlayer.storage import StorageBackend

log = logging.getLogger(__name__)

T = TypeVar("T")
LOG_EVERY_S = 30.0
_HISTOGRAM_OF = {"get_many": "get_seconds", "read_layers": "get_seconds", "put_many": "put_seconds"}
_SYNCED_STATS = ("evictions", "checksum_errors", "promotions_declined")
"""Backend ``stats()`` counters mirrored into the tier's metrics."""


class TierFailure(Exception):
    """A tier call failed or timed out (already counted and logged)."""


class GuardedTier:
    """``backend`` with its health, metrics and log throttle; ``deadline_s`` bounds every call;
    ``backoff_s`` is the unhealthy tier's first and longest wait before a probe."""

    def __init__(self, backend: StorageBackend, metrics: TierMetrics, deadline_s: float,
                 unhealthy_after: int, clock: Clock = time.monotonic,
                 backoff_s: tuple[float, float] = (1.0, 30.0)) -> None:
        self.backend = backend
        self.name = backend.name
        self.metrics = metrics
        self.health = TierHealth(unhealthy_after, *backoff_s, clock=clock)
        self._deadline = deadline_s
        self._throttle = LogThrottle(LOG_EVERY_S, clock=clock)
        self._lock = threading.Lock()
        self._seen_stats: dict[str, int] = {}

    @property
    def in_memory(self) -> bool:
        return self.backend.in_memory

    def usable(self) -> bool:
        """Whether calls may go to the tier now; a skip of an unhealthy tier is counted."""
        if self.health.available():
            return True
        self.metrics.inc("skipped_unhealthy")
        return False

    async def call(self, op: str, call: Awaitable[T]) -> T:
        """``await call`` (the backend's method ``op``) under the deadline.

        Raises ``TierFailure`` (counted, logged, fed to the health state) on any exception or
        timeout; records latency for get_many/put_many and a success otherwise.
        """
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self._deadline):  # in this task: no task per call, as wait_for makes
                result = await call
        except TimeoutError as e:
            self._failed("timeouts", op, f"no answer within {self._deadline:g} s")
            raise TierFailure from e
        except Exception as e:
            self._failed("errors", op, repr(e))
            raise TierFailure from e
        histogram = _HISTOGRAM_OF.get(op)
        if histogram is not None:
            self.metrics.observe(histogram, time.perf_counter() - start)
        if self.health.record_success():
            log.info("kvlayer tier %s is healthy again", self.name)
        self.sync_stats()
        return result

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """``backend.get_many(keys)`` under the deadline, its answer checked (one result per key:
        a wrong length is the backend's error) and its hits counted; the caller owns the chunks.
        ``TierFailure`` as for ``call``."""
        got = await self.call("get_many", self.backend.get_many(keys))
        if len(got) != len(keys):
            release_all(o for o in got if o is not None)
            self._failed("errors", "get_many", f"{len(got)} results for {len(keys)} keys")
            raise TierFailure
        hits = [o for o in got if o is not None]
        self.metrics.inc("get_chunks", len(hits))
        self.metrics.inc("get_bytes", sum(o.nbytes for o in hits))
        return got

    async def put(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj], *, skip_present: bool,
                  promote: bool = False, counter: str | None = None) -> None:
        """Store ``chunks`` under ``keys`` (after the leading keys the tier holds if ``skip_present``;
        through the tier's admission policy if ``promote``), counting what it stored in
        ``put_chunks``/``put_bytes`` (and ``counter``). A failure or an unusable tier is a miss:
        nothing is raised. The caller keeps its references."""
        if not self.usable():
            return
        stored: list[bool] | None = None
        try:
            n = await self.call("contains_prefix", self.backend.contains_prefix(keys)) if skip_present else 0
            if n < len(keys):
                put = self.backend.promote_many if promote else self.backend.put_many
                stored = await self.call("put_many", put(keys[n:], chunks[n:]))
        except TierFailure:
            return
        written = list(chunks[n:]) if stored is None else [c for c, ok in zip(chunks[n:], stored) if ok]
        self.metrics.inc("put_chunks", len(written))
        self.metrics.inc("put_bytes", sum(c.nbytes for c in written))
        if counter is not None:
            self.metrics.inc(counter, len(written))

    async def reserve(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """``backend.reserve(keys)`` under the deadline, its answer checked; None for every key
        when the tier fails or is unusable (the caller then uses its own memory)."""
        miss: list[MemoryObj | None] = [None] * len(keys)
        if not keys or not self.usable():
            return miss
        try:
            objs = await self.call("reserve", self.backend.reserve(keys))
        except TierFailure:
            return miss
        if len(objs) != len(keys):
            release_all(o for o in objs if o is not None)
            self._failed("errors", "reserve", f"{len(objs)} chunks for {len(keys)} keys")
            return miss
        return objs

    def sync_stats(self) -> None:
        """Mirror growth of the backend's own counters (evictions, checksum errors) into metrics."""
        stats = self.backend.stats()
        with self._lock:
            for name in _SYNCED_STATS:
                delta = stats.get(name, 0) - self._seen_stats.get(name, 0)
                if delta > 0:
                    self.metrics.inc(name, delta)
                    self._seen_stats[name] = stats[name]

    def _failed(self, counter: str, op: str, why: str) -> None:
        self.metrics.inc(counter)
        if self.health.record_failure():
            log.warning("kvlayer tier %s: %s failed (%s); marked unhealthy after %d consecutive failures, "
                        "skipped for %.0f s", self.name, op, why, self.health.consecutive_failures,
                        self.health.backoff_s)
        elif self._throttle.allow():
            more = self._throttle.last_suppressed
            log.warning("kvlayer tier %s: %s failed (%s); treated as a miss%s", self.name, op, why,
                        f" ({more} similar failures not logged)" if more else "")
