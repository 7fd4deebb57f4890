"""The connector interface between an inference engine and a KV store (docs/architecture.md section 2).

Shaped like vLLM's ``KVConnectorBase_V1``. One object plays both roles in the bundled engine:

Scheduler side (engine thread, between steps):
  1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: how many prompt tokens
     beyond the engine's own prefix-cache hits the connector can supply (no data moved).
  2. ``update_state_after_alloc(request, block_ids, num_external_tokens)``: blocks were
     allocated; tokens ``[num_computed, num_computed + num_external)`` must be loaded into them.
  3. ``build_connector_meta(scheduler_output)``: a plain, typed object telling the worker
     what to load and save in this step.
  4. ``request_finished(request, block_ids)``: True if the blocks must stay allocated until
     ``get_finished`` reports the request's asynchronous save as done.

Worker side (around and inside the forward pass):
  ``register_kv_caches`` once; per step ``start_load_kv(meta)`` before the forward,
  ``wait_for_layer_load(layer)`` before a layer's attention reads the cache,
  ``save_kv_layer(layer, kv_cache)`` after the layer wrote its new KV, ``wait_for_save()``
  after the forward: it returns once the blocks may be reused (copies out of the paged cache
  done), never waiting for disk or network writes.

A connector must never raise into the engine for a storage failure: a load that fails
is reported through ``get_failed_loads`` and the engine recomputes those tokens.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class ConnectorRequest(Protocol):
    """What the connector may read of an engine request."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def token_ids(self) -> Sequence[int]:
        """Prompt plus generated tokens so far."""
        ...

    @property
    def cache_salt(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step.

    Tokens ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)`` are computed
    in this step; ``block_ids`` is the request's whole block table after allocation;
    ``token_ids`` are all the request's tokens known now (prompt + generated).
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    block_ids: Sequence[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What the scheduler decided for one step, as the connector sees it."""

    scheduled: tuple[ScheduledRequest, ...]
    finished_request_ids: tuple[str, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class KVConnectorContext:
    """What a connector is built with: the model's identity and its KV cache's layout."""

    model_name: str
    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    device: torch.device
    tp_rank: int = 0
    tp_size: int = 1
    layer_windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: full attention), or ``()`` when no layer slides."""


class ConnectorMetadata:
    """Base of the per-step metadata a connector hands from its scheduler side to its worker side."""


class KVConnectorBase(abc.ABC):
    """The connector interface; see the module docstring for the call order and contracts."""

    # ----- scheduler side --------------------------------------------------------------
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        """Prompt tokens after ``num_computed_tokens`` the connector can load (>= 0).

        Must leave at least one prompt token to compute (the engine needs its logits).
        """

    @abc.abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """Blocks are allocated for the request; remember to load ``num_external_tokens`` into them."""

    def get_kv_complete_from(self, request: ConnectorRequest) -> int:
        """After ``update_state_after_alloc`` with external tokens: the first position from which
        what the connector loads holds every layer's KV. A window-aware load of a model with
        sliding windows writes a window layer's KV only where a later query can read it, so
        tokens before this position hold the full-attention layers' KV only (or none): the
        engine must not offer their blocks to other requests through its prefix cache.
        Default 0: every layer of every loaded token."""
        return 0

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        """Package this step's loads and saves for the worker side."""

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        """The request is done; True to keep its blocks until ``get_finished`` lists it."""
        return False

    def get_finished(self) -> set[str]:
        """Ids of requests whose delayed block release (see ``request_finished``) may now happen."""
        return set()

    def get_failed_loads(self) -> dict[str, int]:
        """Requests whose external tokens could not all be loaded in the last step.

        Maps request id -> how many leading tokens of it are valid in the paged cache. The
        engine discards that step's output for those requests and recomputes from there.
        Called after ``wait_for_save``.
        """
        return {}

    # ----- worker side -----------------------------------------------------------------
    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """The engine's paged caches, one ``[2, num_blocks, block_size, kv_heads, head_dim]`` per layer."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Start loading this step's external tokens into the paged cache."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Block until ``layer``'s external KV for this step is in the paged cache."""

    @abc.abstractmethod
    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        """``layer`` has written this step's new KV into ``kv_cache``; start saving what is due."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the paged cache."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work and release resources."""
