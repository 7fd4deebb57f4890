"""The worker side of the vLLM connector, in each vLLM worker process (docs/vllm.md).

It owns kvlayer's ``KVCacheEngine`` (the tiers), built once vLLM registers its caches, and the
lookup channel's server, which answers with the step layer's one lookup. Per step it hands
vLLM's metadata (a ``StepSpec``) to ``KVCacheEngine.start_step`` and translates vLLM's layer
names into layer indices; a failed load is reported as vLLM block ids (``load_errors``), which
vLLM recomputes. Nothing here raises into vLLM after start-up. With ``events`` on, it listens
to its tiers (``kvlayer.tier_events.TierEvents``) for vLLM's KV-cache events (``take_events``).
A step's ``async_loads`` (vLLM's ``load_kv_async``) run whole beside the steps
(``kvlayer.async_loads.AsyncLoader``); ``finished_loads`` reports those done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlayer.async_loads import AsyncLoader
from kvlayer.cache_engine import KVCacheEngine
from kvlayer.config import KVLayerConfig
from kvlayer.connectors.controller_link import link_controller
from kvlayer.connectors.lookup_channel import Answer, LookupServer, Query
from kvlayer.layout import KVLayout
from kvlayer.step import StepSpec, StepTransfer
from kvlayer.step_stats import StepStats
from kvlayer.tier_events import TierEvent, TierEvents


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
        self._stats = StepStats()  # for vLLM's connector stats (take_stats)
        self.totals = self._stats.totals
        """What the worker moved since start-up (``kvlayer.step_stats.STAT_NAMES``)."""
        self._server = LookupServer(socket, self._answer)
        self._agent = link_controller(self.kv)
        self.events: TierEvents | None = None
        if events:  # the agent listens to the same tiers: the recorder passes every call on to it
            self.events = TierEvents(then=self._agent)
            self.kv.listen(self.events)
        self._async = AsyncLoader(self.kv, self._stats, self.events)

    def register(self, names: Sequence[str], caches: Sequence[torch.Tensor]) -> None:
        """vLLM's caches, one per layer in model order, named ``names``; ``ValueError`` if one does
        not fit the layout."""
        self._views = [self.layout.paged_view(c) for c in caches]
        self._index = {name: i for i, name in enumerate(names)}

    # --- the lookup channel's answers (its own threads) -------------------------------------
    def _answer(self, q: Query) -> Answer:
        found = self.kv.lookup(q.token_ids, q.salt, start=q.start, limit=q.limit, request_id=q.request_id or None)
        self._stats.lookup(found)
        return found.num_tokens, found.sources

    # --- one step -----------------------------------------------------------------------------
    def bind(self, meta: StepSpec) -> None:
        """The step's metadata, before its forward pass; its async loads start at once."""
        self._meta, self._step = meta, None
        if meta.reset:
            self.kv.drop_private_memory()
        self._async.start(meta.async_loads, self._views)

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
        self._stats.moved(step.counts)

    def load_errors(self, with_async: bool = True) -> set[int]:
        """The vLLM blocks of this step's loads, and (``with_async``) of the async loads
        ``finished_loads`` reported since the last call, that hold no valid KV (vLLM recomputes them)."""
        failed = self._async.take_failed_blocks()
        return self._errors | failed if with_async else self._errors

    def failed_loads(self) -> set[str]:
        """The requests among those ``finished_loads`` reported since the last call whose load
        left some block without valid KV (vLLM's ``failed_recving``)."""
        return self._async.take_failed()

    def finished_loads(self, finished: set[str]) -> set[str]:
        """The async loads done since the last call (their blocks written or reported failed in
        the next ``load_errors``). ``finished``: requests vLLM finished or aborted; a load of
        theirs not started yet is dropped (reported done, nothing written), one running is
        waited for, as vLLM keeps its blocks until it is reported."""
        return self._async.finished(finished)

    def take_stats(self) -> dict[str, int]:
        """The counts (``kvlayer.step_stats.STAT_NAMES``) since the last call, for vLLM's connector
        stats; {} if none."""
        return self._stats.take()

    def take_events(self) -> list[TierEvent]:
        """What entered and left the tiers since the last call (``TierEvents.take``); [] when
        events are off."""
        return self.events.take() if self.events is not None else []

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

