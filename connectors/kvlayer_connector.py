"""``KVLayerConnector``: kvlayer as the bundled engine's connector (docs/architecture.md section 2).

A translation layer over the step layer (section 13): the scheduler side's hooks feed a
``RequestTracker`` (one window-aware lookup per admission, keys kept per request by the
``KVCacheEngine``), ``build_connector_meta`` is its ``StepSpec``, and the worker side runs one
``StepTransfer`` per step: loads layer by layer beside the forward pass (``wait_for_layer_load``),
saves copied out after each layer's attention (``save_kv_layer``), ``wait_for_save`` waiting for
the copies only. A failed load is reported through ``get_failed_loads`` and recomputed, and
what it left unsaved is saved after the recompute; nothing here raises into the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from kvlayer.connectors.controller_link import link_controller
from kvlayer.layout import KVLayout
from kvlayer.requests import RequestTracker, SavePolicy
from kvlayer.step import StepSpec, StepTransfer
from kvlayer.windows import Found


class KVLayerMetadata(StepSpec, ConnectorMetadata):
    """One step's ``StepSpec``, as the engine's connector metadata."""


class KVLayerConnector(KVConnectorBase):
    """kvlayer as the bundled engine's connector. ``kv_config``: a KVLayerConfig, dict or YAML
    path; ``kv``: an engine to use instead of building one (its config then counts)."""

    def __init__(self, kv_config: Any, ctx: KVConnectorContext, kv: KVCacheEngine | None = None) -> None:
        config = KVLayerConfig.load(kv_config) if kv is None else kv.config
        layout = KVLayout(ctx.num_layers, ctx.num_kv_heads, ctx.head_dim, ctx.dtype, ctx.block_size,
                          layer_windows=ctx.layer_windows if config.window_aware else ())
        self.kv = kv or KVCacheEngine(
            config, layout, ctx.device, model_name=ctx.model_name,
            model_fingerprint=ctx.model_fingerprint, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.config = self.kv.config
        policy = SavePolicy(self.config.chunk_size, self.config.save_decode_cache, self.config.save_partial_chunks,
                            self.kv.layout.windowed)
        self._tracker = RequestTracker(self._lookup, policy, ctx.block_size,
                                       verify_fraction=self.config.verify_fraction)
        self._caches: list[torch.Tensor] = []
        self._step: StepTransfer | None = None
        self._failed: dict[str, int] = {}
        self._agent = link_controller(self.kv)

    @property
    def agent(self) -> Any:
        """The controller agent, or None without ``controller_url`` or when it could not start."""
        return self._agent

    @property
    def num_skipped_saves(self) -> int:
        """Chunks not saved because a sliding window released their blocks."""
        return self._tracker.skipped_saves

    @property
    def num_tracked_requests(self) -> int:
        """Requests whose progress this connector still holds (0 once all finished)."""
        return len(self._tracker)

    # ----- scheduler side ---------------------------------------------------------------
    def _lookup(self, rid: str, token_ids: Sequence[int], salt: str | None, start: int, limit: int) -> Found:
        return self.kv.lookup(token_ids, salt, start=start, limit=limit, request_id=rid)

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        return self._tracker.matched(request.request_id, request.token_ids, len(request.prompt_token_ids),
                                     request.cache_salt, num_computed_tokens)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        self._tracker.allocated(request.request_id, block_ids, num_external_tokens)

    def get_kv_complete_from(self, request: ConnectorRequest) -> int:
        return self._tracker.complete_from(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVLayerMetadata:
        for rid in scheduler_output.finished_request_ids:
            self._forget(rid)
        loads, saves = [], []
        for s in scheduler_output.scheduled:
            self._tracker.update(s.request_id, s.token_ids, s.num_prompt_tokens, s.cache_salt, s.block_ids)
            load, save = self._tracker.step(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens)
            loads += [load] if load is not None else []
            saves += [save] if save is not None else []
        return KVLayerMetadata(tuple(loads), tuple(saves))

    # ----- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self._caches = list(kv_caches)

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        assert isinstance(metadata, StepSpec)
        self._failed = {}
        self._step = self.kv.start_step(metadata, self._caches)

    def wait_for_layer_load(self, layer: int) -> None:
        if self._step is not None:
            self._step.wait_layer(layer)

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        if self._step is not None:
            self._step.save_layer(layer, kv_cache)

    def wait_for_save(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            self._failed = step.finish()
        for rid, valid in self._failed.items():  # what a failed load left unsaved is saved again
            self._tracker.load_failed(rid, valid)

    def get_failed_loads(self) -> dict[str, int]:
        return dict(self._failed)

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        """Forget the request (finished, or aborted between steps): every save of it is done."""
        self._forget(request.request_id)
        return False

    def _forget(self, rid: str) -> None:
        self._tracker.finished(rid)
        self.kv.forget([rid])

    def flush_writes(self, timeout: float) -> bool:
        """Wait until every chunk saved so far is written to every tier (a prefill instance
        does this before a decode instance reads its KV from the shared tier); False if
        ``timeout`` seconds passed first. Callable from any thread."""
        return self.kv.flush(timeout)

    def stats(self) -> dict[str, Any]:
        return self.kv.stats()

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()
        self.kv.close()
