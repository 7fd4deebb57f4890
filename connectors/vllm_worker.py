"""The worker side of the vLLM connector, in each vLLM worker process (docs/vllm.md).

It owns kvlayer's ``KVCacheEngine`` (the tiers), built once vLLM registers its caches, and the
lookup channel's server, which answers with the step layer's one lookup. Per step it hands
vLLM's metadata (a ``StepSpec``) to ``KVCacheEngine.start_step`` and translates vLLM's layer
names into layer indices; a failed load is reported as vLLM block ids (``load_errors``), which
vLLM recomputes. Nothing here raises into vLLM after start-up. With ``events`` on, it listens
to its tiers (``kvlayer.tier_events.TierEvents``) for vLLM's KV-cache events (``take_events``).
A step's ``async_loads`` (vLLM's ``load_kv_async``) run whole on a thread of their own
(``AsyncLoads``) while the steps go on; ``finished_loads`` reports those done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.config import KVLayerConfig
from kvlayer.connectors.controller_link import link_controller
from kvlayer.connectors.lookup_channel import Answer, LookupServer, Query
from kvlayer.layout import KVLayout
from kvlayer.step import LoadSpec, StepContext, StepCounts, StepSpec, StepTransfer, slots_of
from kvlayer.tier_events import TierEvent, TierEvents

log = logging.getLogger(__name__)

STAT_NAMES = ("lookups", "lookup_hit_tokens", "loaded_tokens", "failed_load_tokens", "saved_chunks", "async_loads")
"""What the worker counts for vLLM's connector stats (``KVLayerConnectorV1.get_kv_connector_stats``)."""

LoadResult = tuple[set[int], StepCounts]
"""An async load's outcome: the vLLM blocks it left without valid KV, and what it moved."""


