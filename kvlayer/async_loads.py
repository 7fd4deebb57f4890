"""Async loads: loads the engine does not wait for, run beside its steps (docs/architecture.md section 13).

An engine that can keep a request waiting while its KV arrives (vLLM's ``load_kv_async``) lets a
hit from a tier below memory (NVMe, Redis: ``lower_tiers``, ``below_memory``) load outside its
steps. The scheduler side grants such a load (``RequestTracker.allocated(..., async_load=True)``)
and hands it over once, in the next step's ``StepSpec.async_loads``
(``RequestTracker.take_async_loads``). On the worker side ``AsyncLoader`` runs each whole (a
``StepTransfer`` with given copy rows) on a thread of its own (``AsyncLoads``) at a lower CPU
priority, never on the loader thread the steps' layer-by-layer loads use, so no step waits for
it. ``AsyncLoader.finished`` reports each load once it ended, having counted what it moved
(``kvlayer.step_stats.StepStats``) and remembered its chunks for the tier events
(``kvlayer.tier_events.TierEvents``); the blocks it left without valid KV come out of
``take_failed_blocks``, its request out of ``take_failed``. A request the engine
finished meanwhile: a load still queued is dropped (reported done, nothing written), a running
one is waited for, as the engine keeps its blocks until the load is reported.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.config import KVLayerConfig
from kvlayer.io_loop import background, lower_priority
from kvlayer.registry import available_backends
from kvlayer.step import LoadSpec, StepContext, StepCounts, StepSpec, StepTransfer, slots_of
from kvlayer.step_stats import StepStats
from kvlayer.tier_events import TierEvents

log = logging.getLogger(__name__)

LoadResult = tuple[set[int], StepCounts]
"""An async load's outcome: the engine's blocks it left without valid KV, and what it moved."""

def lower_tiers(config: KVLayerConfig) -> frozenset[int]:
    """The indices, in the workers' tier order (``kvlayer.registry.build_backends``: by rank, then
    name), of the tiers ``config`` enables that are not in memory (NVMe, Redis; not the cache
    server). Worked out from the config, as the workers build their tiers: a tier that builds
    nothing (a custom one) can shift the indices, which costs a sync or an async load where the
    other was meant, never a wrong token."""
    enabled = []
    for name, ep in available_backends().items():
        section = config.tiers.get(name)
        if section is not None and not section.enabled:
            continue
        cls = ep.load()
        enabled.append((cls.rank, name, bool(cls.in_memory)))
    return frozenset(i for i, (_, _, in_memory) in enumerate(sorted(enabled)) if not in_memory)


def below_memory(sources: Sequence[int], lower: frozenset[int]) -> bool:
    """Whether a hit whose chunk objects come from tiers ``sources`` (``Found.sources``) loads
    asynchronously: one of them is in ``lower`` (``lower_tiers``), or none is known (the ranks
    disagreed: each worker then looks again, maybe below memory)."""
    return not sources or any(s in lower for s in sources)


class AsyncLoads:
    """Async loads, run one at a time on a thread of their own (never the loader thread the
    steps' layer-by-layer loads use), keyed by request id. Call from one thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlayer-async-load", initializer=lower_priority)
        self._jobs: dict[str, Future[LoadResult]] = {}

    def start(self, request_id: str, load: Callable[[], LoadResult]) -> None:
        """Queue ``load``, the load of ``request_id`` (a request has at most one at a time)."""
        self._jobs[request_id] = self._pool.submit(load)

    def pending(self) -> set[str]:
        """The requests whose load is not reported yet."""
        return set(self._jobs)

    def cancel(self, request_ids: set[str]) -> set[str]:
        """Cancel the loads of ``request_ids`` not started yet; those cancelled (now forgotten)."""
        out = {rid for rid in request_ids & set(self._jobs) if self._jobs[rid].cancel()}
        for rid in out:
            del self._jobs[rid]
        return out

    def take_done(self) -> dict[str, LoadResult]:
        """The outcomes of the loads that ended since the last call, by request id."""
        done = {rid: job for rid, job in self._jobs.items() if job.done()}
        for rid in done:
            del self._jobs[rid]
        return {rid: job.result() for rid, job in done.items()}

    def close(self) -> None:
        """Wait for the loads running and drop those not started."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class AsyncLoader:
    """A worker's async loads into the paged caches ``kv`` serves: ``start`` them as steps hand
    them over, ``finished`` once per step. What each moved is counted in ``stats`` and, with
    ``events``, remembered there. Call from the engine's worker thread."""

    def __init__(self, kv: KVCacheEngine, stats: StepStats, events: TierEvents | None = None) -> None:
        self._kv = kv
        self._stats = stats
        self._events = events
        self._jobs = AsyncLoads()
        self._failed_blocks: set[int] = set()  # failed loads' blocks, until take_failed_blocks
        self._failed: set[str] = set()  # loads reported failed, until take_failed
        self._dropped: set[str] = set()  # finished while their load ran: forget once it ends

    def start(self, loads: Sequence[LoadSpec], caches: Sequence[torch.Tensor]) -> None:
        """Queue ``loads`` (``StepSpec.async_loads``), each to be read whole into ``caches`` (one
        paged view per layer). Call on the thread that starts the steps (``kv``'s loader is made there)."""
        if not loads:
            return
        # the scatter of a load that runs beside the engine's steps uses its own thread only, not torch's team
        ctx = self._kv.step_context(threads=1)
        for load in loads:
            self._jobs.start(load.request_id, functools.partial(self._load_whole, ctx, caches, load))

    def _load_whole(self, ctx: StepContext, caches: Sequence[torch.Tensor], load: LoadSpec) -> LoadResult:
        """``load`` read whole into its blocks (on ``AsyncLoads``' thread): the blocks left
        without valid KV, and what moved. Its scatter runs on this thread alone."""
        try:
            slots = {load.request_id: slots_of(ctx.layout, load.block_ids, load.end, ctx.device, load.groups)}
            # a whole transfer (given slots): read and scattered here, nothing on the loader thread
            with background():  # its file reads run on lower-priority threads too
                step = StepTransfer(ctx, StepSpec(loads=(load,)), caches, slots)
                step.finish()
            return step.failed_blocks(), step.counts
        except Exception:  # a bug below costs a recompute of the whole load, never the engine
            log.exception("kvlayer: the async load of %s failed; it is recomputed", load.request_id)
            bs = ctx.layout.block_size
            return set(load.block_ids[load.start // bs :]), StepCounts(wanted_tokens=load.end - load.start)

    def finished(self, finished: set[str]) -> set[str]:
        """The async loads done since the last call (their blocks written, or reported by the next
        ``take_failed_blocks``). ``finished``: requests the engine finished or aborted; a load of
        theirs not started yet is dropped (reported done, nothing written), one running is
        waited for, as the engine keeps its blocks until it is reported."""
        self._dropped |= finished & self._jobs.pending()
        done = self._jobs.cancel(finished)
        for rid, (failed, counts) in self._jobs.take_done().items():
            done.add(rid)
            self._failed_blocks |= failed
            if failed:
                self._failed.add(rid)
            self._stats.moved(counts, async_load=True)
            if self._events is not None:  # a chunk promoted on its way up enters a tier
                for keys, token_ids, first in counts.moved:
                    self._events.remember(keys, token_ids, first)
        if ended := done & self._dropped:  # the load's own key lookups kept their keys again
            self._dropped -= ended
            self._kv.forget(ended)
        return done

    def take_failed_blocks(self) -> set[int]:
        """The blocks, without valid KV, of the loads ``finished`` reported since the last call."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_failed(self) -> set[str]:
        """The requests among those ``finished`` reported since the last call whose load left some
        block without valid KV."""
        failed, self._failed = self._failed, set()
        return failed

    def close(self) -> None:
        """Wait for the load running and drop those queued."""
        self._jobs.close()
