"""``KVCacheEngine``: kvlayer's engine-agnostic API (docs/architecture.md section 5).

For any engine with a paged KV cache: ``lookup`` how many prefix tokens kvlayer holds,
``store`` a sequence's chunks out of the paged cache, ``retrieve`` them back into it, or, per
engine step, ``start_step`` a step's loads and saves layer by layer (``kvlayer.step``). It is
the facade over the tiers, the staging memory and the step layer (docs/architecture.md
section 13): every adapter (the bundled connector, vLLM's) and ``store``/``retrieve`` go
through the same ``StepTransfer``, so there is one save path and one load path, and nothing
outside the core reaches the tiers or the staging.

Threading: call it from one engine thread (``lookup`` and ``forget`` from any); storage I/O
runs on its own background loop, layer-by-layer loads on a loader thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvlayer import tier_admin
from kvlayer.capacity import check_memory
from kvlayer.config import KVLayerConfig
from kvlayer.devices import parse_device
from kvlayer.exporter import expose, withdraw
from kvlayer.io_loop import IOLoop
from kvlayer.keys import ChunkKey, Namespace, chunk_keys
from kvlayer.layout import KVLayout
from kvlayer.metrics import Metrics
from kvlayer.read_plan import layer_groups
from kvlayer.registry import build_backends
from kvlayer.staging import Staging
from kvlayer.step import LoadSpec, SaveSpec, StepContext, StepSpec, StepTransfer
from kvlayer.storage import BackendContext, StorageBackend, TierListener
from kvlayer.tier_manager import TierManager
from kvlayer.windows import Found, find_prefix

log = logging.getLogger(__name__)

PRIVATE_MEMORY_TIERS = ("gpu", "cpu")
"""The tiers that live in this process's memory alone (a cache server's arena is shared)."""


class KVCacheEngine:
    """Stores and retrieves chunks of a paged KV cache through kvlayer's tiers.

    ``config`` is a ``KVLayerConfig``, a dict or a YAML path (``KVLAYER_*`` variables override
    it). ``layout`` describes the paged caches passed to ``store``/``retrieve``: one tensor
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer in ``layout.dtype`` (or as
    ``layout.cache_layout`` says: MLA's ``[num_blocks, block_size, latent_dim]``, opaque blocks).
    ``model_name``/``model_fingerprint`` and the TP rank enter every key's namespace, so
    chunks of another model, dtype, layout, tenant or ``storage_quantization`` never match.
    ``instance_id`` is the config's (default: host and pid), plus ``-tp<rank>`` when ``tp_size``
    is above 1, so each rank registers and reports apart. ``backends`` overrides the tiers built
    from the config (tests, custom tiers). ``ValueError`` for a device this machine lacks,
    ``ConfigError`` for a bad setting, or for memory sizes (the tiers' unless ``backends`` is
    given, and ``staging_capacity``) the host or the device cannot hold now
    (``kvlayer.capacity.check_memory``), before anything is allocated.

    ``tiers`` (the ``TierManager``), ``chunk_staging`` (the ``Staging``; ``staging`` is its
    arena) and ``groups`` (the layer groups lower tiers' reads arrive in) are the core's own:
    adapters use the methods below.
    """

    def __init__(self, config: KVLayerConfig | dict[str, Any] | str | os.PathLike[str] | None,
                 layout: KVLayout, device: torch.device | str = "cpu", *, model_name: str = "model",
                 model_fingerprint: str = "", tp_rank: int = 0, tp_size: int = 1,
                 backends: Sequence[StorageBackend] | None = None) -> None:
        self.config = KVLayerConfig.load(config)
        self.layout = layout
        self.device = parse_device(device)
        check_memory(self.config, self.device, tiers=backends is None)
        self.namespace = Namespace(model_name, model_fingerprint, layout, self.config.chunk_size,
                                   tp_rank, tp_size, self.config.cache_salt,
                                   quantization=self.config.storage_quantization)
        base = self.config.instance_id or f"{os.uname().nodename}-{os.getpid()}"
        self.instance_id = f"{base}-tp{tp_rank}" if tp_size > 1 else base  # each rank registers apart
        self.metrics = Metrics(self.instance_id)
        self.chunk_staging = Staging.create(layout, self.config.chunk_size, self.config.staging_capacity, self.metrics)
        self.staging = self.chunk_staging.arena
        ctx = BackendContext(self.config, layout, self.device, self.staging, self.instance_id,
                             namespace=self.namespace)
        self.backends = list(backends) if backends is not None else build_backends(ctx)
        self.loop = IOLoop()
        self.tiers = TierManager(self.backends, self.loop, self.config, self.metrics)
        # a hybrid's window-group objects are read whole (kvlayer.read_plan): one range of every layer
        split = len(layout.window_groups) > 1
        self.groups = [(0, layout.num_layers)] if split else layer_groups(
            layout.num_layers, layout.chunk_bytes(self.config.chunk_size) // layout.num_layers)
        self.tiers.warm_up()
        self._known: dict[str, tuple[str | None, list[ChunkKey]]] = {}  # request -> (salt, full chunks' keys)
        self._keys_lock = threading.Lock()
        self._loader: ThreadPoolExecutor | None = None
        self._streams: tuple[torch.cuda.Stream | None, torch.cuda.Stream | None] = (None, None)
        self._exposed = bool(self.config.metrics_port) and expose(
            self.metrics, self.config.metrics_host, self.config.metrics_port)
        self._closed = False

    # ----- keys -------------------------------------------------------------------------
    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None,
             prefix: Sequence[ChunkKey] = ()) -> list[ChunkKey]:
        """Chunk keys of ``token_ids`` (full chunks, plus the partial tail if configured)."""
        ns = self.namespace.with_salt(cache_salt)
        return chunk_keys(ns, token_ids, self.config.save_partial_chunks, prefix)

    def _request_keys(self, request_id: str | None, token_ids: Sequence[int], salt: str | None) -> list[ChunkKey]:
        """``keys``; for a tracked request each full chunk's key is computed once and kept until
        ``forget`` (its tokens only grow) or its salt changes. Thread-safe (vLLM's lookup channel
        answers on its own)."""
        if request_id is None:
            return self.keys(token_ids, salt)
        with self._keys_lock:
            known_salt, known = self._known.get(request_id, (salt, []))
        known = known if known_salt == salt else []  # a reset gave the request another salt
        keys = self.keys(token_ids, salt, prefix=known)
        full = [k for k in keys if k.num_tokens == self.config.chunk_size]
        if len(full) > len(known):
            with self._keys_lock:
                self._known[request_id] = (salt, full)
        return keys

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the keys kept for ``request_ids`` (finished or aborted requests)."""
        with self._keys_lock:
            for rid in request_ids:
                self._known.pop(rid, None)

    # ----- the API ----------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None, *, start: int = 0,
               limit: int | None = None, request_id: str | None = None, record: bool = True) -> Found:
        """The prefix of ``token_ids`` kvlayer can load (no data moved): ``Found.num_tokens``
        leading tokens, at most ``limit`` (default: all), for a request that holds its first
        ``start`` already, and the chunk objects to read with their tiers. With sliding windows
        (``KVLayout.layer_windows``) only what the layers can still attend to is asked for
        (``kvlayer.windows.find_prefix``), so this is exactly what ``retrieve`` loads.
        ``request_id`` keeps the request's keys for later calls (``forget`` drops them);
        ``record=False`` leaves the lookup counters alone. The one lookup of every adapter."""
        keys = self._request_keys(request_id, token_ids, cache_salt)
        limit = len(token_ids) if limit is None else min(limit, len(token_ids))
        return find_prefix(self.tiers, self.layout, keys, start, limit, record)

    def start_step(self, spec: StepSpec, caches: Sequence[torch.Tensor]) -> StepTransfer:
        """Start one engine step's loads and prepare its saves over ``caches`` (one paged view
        per layer, as ``layout.paged_view`` gives them); see ``kvlayer.step``. Keys come from the
        requests' kept keys (``lookup(request_id=...)``). Never raises for a tier failure."""
        return StepTransfer(self.step_context(), spec, caches)

    def step_context(self, keys: list[ChunkKey] | None = None, threads: int | None = None) -> StepContext:
        """The step layer's view of this engine, for a ``StepTransfer`` of one's own (an async
        load's): ``keys`` those of a one-off transfer's tokens (None: the requests' kept keys),
        ``threads`` the threads its CPU scatter may use (None: torch's). Makes the loader thread
        on first use: call it on the thread that starts the steps."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvlayer-load")
            if self.device.type == "cuda":
                self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return StepContext(self.tiers, self.chunk_staging, self.groups, self.layout, self.device,
                           self.config.layerwise, self._request_keys if keys is None else lambda *_: keys,
                           self._relookup, self._loader,
                           self._streams, threads or torch.get_num_threads(), self.config.storage_quantization)

    def _relookup(self, keys: Sequence[ChunkKey], start: int, limit: int) -> Found:
        return find_prefix(self.tiers, self.layout, keys, start, limit, False)

    def store(self, token_ids: Sequence[int], kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
              cache_salt: str | None = None) -> int:
        """Store the chunks of ``token_ids`` whose KV sits in ``kv_caches`` at ``slot_mapping``.

        ``kv_caches``: one per layer, laid out as ``layout.paged_view`` sees them (the engine's own
        tensors for the default layout). ``slot_mapping`` holds one slot per token of
        ``token_ids`` (int64, caches' device), or one block id per block for a layout of opaque
        blocks (``KVLayout.copy_unit``).
        Chunks already held are skipped. Returns how many chunk objects were handed to the
        tiers; lower tiers are written in the background. Never raises for a tier failure;
        ``ValueError`` if ``slot_mapping`` is too short.
        """
        keys = self.keys(token_ids, cache_salt)
        if not keys:
            return 0
        end = keys[-1].end
        self._check_slots(slot_mapping, end)
        spec = StepSpec(saves=(SaveSpec("store", cache_salt, tuple(token_ids[:end]), (), 0),))
        step = StepTransfer(self.step_context(keys), spec, kv_caches, slots={"store": slot_mapping})
        step.finish()
        return step.counts.saved_chunks

    def retrieve(self, token_ids: Sequence[int], kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                 cache_salt: str | None = None, start: int = 0) -> int:
        """Write the longest available prefix of ``token_ids`` into ``kv_caches`` at ``slot_mapping``.

        Tokens before ``start`` are not written (the engine already holds them); slots are
        given for every token of ``token_ids``. With sliding windows (``KVLayout.layer_windows``)
        a window layer's KV is written only where a query after the prefix can read it
        (``lookup``). Returns the number of leading tokens now available (including those
        before ``start``), or ``start`` if nothing after it was.
        """
        keys = self.keys(token_ids, cache_salt)
        found = find_prefix(self.tiers, self.layout, keys, start, len(token_ids), False)  # the caller's lookup counted
        if found.num_tokens <= start:
            return start
        end = found.num_tokens
        self._check_slots(slot_mapping, end)
        load = LoadSpec("retrieve", cache_salt, (), (), start, end, found.sources)
        step = StepTransfer(self.step_context(keys), StepSpec(loads=(load,)), kv_caches,
                            slots={"retrieve": slot_mapping})
        return step.finish().get("retrieve", end)

    def _check_slots(self, slot_mapping: torch.Tensor, end: int) -> None:
        need = -(-end // self.layout.copy_unit)
        if len(slot_mapping) < need:
            raise ValueError(f"slot_mapping has {len(slot_mapping)} slots for {end} tokens (needs {need})")

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
            if self._loader is not None:
                self._loader.shutdown(wait=True)
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

    def listen(self, listener: TierListener | None) -> None:
        """Tell ``listener`` of every chunk entering or leaving any tier (None: stop)."""
        for backend in self.backends:
            backend.set_listener(listener)

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

    def evict(self, keys: Sequence[ChunkKey], tiers: Sequence[str] | None = None) -> tier_admin.Outcome:
        """Remove the present, unpinned ``keys`` from ``tiers`` (every tier if None), counting what
        was removed, kept because pinned, and missing apart (``tier_admin.evict``)."""
        return tier_admin.evict(self.tiers, keys, tiers)

    def copy_prefix(self, keys: Sequence[ChunkKey], dst_tier: str, src_tier: str | None = None) -> tier_admin.Outcome:
        """Copy the longest prefix of ``keys`` held in ``src_tier`` (None: any other tier) into
        ``dst_tier``: what was copied, what was missing, and how many leading keys ``dst_tier``
        then holds (``tier_admin.copy_prefix``)."""
        return tier_admin.copy_prefix(self.tiers, keys, dst_tier, src_tier)

    def move(self, keys: Sequence[ChunkKey], dst_tier: str, src_tier: str) -> tier_admin.Outcome:
        """Copy, then remove from ``src_tier`` what ``dst_tier`` holds; pinned chunks stay (``tier_admin.move``)."""
        return tier_admin.move(self.tiers, keys, dst_tier, src_tier)

    def pinned(self, tier: str | None = None, keys: Sequence[ChunkKey] | None = None) -> tier_admin.Pinned:
        """Per tier, the pinned chunks and their pin counts (of ``keys`` only, if given; ``tier_admin.pinned``)."""
        return tier_admin.pinned(self.tiers, tier, keys)

    def evict_all(self, tier: str | None = None) -> int:
        """Remove every unpinned chunk from ``tier`` (every tier if None); returns how many."""
        return tier_admin.remove_all(self.tiers, tier)

    def drop_private_memory(self) -> int:
        """Remove every unpinned chunk from this process's own memory tiers (gpu, cpu; never a
        shared one), as after the engine's cache reset; returns how many."""
        return sum(self.evict_all(t) for t in self.tiers.tier_names if t in PRIVATE_MEMORY_TIERS)