class WorkerSide:
    """kvlayer in one vLLM worker: ``layout`` of its caches, ``socket`` the lookup channel's path.
    ``engine`` holds what ``KVCacheEngine`` needs besides (model name and fingerprint, device,
    tp rank and size); ``events``: record what enters and leaves the tiers (``take_events``)."""

    def __init__(self, config: KVLayerConfig, layout: KVLayout, socket: str, engine: dict[str, Any],
                 events: bool = False) -> None:
        self.config = config
        self.layout = layout
        engine = dict(engine)
        self.device = torch.device(engine.pop("device", "cpu"))
        self.kv = KVCacheEngine(config, layout, self.device, **engine)
        self._views: list[torch.Tensor] = []
        self._index: dict[str, int] = {}
        self._meta = StepSpec()
        self._step: StepTransfer | None = None
        self._errors: set[int] = set()
        self._async = AsyncLoads()
        self._async_errors: set[int] = set()  # failed async loads' blocks, until load_errors
        self._failed_ids: set[str] = set()  # async loads reported failed, until failed_loads
        self._dropped: set[str] = set()  # finished while their async load ran: forget once it ends
        self._counts = {name: 0 for name in STAT_NAMES}  # since the last take_stats
        self.totals = {name: 0 for name in STAT_NAMES}
        """The same counts since start-up."""
        self._counts_lock = threading.Lock()
        self._server = LookupServer(socket, self._answer)
        self._agent = link_controller(self.kv)
        self.events: TierEvents | None = None
        if events:  # the agent listens to the same tiers: the recorder passes every call on to it
            self.events = TierEvents(then=self._agent)
            self.kv.listen(self.events)

    def register(self, names: Sequence[str], caches: Sequence[torch.Tensor]) -> None:
        """vLLM's caches, one per layer in model order, named ``names``; ``ValueError`` if one does
        not fit the layout."""
        self._views = [self.layout.paged_view(c) for c in caches]
        self._index = {name: i for i, name in enumerate(names)}

    # --- the lookup channel's answers (its own threads) -------------------------------------
    def _answer(self, q: Query) -> Answer:
        found = self.kv.lookup(q.token_ids, q.salt, start=q.start, limit=q.limit, request_id=q.request_id or None)
        self._count(lookups=1, lookup_hit_tokens=found.num_tokens)
        return found.num_tokens, found.sources

    # --- one step -----------------------------------------------------------------------------
    def bind(self, meta: StepSpec) -> None:
        """The step's metadata, before its forward pass; its async loads start at once."""
        self._meta, self._step = meta, None
        if meta.async_loads:
            # made here (the engine's loader is created on this thread); the scatter of a load that
            # runs beside vLLM's steps uses its own thread only, not torch's team
            ctx = dataclasses.replace(self.kv._step_context(), threads=1)
            for load in meta.async_loads:
                self._async.start(load.request_id, functools.partial(self._load_whole, ctx, load))

    def start_load(self) -> None:
        """Start the step's loads and prepare its saves (once per step; the first of vLLM's
        per-step calls to come does it)."""
        if self._step is None and (self._meta.loads or self._meta.saves):  # most decode steps move nothing
            self._step = self.kv.start_step(self._meta, self._views)
            if self.events is not None:  # a chunk saved, or promoted on its way up, enters a tier
                for keys, token_ids, first in self._step.counts.moved:
                    self.events.remember(keys, token_ids, first)

    def wait_layer(self, name: str) -> None:
        """Block until layer ``name`` holds what this step loads."""
        if self._meta.loads and name in self._index:
            self.start_load()
            assert self._step is not None
            self._step.wait_layer(self._index[name])

    def save_layer(self, name: str) -> None:
        """Copy layer ``name`` of this step's completed chunks out (right after its attention)."""
        if self._meta.saves and name in self._index:
            self.start_load()
            assert self._step is not None
            i = self._index[name]
            self._step.save_layer(i, self._views[i])

    def finish(self) -> None:
        """After the forward pass: collect failed loads, then store the step's saved chunks."""
        self.start_load()
        step, self._step, self._meta = self._step, None, StepSpec()
        if step is None:
            self._errors = set()
            return
        step.finish()
        self._errors = step.failed_blocks()
        counts = step.counts
        self._count(loaded_tokens=counts.loaded_tokens, failed_load_tokens=counts.wanted_tokens - counts.loaded_tokens,
                    saved_chunks=counts.saved_chunks)

    def load_errors(self, with_async: bool = True) -> set[int]:
        """The vLLM blocks of this step's loads, and (``with_async``) of the async loads
        ``finished_loads`` reported since the last call, that hold no valid KV (vLLM recomputes them)."""
        errors = self._errors | self._async_errors if with_async else self._errors
        self._async_errors = set()
        return errors

    def failed_loads(self) -> set[str]:
        """The requests among those ``finished_loads`` reported since the last call whose load
        left some block without valid KV (vLLM's ``failed_recving``)."""
        failed, self._failed_ids = self._failed_ids, set()
        return failed

    # --- asynchronous loads ---------------------------------------------------------------------
    def _load_whole(self, ctx: StepContext, load: LoadSpec) -> LoadResult:
        """``load`` read whole into its blocks (on ``AsyncLoads``' thread): the blocks left
        without valid KV, and what moved. Its scatter runs on this thread alone."""
        try:
            slots = {load.request_id: slots_of(self.layout, load.block_ids, load.end, self.device, load.groups)}
            # a whole transfer (given slots): read and scattered here, nothing on the loader thread
            step = StepTransfer(ctx, StepSpec(loads=(load,)), self._views, slots)
            step.finish()
            return step.failed_blocks(), step.counts
        except Exception:  # a bug below costs a recompute of the whole load, never vLLM
            log.exception("kvlayer: the async load of %s failed; it is recomputed", load.request_id)
            bs = self.layout.block_size
            return set(load.block_ids[load.start // bs :]), StepCounts(wanted_tokens=load.end - load.start)

    def finished_loads(self, finished: set[str]) -> set[str]:
        """The async loads done since the last call (their blocks written or reported failed in
        the next ``load_errors``). ``finished``: requests vLLM finished or aborted; a load of
        theirs not started yet is dropped (reported done, nothing written), one running is
        waited for, as vLLM keeps its blocks until it is reported."""
        self._dropped |= finished & self._async.pending()
        done = self._async.cancel(finished)
        for rid, (failed, counts) in self._async.take_done().items():
            done.add(rid)
            self._async_errors |= failed
            if failed:
                self._failed_ids.add(rid)
            self._count(loaded_tokens=counts.loaded_tokens, async_loads=1,
                        failed_load_tokens=counts.wanted_tokens - counts.loaded_tokens)
            if self.events is not None:
                for keys, token_ids, first in counts.moved:
                    self.events.remember(keys, token_ids, first)
        if ended := done & self._dropped:  # the load's own key lookups kept their keys again
            self._dropped -= ended
            self.kv.forget(ended)
        return done

    def take_stats(self) -> dict[str, int]:
        """The counts (``STAT_NAMES``) since the last call, for vLLM's connector stats; {} if none."""
        with self._counts_lock:
            counts, self._counts = self._counts, {name: 0 for name in STAT_NAMES}
        return counts if any(counts.values()) else {}

    def take_events(self) -> list[TierEvent]:
        """What entered and left the tiers since the last call (``TierEvents.take``); [] when
        events are off."""
        return self.events.take() if self.events is not None else []

    def _count(self, **deltas: int) -> None:
        with self._counts_lock:
            for name, n in deltas.items():
                self._counts[name] += n
                self.totals[name] += n

    def forget(self, request_ids: set[str]) -> None:
        """Drop what is kept for finished requests (their keys)."""
        self.kv.forget(request_ids)

    def close(self) -> None:
        self._async.close()
        self._server.close()
        if self._agent is not None:
            self._agent.close()
        if self.events is not None:  # closing the tiers drops every chunk: nobody takes those events
            self.kv.listen(None)
        self.kv.close()


BACKGROUND_NICE = 10
"""How much lower the async-load thread's CPU priority is (Linux per-thread nice): on a busy
CPU, vLLM's step threads come first and the load takes the time they leave."""


def _yield_cpu() -> None:
    """Lower this thread's CPU priority by ``BACKGROUND_NICE`` (where the OS allows it)."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: full priority
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)


class AsyncLoads:
    """Async loads, run one at a time on a thread of their own (never the loader thread the
    steps' layer-by-layer loads use), keyed by request id. Call from one thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlayer-async-load", initializer=_yield_cpu)
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
