"""``KVCacheEngine``: kvlayer's engine-agnostic API (docs/architecture.md section 5).

For any engine with a paged KV cache: ``lookup`` how many prefix tokens kvlayer holds,
``store`` a sequence's chunks out of the paged cache, ``retrieve`` them back into it. The
bundled engine's connector is built on the same parts (its ``LoadJob``/``SaveJob`` run over
this object's ``tiers`` and ``staging``); other engines call it directly. ``store`` and
``retrieve`` are one ``SaveJob`` and one ``LoadJob``: there is one save path and one load path.

Threading: call it from one engine thread; storage I/O runs on its own background loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from kvlayer import tier_admin
from kvlayer.config import KVLayerConfig
from kvlayer.devices import parse_device
from kvlayer.exporter import expose, withdraw
from kvlayer.io_loop import IOLoop
from kvlayer.keys import ChunkKey, Namespace, chunk_keys
from kvlayer.layout import KVLayout
from kvlayer.metrics import Metrics
from kvlayer.pipeline import LoadItem, LoadJob, SaveItem, SaveJob
from kvlayer.read_plan import layer_groups
from kvlayer.registry import build_backends
from kvlayer.staging import Staging
from kvlayer.storage import BackendContext, StorageBackend
from kvlayer.tier_manager import LookupResult, TierManager
from kvlayer.transfer import wait_for_copies
from kvlayer.windows import Found, find_prefix, save_keys

log = logging.getLogger(__name__)


class KVCacheEngine:
    """Stores and retrieves chunks of a paged KV cache through kvlayer's tiers.

    ``config`` is a ``KVLayerConfig``, a dict or a YAML path (``KVLAYER_*`` variables override
    it). ``layout`` describes the paged caches passed to ``store``/``retrieve``: one tensor
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer in ``layout.dtype`` (or as
    ``layout.cache_layout`` says: MLA's ``[num_blocks, block_size, latent_dim]``, opaque blocks).
    ``model_name``/``model_fingerprint`` and the TP rank enter every key's namespace, so
    chunks of another model, dtype, layout, tenant or ``storage_quantization`` never match.
    ``backends`` overrides the tiers built from the config (tests, custom tiers). ``ValueError``
    for a device this machine lacks, ``ConfigError`` for a bad setting.

    What an engine adapter builds its own ``LoadJob``/``SaveJob`` over: ``tiers`` (the
    ``TierManager``), ``chunk_staging`` (the ``Staging``; ``staging`` is its arena) and
    ``groups`` (the layer groups lower tiers' reads arrive in).
    """

    def __init__(self, config: KVLayerConfig | dict[str, Any] | str | os.PathLike[str] | None,
                 layout: KVLayout, device: torch.device | str = "cpu", *, model_name: str = "model",
                 model_fingerprint: str = "", tp_rank: int = 0, tp_size: int = 1,
                 backends: Sequence[StorageBackend] | None = None) -> None:
        self.config = KVLayerConfig.load(config)
        self.layout = layout
        self.device = parse_device(device)
        self.namespace = Namespace(model_name, model_fingerprint, layout, self.config.chunk_size,
                                   tp_rank, tp_size, self.config.cache_salt,
                                   quantization=self.config.storage_quantization)
        self.instance_id = self.config.instance_id or f"{os.uname().nodename}-{os.getpid()}"
        self.metrics = Metrics(self.instance_id)
        self.chunk_staging = Staging.create(layout, self.config.chunk_size, self.config.staging_capacity, self.metrics)
        self.staging = self.chunk_staging.arena
        ctx = BackendContext(self.config, layout, self.device, self.staging, self.instance_id)
        self.backends = list(backends) if backends is not None else build_backends(ctx)
        self.loop = IOLoop()
        self.tiers = TierManager(self.backends, self.loop, self.config, self.metrics)
        # a hybrid's window-group objects are read whole (kvlayer.read_plan): one range of every layer
        split = len(layout.window_groups) > 1
        self.groups = [(0, layout.num_layers)] if split else layer_groups(
            layout.num_layers, layout.chunk_bytes(self.config.chunk_size) // layout.num_layers)
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
        """``lookup`` for keys already computed: how many leading tokens of them kvlayer holds."""
        return self.find(keys).num_tokens

    def find(self, keys: Sequence[ChunkKey], record: bool = True) -> LookupResult:
        """The held prefix of ``keys`` and the tier each of its chunks is in (no data moved); a
        ``LoadItem`` built from its ``sources`` reads each chunk from there. ``record=False``
        leaves the lookup counters alone."""
        return self.tiers.lookup(keys, record)

    def find_prefix(self, keys: Sequence[ChunkKey], start: int, limit: int, record: bool = True) -> Found:
        """The prefix of chunk ``keys`` a request holding ``start`` tokens can load, up to ``limit``
        tokens, and the chunk objects to read for it (``kvlayer.windows.find_prefix``: for a
        layout with sliding windows, only what its layers can still attend to)."""
        return find_prefix(self.tiers, self.layout, keys, start, limit, record)

    def store(self, token_ids: Sequence[int], kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
              cache_salt: str | None = None, keys: Sequence[ChunkKey] | None = None) -> int:
        """Store the chunks of ``token_ids`` whose KV sits in ``kv_caches`` at ``slot_mapping``.

        ``kv_caches``: one per layer, laid out as ``layout.paged_view`` sees them (the engine's own
        tensors for the default layout). ``slot_mapping`` holds one slot per token of
        ``token_ids`` (int64, caches' device), or one block id per block for a layout of opaque
        blocks (``KVLayout.copy_unit``).
        Chunks already held are skipped. Returns how many chunks were handed to the tiers;
        lower tiers are written in the background. Never raises for a tier failure;
        ``ValueError`` if ``slot_mapping`` is too short.
        """
        keys = list(keys) if keys is not None else self.keys(token_ids, cache_salt)
        if not keys:
            return 0
        need = -(-keys[-1].end // self.layout.copy_unit)
        if len(slot_mapping) < need:
            raise ValueError(f"slot_mapping has {len(slot_mapping)} slots for {keys[-1].end} tokens (needs {need})")
        # on the caller's thread with nothing computing beside it: the gather may share its chunks
        # among as many threads as torch uses
        job = SaveJob(self.tiers, self.chunk_staging, [SaveItem("store", tuple(save_keys(self.layout, keys)),
                                                                slot_mapping)], threads=torch.get_num_threads())
        job.gather_all(kv_caches)
        wait_for_copies(slot_mapping.device)
        staged = len(job)
        job.finish()
        return staged

    def retrieve(self, token_ids: Sequence[int], kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                 cache_salt: str | None = None, start: int = 0, keys: Sequence[ChunkKey] | None = None) -> int:
        """Write the longest available prefix of ``token_ids`` into ``kv_caches`` at ``slot_mapping``.

        Tokens before ``start`` are not written (the engine already holds them); slots are
        given for every token of ``token_ids``. With sliding windows (``KVLayout.layer_windows``)
        a window layer's KV is written only where a query after the prefix can read it
        (``find_prefix``). Returns the number of leading tokens now
        available (including those before ``start``), or ``start`` if nothing after it was.
        """
        keys = list(keys) if keys is not None else self.keys(token_ids, cache_salt)
        keys = [k for k in keys if k.end <= len(token_ids)]
        # where to read from; the caller's lookup was counted
        found = self.find_prefix(keys, start, len(token_ids), record=False)
        if found.num_tokens <= start:
            return start
        item = LoadItem("retrieve", found.keys, found.sources, slot_mapping, start, found.num_tokens,
                        whole=self.layout.windowed)
        job = LoadJob(self.tiers, self.chunk_staging, self.groups, kv_caches, [item])
        wait_for_copies(slot_mapping.device)
        return job.failures().get("retrieve", found.num_tokens)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for background writes (to every tier, Redis and NVMe included); False if
        ``timeout`` seconds passed first. Thread-safe."""
        return self.tiers.flush(timeout)

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

    # ----- admin operations (the controller agent, docs/architecture.md section 7) -------
    @property
    def tier_names(self) -> list[str]:
        """The tiers' names, top first."""
        return self.tiers.tier_names

    def pinnable_tiers(self) -> list[str]:
        """The tiers whose ``pin`` protects chunks (not Redis: it evicts by its own policy)."""
        return [b.name for b in self.backends if tier_admin.can_pin(b)]

    def snapshot(self) -> dict[str, list[bytes]]:
        """Digests of the chunks each tier holds, by tier name (the controller's registry)."""
        return tier_admin.snapshot(self.tiers)

    def pin(self, keys: Sequence[ChunkKey], tier: str | None = None) -> int:
        """Pin the present ``keys`` in ``tier`` (every tier if None); how many were pinned."""
        return tier_admin.pin(self.tiers, keys, tier)

    def unpin(self, keys: Sequence[ChunkKey], tier: str | None = None) -> int:
        """Undo one pin of each pinned key in ``tier`` (every tier if None); how many."""
        return tier_admin.unpin(self.tiers, keys, tier)

    def remove(self, keys: Sequence[ChunkKey], tier: str | None = None) -> int:
        """Remove the present, unpinned ``keys`` from ``tier`` (every tier if None); how many."""
        return tier_admin.remove(self.tiers, keys, tier)

    def copy(self, keys: Sequence[ChunkKey], dst_tier: str, src_tier: str | None = None) -> int:
        """Copy the longest prefix of ``keys`` held in ``src_tier`` (None: any other tier) into
        ``dst_tier``; returns how many leading keys ``dst_tier`` then holds (``tier_admin.copy``)."""
        return tier_admin.copy(self.tiers, keys, dst_tier, src_tier)

    def evict_all(self, tier: str | None = None) -> int:
        """Remove every unpinned chunk from ``tier`` (every tier if None); returns how many."""
        return tier_admin.remove_all(self.tiers, tier)
