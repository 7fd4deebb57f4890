"""``KVCacheEngine``: kvlayer's engine-agnostic API (ARCHITECTURE.md section 5).

For any engine with a paged KV cache: ``lookup`` how many prefix tokens kvlayer holds,
``store`` a sequence's chunks out of the paged cache, ``retrieve`` them back into it. The
bundled engine's connector is built on this class; other engines call it directly.

Threading: call it from one engine thread; storage I/O runs on its own background loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from kvlayer.config import KVLayerConfig
from kvlayer.exporter import expose, withdraw
from kvlayer.io_loop import IOLoop
from kvlayer.keys import ChunkKey, Namespace, chunk_keys
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.memory import release_all as _release
from kvlayer.metrics import Metrics
from kvlayer.registry import build_backends
from kvlayer.storage import BackendContext, StorageBackend
from kvlayer.streaming import LayerStream, layer_groups
from kvlayer.tier_manager import TierManager
from kvlayer.transfer import gather, wait_for_copies

log = logging.getLogger(__name__)


class KVCacheEngine:
    """Stores and retrieves chunks of a paged KV cache through kvlayer's tiers.

    ``config`` is a ``KVLayerConfig``, a dict or a YAML path (``KVLAYER_*`` variables override
    it). ``layout`` describes the paged caches passed to ``store``/``retrieve``: one tensor
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer in ``layout.dtype``.
    ``model_name``/``model_fingerprint`` and the TP rank enter every key's namespace, so
    chunks of another model, dtype, layout or tenant never match. ``backends`` overrides the
    tiers built from the config (tests, custom tiers).
    """

    def __init__(self, config: KVLayerConfig | dict[str, Any] | str | os.PathLike[str] | None,
                 layout: KVLayout, device: torch.device | str = "cpu", *, model_name: str = "model",
                 model_fingerprint: str = "", tp_rank: int = 0, tp_size: int = 1,
                 backends: Sequence[StorageBackend] | None = None) -> None:
        self.config = KVLayerConfig.load(config)
        self.layout = layout
        self.device = torch.device(device)
        self.namespace = Namespace(model_name, model_fingerprint, layout, self.config.chunk_size,
                                   tp_rank, tp_size, self.config.cache_salt)
        chunk_bytes = layout.chunk_bytes(self.config.chunk_size)
        self.staging = Arena(max(self.config.staging_capacity, chunk_bytes), chunk_bytes, "cpu", pin=True,
                             name="kvlayer staging")
        self.instance_id = self.config.instance_id or f"{os.uname().nodename}-{os.getpid()}"
        ctx = BackendContext(self.config, layout, self.device, self.staging, self.instance_id)
        self.backends = list(backends) if backends is not None else build_backends(ctx)
        self.loop = IOLoop()
        self.metrics = Metrics(self.instance_id)
        self.tiers = TierManager(self.backends, self.loop, self.config, self.metrics)
        self._groups = layer_groups(layout.num_layers, chunk_bytes // layout.num_layers)
        self.tiers.warm_up()
        self._exposed = bool(self.config.metrics_port) and expose(
            self.metrics, self.config.metrics_host, self.config.metrics_port)
        self._closed = False

    # ----- keys -------------------------------------------------------------------------
    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None,
             prefix: Sequence[ChunkKey] = ()) -> list[ChunkKey]:
        """Chunk keys of ``token_ids`` (full chunks, plus the partial tail if configured)."""
        ns = self.namespace.with_salt(cache_salt)
        return chunk_keys(ns, token_ids, self.config.save_partial_chunks, prefix)

    # ----- the API ----------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of ``token_ids`` kvlayer can supply (no data moved)."""
        return self.lookup_keys(self.keys(token_ids, cache_salt))

    def lookup_keys(self, keys: Sequence[ChunkKey]) -> int:
        n = self.tiers.lookup(keys).num_chunks
        return keys[n - 1].end if n else 0

    def store(self, token_ids: Sequence[int], kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
              cache_salt: str | None = None, keys: Sequence[ChunkKey] | None = None) -> int:
        """Store the chunks of ``token_ids`` whose KV sits in ``kv_caches`` at ``slot_mapping``.

        ``slot_mapping`` holds one slot per token of ``token_ids`` (int64, caches' device).
        Chunks already held are skipped. Returns how many chunks were handed to the tiers;
        lower tiers are written in the background. Never raises for a tier failure.
        """
        keys = list(keys) if keys is not None else self.keys(token_ids, cache_salt)
        if len(slot_mapping) < (keys[-1].end if keys else 0):
            raise ValueError(f"slot_mapping has {len(slot_mapping)} slots for {keys[-1].end} tokens")
        todo, objs = self.stage(keys)
        try:
            for key, obj in zip(todo, objs, strict=True):
                gather(kv_caches, slot_mapping[key.start : key.end], obj.tensor)
            wait_for_copies(slot_mapping.device)
        except BaseException:
            _release(objs)
            raise
        self.commit(todo, objs)
        return len(todo)

    def stage(self, keys: Sequence[ChunkKey]) -> tuple[list[ChunkKey], list[MemoryObj]]:
        """Empty staging chunks for the ``keys`` kvlayer does not hold yet (those after the held
        prefix, as many as staging memory allows): the keys and one chunk each, in order.

        The caller owns one reference to each chunk: it fills them (``kvlayer.transfer.gather``
        or, layer by layer, ``gather_layer``), then hands them to ``commit``, or releases them.
        """
        return self.stage_many([keys])[0]

    def stage_many(self, requests: Sequence[Sequence[ChunkKey]]) -> list[tuple[list[ChunkKey], list[MemoryObj]]]:
        """``stage`` for several key lists, with one presence check of the tiers for all of them."""
        held = self.tiers.lookup_many(requests, record=False)
        out = []
        for keys, found in zip(requests, held):
            todo, objs = [], []
            for key in keys[found.num_chunks :]:
                obj = self._allocate(key)
                if obj is None:
                    break
                todo.append(key)
                objs.append(obj)
            out.append((todo, objs))
        return out

    def commit(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        """Store filled ``chunks`` under ``keys`` (the top memory tier now, the lower tiers in the
        background) and release the caller's references, also when storing fails."""
        try:
            if keys:
                self.tiers.store(keys, chunks)
        finally:
            _release(chunks)

    def fetch_layers(self, requests: Sequence[Sequence[ChunkKey]]) -> LayerStream:
        """The chunks of the longest held prefix of each key list, read from all tiers at once;
        those of lower tiers arrive layer group by layer group (``kvlayer.streaming``). The
        caller follows the ``LayerStream`` contract (``wait_layer``, ``finish``, ``release``)."""
        return self.tiers.stream_many(requests, self._groups, self._allocate)

    def _allocate(self, key: ChunkKey) -> MemoryObj | None:
        obj = self.staging.allocate(self.layout.chunk_shape(key.num_tokens), self.layout.dtype)
        if obj is None:
            self.metrics.count("staging", "errors")
        return obj

    def retrieve(self, token_ids: Sequence[int], kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                 cache_salt: str | None = None, start: int = 0, keys: Sequence[ChunkKey] | None = None) -> int:
        """Write the longest available prefix of ``token_ids`` into ``kv_caches`` at ``slot_mapping``.

        Tokens before ``start`` are not written (the engine already holds them); slots are
        given for every token of ``token_ids``. Returns the number of leading tokens now
        available (including those before ``start``), or ``start`` if nothing after it was.
        """
        from kvlayer.pipeline import LoadItem, LoadJob  # the pipeline is built on this class

        keys = list(keys) if keys is not None else self.keys(token_ids, cache_salt)
        keys = [k for k in keys if k.end <= len(token_ids)]
        end = keys[-1].end if keys else 0
        if end <= start:
            return start
        job = LoadJob(self, kv_caches, [LoadItem("retrieve", tuple(keys), slot_mapping, start, end)])
        wait_for_copies(slot_mapping.device)
        return job.failures().get("retrieve", end)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for background writes (tests and shutdown)."""
        self.tiers.flush(timeout)

    def stats(self) -> dict[str, Any]:
        """Per-tier counters and usage as plain data."""
        return self.tiers.stats()

    def close(self) -> None:
        """Finish background writes, close the tiers and stop the I/O loop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._exposed:
            withdraw(self.metrics, self.config.metrics_host, self.config.metrics_port)
        try:
            self.tiers.close()
        finally:
            self.loop.close()

    def __enter__(self) -> KVCacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- admin operations (the controller agent, issue 6) -----------------------------
    def snapshot(self) -> dict[str, list[bytes]]:
        """Digests of the chunks each tier holds, by tier name (the controller's registry)."""
        return self.tiers.snapshot()

    def copy(self, keys: Sequence[ChunkKey], dst_tier: str, src_tier: str | None = None) -> int:
        """Copy the longest prefix of ``keys`` held in ``src_tier`` (None: any other tier) into
        ``dst_tier``; returns how many leading keys ``dst_tier`` then holds (``TierManager.copy``)."""
        return self.tiers.copy(keys, dst_tier, src_tier)

    def evict_all(self, tier: str | None = None) -> int:
        """Remove every unpinned chunk from ``tier`` (every tier if None); returns how many."""
        return self.tiers.remove_all(tier)
