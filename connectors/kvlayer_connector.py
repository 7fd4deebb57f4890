"""``KVLayerConnector``: drives kvlayer for the bundled engine through the connector interface.

Scheduler side: looks up each new request's chunks (keys cached per request) and tells the
engine how many prompt tokens it can load, and remembers which tier holds each chunk; per
step it lists the loads (tokens, blocks and those tiers) and the saves (full chunks whose KV
this step completes). Worker side (``kvlayer.pipeline``): a layer-by-layer step
(``layerwise``, see ``kvlayer.config.LAYERWISE``) has ``start_load_kv`` read the step's chunks
on a loader thread, which copies them into the cache layer by layer while the forward pass runs
(``wait_for_layer_load(i)`` waits for layer i only), and ``save_kv_layer`` copies each layer of
the new chunks out right after its attention; otherwise everything is loaded before the
forward pass (and, with ``off``, saved after it). ``wait_for_save`` waits for the copies only: the
lower tiers are written in the background. A failed load is reported through
``get_failed_loads`` and recomputed by the engine, and the chunks it left unsaved are saved
after the recompute; nothing here raises into the engine.

A model whose every layer has a sliding window lets the engine release a running request's
leading blocks once no window reaches them: their block ids become negative
(``engine.block_manager.FREED_BLOCK``). A chunk that is due while one of its blocks is released
is not saved (``num_skipped_saves``); loads go only into blocks allocated at admission, which
are all held.

With sliding windows the tiers are window-aware (``kvlayer.windows``): a hit loads a window
layer's KV only where a query after the prefix can read it, a hybrid's chunks are one object
per window group, and the engine learns where the loaded KV holds every layer
(``get_kv_complete_from``). Chunks a window-aware load covered are never saved again: their
window layers' KV was not loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.config import KVLayerConfig
from kvlayer.connectors.base import (
    ConnectorMetadata,
    ConnectorRequest,
    KVConnectorBase,
    KVConnectorContext,
    SchedulerOutput,
)
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.pipeline import LoadItem, LoadJob, SaveItem, SaveJob, finish_saves, loads_layerwise
from kvlayer.transfer import slot_mapping
from kvlayer.windows import Found, save_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of the request (chunk ``keys`` from token 0) into its blocks,
    each found chunk from the tier the scheduler's lookup found it in (``sources``)."""

    request_id: str
    keys: tuple[ChunkKey, ...]
    sources: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int
    whole: bool = False


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the chunks ``keys`` of the request (KV in its blocks; keys may skip leading chunks
    already saved)."""

    request_id: str
    keys: tuple[ChunkKey, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVLayerMetadata(ConnectorMetadata):
    loads: tuple[LoadSpec, ...]
    saves: tuple[SaveSpec, ...]


@dataclass(slots=True)
class _ReqState:
    salt: str | None
    keys: list[ChunkKey]
    saved_upto: int = 0
    matched: tuple[int, int] = (0, 0)
    found: Found = Found(0)
    load: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class _Streams:
    """The CUDA streams loads and saves copy on (None off CUDA)."""

    load: torch.cuda.Stream | None = None
    store: torch.cuda.Stream | None = None

    @staticmethod
    def for_device(device: torch.device) -> _Streams:
        if device.type != "cuda":
            return _Streams()
        return _Streams(torch.cuda.Stream(device), torch.cuda.Stream(device))


class KVLayerConnector(KVConnectorBase):
    """kvlayer as the bundled engine's connector. ``kv_config``: a KVLayerConfig, dict or YAML path."""

    def __init__(self, kv_config: Any, ctx: KVConnectorContext,
                 kv: KVCacheEngine | None = None) -> None:
        config = KVLayerConfig.load(kv_config) if kv is None else kv.config
        layout = KVLayout(ctx.num_layers, ctx.num_kv_heads, ctx.head_dim, ctx.dtype, ctx.block_size,
                          layer_windows=ctx.layer_windows if config.window_aware else ())
        self.kv = kv or KVCacheEngine(
            config, layout, ctx.device, model_name=ctx.model_name,
            model_fingerprint=ctx.model_fingerprint, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.config = self.kv.config
        self.block_size = ctx.block_size
        self.device = torch.device(ctx.device)
        self._reqs: dict[str, _ReqState] = {}
        self._caches: list[torch.Tensor] = []
        self._load: LoadJob | None = None
        self._save: SaveJob | None = None
        self._failed: dict[str, int] = {}
        self._rolled_back: dict[str, int] = {}  # worker -> scheduler: valid tokens after a failed load
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvlayer-load")
        self._streams = _Streams.for_device(self.device)
        self.num_skipped_saves = 0  # chunks not saved because a sliding window released their blocks
        self._agent: Any = None  # the controller link, only with controller_url
        if self.config.controller_url:
            from kvlayer.controller.agent import start_agent

            self._agent = start_agent(self.kv, self.config, address=self.config.instance_address)

    @property
    def agent(self) -> Any:
        """The controller agent (``kvlayer.controller.agent.ControllerAgent``), or None without
        ``controller_url`` or when it could not start."""
        return self._agent

    # ----- scheduler side ---------------------------------------------------------------
    def _state(self, rid: str, token_ids: Sequence[int], num_prompt: int, salt: str | None) -> _ReqState:
        """The request's state, its keys covering what may be stored of ``token_ids``."""
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _ReqState(salt, [])
        limit = len(token_ids) if self.config.save_decode_cache else num_prompt
        if not st.keys or st.keys[-1].end < limit:
            full = [k for k in st.keys if k.num_tokens == self.config.chunk_size]
            st.keys = self.kv.keys(token_ids[:limit], salt, prefix=full)
        return st

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        st = self._state(request.request_id, request.token_ids, len(request.prompt_token_ids),
                         request.cache_salt)
        found = self.kv.find_prefix(st.keys, num_computed_tokens, len(request.token_ids) - 1)
        st.matched, st.found = (num_computed_tokens, found.num_tokens), found
        return max(0, found.num_tokens - num_computed_tokens)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens > 0:
            start = st.matched[0]
            st.load = (start, start + num_external_tokens)
            if self.kv.layout.windowed:  # the chunks it covers lack window KV where no query reads it
                st.saved_upto = max([st.saved_upto] + [k.end for k in st.keys if k.end <= st.load[1]])

    def get_kv_complete_from(self, request: ConnectorRequest) -> int:
        st = self._reqs.get(request.request_id)
        return 0 if st is None or st.load is None else max(st.load[0], st.found.all_layers_from)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVLayerMetadata:
        for rid in scheduler_output.finished_request_ids:
            self._reqs.pop(rid, None)
        rolled_back, self._rolled_back = self._rolled_back, {}
        for rid, valid in rolled_back.items():  # what a failed load left unsaved is saved again
            if rid in self._reqs:
                self._reqs[rid].saved_upto = min(self._reqs[rid].saved_upto, valid)
        loads, saves = [], []
        for s in scheduler_output.scheduled:
            st = self._state(s.request_id, s.token_ids, s.num_prompt_tokens, s.cache_salt)
            if st.load is not None:
                start, end = st.load
                st.load = None
                loads.append(LoadSpec(s.request_id, st.found.keys, st.found.sources, tuple(s.block_ids), start, end,
                                      self.kv.layout.windowed))
            done = s.num_computed_tokens + s.num_scheduled_tokens
            due = [k for k in st.keys if st.saved_upto < k.end <= done]
            if due:
                held = [k for k in due if self._holds(s.block_ids, k)]
                self._count_skipped(len(due) - len(held))
                if held:
                    saves.append(SaveSpec(s.request_id, tuple(save_keys(self.kv.layout, held)), tuple(s.block_ids)))
                st.saved_upto = due[-1].end
        return KVLayerMetadata(tuple(loads), tuple(saves))

    def _holds(self, block_ids: Sequence[int], key: ChunkKey) -> bool:
        """Whether every block of chunk ``key`` is held (none released by a sliding window)."""
        return min(block_ids[key.start // self.block_size : -(-key.end // self.block_size)]) >= 0

    def _count_skipped(self, count: int) -> None:
        if count and not self.num_skipped_saves:
            log.info("kvlayer: chunks whose blocks a sliding window released are not saved")
        self.num_skipped_saves += count

    # ----- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self._caches = list(kv_caches)

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        assert isinstance(metadata, KVLayerMetadata)
        self._failed = {}
        self._load = self._save = None
        try:
            kv = self.kv
            self._save = SaveJob(kv.tiers, kv.chunk_staging, [
                SaveItem(s.request_id, s.keys, self._slots(s.block_ids, s.keys[-1].end)) for s in metadata.saves
            ], self._streams.store)
            items = [LoadItem(ld.request_id, ld.keys, ld.sources, self._slots(ld.block_ids, ld.end), ld.start, ld.end,
                              ld.whole) for ld in metadata.loads]
            if items:
                layerwise = loads_layerwise(self.config.layerwise, self.device, kv.tiers, items)
                self._load = LoadJob(kv.tiers, kv.chunk_staging, kv.groups, self._caches, items,
                                     self._loader if layerwise else None, self._streams.load if layerwise else None)
        except Exception:  # a bug below must cost a recompute, never the engine
            log.exception("kvlayer: preparing the step's transfers failed")
            self._failed = {ld.request_id: ld.start for ld in metadata.loads}

    def wait_for_layer_load(self, layer: int) -> None:
        if self._load is not None:
            self._load.wait_layer(layer)

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        if self._save is not None and self.config.layerwise != "off":
            self._save.layer(layer, kv_cache)

    def wait_for_save(self) -> None:
        load, save, self._load, self._save = self._load, self._save, None, None
        if load is not None:
            self._failed.update(load.failures())
        self._rolled_back.update(self._failed)
        finish_saves(save, self._caches, self._failed, self.config.layerwise == "off")

    def _slots(self, block_ids: Sequence[int], end: int) -> torch.Tensor:
        return slot_mapping(block_ids, self.block_size, 0, end, self.device)

    def get_failed_loads(self) -> dict[str, int]:
        return dict(self._failed)

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        """Forget the request (finished, or aborted between steps): every save of it is done."""
        self._reqs.pop(request.request_id, None)
        return False

    def flush_writes(self, timeout: float) -> bool:
        """Wait until every chunk saved so far is written to every tier (a prefill instance
        does this before a decode instance reads its KV from the shared tier); False if
        ``timeout`` seconds passed first. Callable from any thread."""
        return self.kv.flush(timeout)

    @property
    def num_tracked_requests(self) -> int:
        """Requests whose keys and progress this connector still holds (0 once all finished)."""
        return len(self._reqs)

    def stats(self) -> dict[str, Any]:
        return self.kv.stats()

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()
        self._loader.shutdown(wait=True)
        self.kv.close()
