"""``KVLayerConnector``: drives kvlayer for the bundled engine through the connector interface.

Scheduler side: looks up each new request's chunks (keys cached per request) and tells the
engine how many prompt tokens it can load; per step it lists the loads (tokens and blocks)
and the saves (full chunks whose KV this step completes). Worker side: loads before the
forward pass and saves after it, all through ``KVCacheEngine``. A failed load is reported
through ``get_failed_loads`` and recomputed by the engine; nothing here raises into it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.connectors.base import (
    ConnectorMetadata,
    ConnectorRequest,
    KVConnectorBase,
    KVConnectorContext,
    SchedulerOutput,
)
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.transfer import slot_mapping

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of ``token_ids`` into the request's blocks."""

    request_id: str
    token_ids: tuple[int, ...]
    keys: tuple[ChunkKey, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the chunks ``keys`` of ``token_ids`` (KV in the request's blocks; keys may skip
    leading chunks already saved)."""

    request_id: str
    token_ids: tuple[int, ...]
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
    load: tuple[int, int] | None = None


class KVLayerConnector(KVConnectorBase):
    """kvlayer as the bundled engine's connector. ``kv_config``: a KVLayerConfig, dict or YAML path."""

    def __init__(self, kv_config: Any, ctx: KVConnectorContext,
                 cache_engine: KVCacheEngine | None = None) -> None:
        layout = KVLayout(ctx.num_layers, ctx.num_kv_heads, ctx.head_dim, ctx.dtype, ctx.block_size)
        self.engine = cache_engine or KVCacheEngine(
            kv_config, layout, ctx.device, model_name=ctx.model_name,
            model_fingerprint=ctx.model_fingerprint, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.config = self.engine.config
        self.block_size = ctx.block_size
        self.device = ctx.device
        self._reqs: dict[str, _ReqState] = {}
        self._caches: list[torch.Tensor] = []
        self._meta: KVLayerMetadata | None = None
        self._failed: dict[str, int] = {}

    # ----- scheduler side ---------------------------------------------------------------
    def _state(self, rid: str, token_ids: Sequence[int], num_prompt: int, salt: str | None) -> _ReqState:
        """The request's state, its keys covering what may be stored of ``token_ids``."""
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _ReqState(salt, [])
        limit = len(token_ids) if self.config.save_decode_cache else num_prompt
        if not st.keys or st.keys[-1].end < limit:
            full = [k for k in st.keys if k.num_tokens == self.config.chunk_size]
            st.keys = self.engine.keys(token_ids[:limit], salt, prefix=full)
        return st

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        st = self._state(request.request_id, request.token_ids, len(request.prompt_token_ids),
                         request.cache_salt)
        usable = min(self.engine.lookup_keys(st.keys), len(request.token_ids) - 1)
        st.matched = (num_computed_tokens, usable)
        return max(0, usable - num_computed_tokens)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens > 0:
            start = st.matched[0]
            st.load = (start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVLayerMetadata:
        for rid in scheduler_output.finished_request_ids:
            self._reqs.pop(rid, None)
        loads, saves = [], []
        for s in scheduler_output.scheduled:
            st = self._state(s.request_id, s.token_ids, s.num_prompt_tokens, s.cache_salt)
            if st.load is not None:
                start, end = st.load
                st.load = None
                loads.append(LoadSpec(s.request_id, tuple(s.token_ids[:end]), tuple(st.keys),
                                      tuple(s.block_ids), start, end))
            done = s.num_computed_tokens + s.num_scheduled_tokens
            due = [k for k in st.keys if st.saved_upto < k.end <= done]
            if due:
                saves.append(SaveSpec(s.request_id, tuple(s.token_ids[: due[-1].end]), tuple(due),
                                      tuple(s.block_ids)))
                st.saved_upto = due[-1].end
        return KVLayerMetadata(tuple(loads), tuple(saves))

    # ----- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self._caches = list(kv_caches)

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        assert isinstance(metadata, KVLayerMetadata)
        self._meta = metadata
        self._failed = {}
        for load in metadata.loads:
            slots = slot_mapping(load.block_ids, self.block_size, 0, load.end, self.device)
            try:
                got = self.engine.retrieve(load.token_ids, self._caches, slots, start=load.start,
                                           keys=load.keys)
            except Exception:  # a bug below must cost a recompute, never the engine
                log.exception("kvlayer: load of request %s failed", load.request_id)
                got = load.start
            if got < load.end:
                self._failed[load.request_id] = got

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        pass

    def wait_for_save(self) -> None:
        meta, self._meta = self._meta, None
        if meta is None:
            return
        for save in meta.saves:
            end = len(save.token_ids)
            slots = slot_mapping(save.block_ids, self.block_size, 0, end, self.device)
            try:
                self.engine.store(save.token_ids, self._caches, slots, keys=save.keys)
            except Exception:
                log.exception("kvlayer: save of request %s failed", save.request_id)

    def get_failed_loads(self) -> dict[str, int]:
        return dict(self._failed)

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def close(self) -> None:
        self.engine.close()
