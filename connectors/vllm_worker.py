"""The worker side of the vLLM connector, in each vLLM worker process (docs/vllm.md).

It owns kvlayer's ``KVCacheEngine`` (the tiers), built once vLLM registers its caches, and the
lookup channel's server. Per step: ``bind`` prepares the step's saves (a ``SaveJob``, so
``save_layer`` can copy each layer out right after its attention), ``start_load`` starts the
loads (layer by layer on a loader thread, or all at once, as ``layerwise`` says), and
``finish`` stores what was saved. A failed load is reported as vLLM block ids
(``load_errors``), which vLLM recomputes; nothing here raises into vLLM after start-up. With
``events`` on, it listens to its tiers (``vllm_events.TierEvents``) for vLLM's KV-cache events
(``take_events``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.config import KVLayerConfig
from kvlayer.connectors.vllm_events import TierEvent, TierEvents
from kvlayer.connectors.vllm_lookup import Answer, LookupServer
from kvlayer.connectors.vllm_meta import StepMetadata
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.pipeline import LoadItem, LoadJob, SaveItem, SaveJob, finish_saves, loads_layerwise
from kvlayer.transfer import slot_mapping

log = logging.getLogger(__name__)

STAT_NAMES = ("lookups", "lookup_hit_tokens", "loaded_tokens", "failed_load_tokens", "saved_chunks")
"""What the worker counts for vLLM's connector stats (``KVLayerConnectorV1.get_kv_connector_stats``)."""


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
        self._keys: dict[str, list[ChunkKey]] = {}
        self._meta = StepMetadata()
        self._load: LoadJob | None = None
        self._save: SaveJob | None = None
        self._failed: dict[str, int] = {}
        self._errors: set[int] = set()
        self._counts = {name: 0 for name in STAT_NAMES}  # since the last take_stats
        self.totals = {name: 0 for name in STAT_NAMES}
        """The same counts since start-up."""
        self._counts_lock = threading.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvlayer-load")
        self._server = LookupServer(socket, self._answer)
        self._agent: Any = None
        if config.controller_url:
            from kvlayer.controller.agent import start_agent

            self._agent = start_agent(self.kv, config, address=config.instance_address)
        self.events: TierEvents | None = None
        if events:  # the agent listens to the same tiers: the recorder passes every call on to it
            self.events = TierEvents(then=self._agent)
            for backend in self.kv.backends:
                backend.set_listener(self.events)

    def register(self, names: Sequence[str], caches: Sequence[torch.Tensor]) -> None:
        """vLLM's caches, one per layer in model order, named ``names``; ``ValueError`` if one does
        not fit the layout."""
        self._views = [self.layout.paged_view(c) for c in caches]
        self._index = {name: i for i, name in enumerate(names)}

    # --- the lookup channel's answers (its own threads) -------------------------------------
    def _answer(self, token_ids: list[int], salt: str | None) -> Answer:
        found = self.kv.find(self.kv.keys(token_ids, salt))
        self._count(lookups=1, lookup_hit_tokens=found.num_tokens)
        return found.num_tokens, found.sources

    # --- one step -----------------------------------------------------------------------------
    def bind(self, meta: StepMetadata) -> None:
        """The step's metadata, before its forward pass: prepares its saves."""
        self._meta, self._failed, self._load, self._save = meta, {}, None, None
        try:
            items = []
            for s in meta.saves:
                known = self._keys_of(s.request_id, s.token_ids, s.salt)
                keys = [k for k in known if k.start >= s.first]
                if keys:
                    if self.events is not None:
                        self.events.remember(known, s.token_ids, s.first)
                    items.append(SaveItem(s.request_id, tuple(keys), self._slots(s.block_ids, keys[-1].end)))
            self._save = SaveJob(self.kv.tiers, self.kv.chunk_staging, items)
        except Exception:  # a bug below must cost a save, never the engine
            log.exception("kvlayer: preparing the step's saves failed")

    def start_load(self) -> None:
        """Start the step's loads (vLLM calls this before the forward pass when there are any)."""
        if not self._meta.loads or self._load is not None:
            return
        try:
            items = [LoadItem(ld.request_id, tuple(self._keys_of(ld.request_id, ld.token_ids, ld.salt)),
                              ld.sources, self._slots(ld.block_ids, ld.end), ld.start, ld.end)
                     for ld in self._meta.loads]
            if self.events is not None:  # a chunk read from a lower tier may be promoted into a higher one
                for ld, item in zip(self._meta.loads, items):
                    self.events.remember(item.keys, ld.token_ids, ld.start - ld.start % self.config.chunk_size)
            layerwise = loads_layerwise(self.config.layerwise, self.device, self.kv.tiers, items)
            self._load = LoadJob(self.kv.tiers, self.kv.chunk_staging, self.kv.groups, self._views, items,
                                 self._loader if layerwise else None)
        except Exception:
            log.exception("kvlayer: preparing the step's loads failed; they are recomputed")
            self._failed = {ld.request_id: ld.start for ld in self._meta.loads}

    def wait_layer(self, name: str) -> None:
        """Block until layer ``name`` holds what this step loads."""
        if self._load is not None and name in self._index:
            self._load.wait_layer(self._index[name])

    def save_layer(self, name: str) -> None:
        """Copy layer ``name`` of this step's completed chunks out (right after its attention)."""
        if self._save is not None and self.config.layerwise != "off" and name in self._index:
            i = self._index[name]
            self._save.layer(i, self._views[i])

    def finish(self) -> None:
        """After the forward pass: collect failed loads, then store the step's saved chunks."""
        load, save, self._load, self._save = self._load, self._save, None, None
        if load is not None:
            self._failed.update(load.failures())
        self._errors = self._failed_blocks()
        loaded = sum(self._failed.get(ld.request_id, ld.end) - ld.start for ld in self._meta.loads)
        wanted = sum(ld.end - ld.start for ld in self._meta.loads)
        self._count(loaded_tokens=max(0, loaded), failed_load_tokens=wanted - max(0, loaded),
                    saved_chunks=len(save) if save is not None else 0)
        finish_saves(save, self._views, self._failed, self.config.layerwise == "off")

    def load_errors(self) -> set[int]:
        """The vLLM blocks of this step's loads that hold no valid KV (vLLM recomputes them)."""
        return set(self._errors)

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
        for rid in request_ids:
            self._keys.pop(rid, None)

    # --- helpers ------------------------------------------------------------------------------
    def _failed_blocks(self) -> set[int]:
        bs = self.layout.block_size
        out: set[int] = set()
        for ld in self._meta.loads:
            valid = self._failed.get(ld.request_id)
            if valid is not None and valid < ld.end:
                out.update(ld.block_ids[valid // bs : -(-ld.end // bs)])
        return out

    def _keys_of(self, rid: str, token_ids: Sequence[int], salt: str | None) -> list[ChunkKey]:
        """The request's full-chunk keys over ``token_ids`` (reusing those computed before)."""
        keys = self._keys.get(rid, [])
        if not keys or keys[-1].end < len(token_ids) - len(token_ids) % self.config.chunk_size:
            keys = self.kv.keys(token_ids, salt, prefix=keys)
            self._keys[rid] = keys
        return [k for k in keys if k.end <= len(token_ids)]

    def _slots(self, block_ids: Sequence[int], end: int) -> torch.Tensor:
        """Copy rows of tokens ``0..end-1``: block ids for opaque blocks, else token slots."""
        if self.layout.opaque_blocks:
            return torch.tensor(list(block_ids[: -(-end // self.layout.block_size)]), dtype=torch.long,
                                device=self.device)
        return slot_mapping(block_ids, self.layout.block_size, 0, end, self.device)

    def close(self) -> None:
        self._server.close()
        if self._agent is not None:
            self._agent.close()
        if self.events is not None:  # closing the tiers drops every chunk: nobody takes those events
            for backend in self.kv.backends:
                backend.set_listener(None)
        self._loader.shutdown(wait=True)
        self.kv.close()
