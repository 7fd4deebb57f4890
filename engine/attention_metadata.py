"""What one forward pass needs to know to run attention over the paged KV cache.

The step's tokens are flattened into one batch of ``T`` tokens: first ``num_decodes``
single-token decodes (one per sequence), then the prefill spans in order. Every token's new
key/value is written at ``slot_mapping[t]`` (``block * block_size + offset``) of the layer's
cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` before attention reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """Tokens ``[start, end)`` of the flat batch: one sequence's query tokens in this step.

    ``context_len`` is how many of the sequence's tokens are in the cache once this span is
    written (its cached prefix + ``end - start``); the span's query at position ``i`` attends
    causally to cache positions ``[0, context_len - (end - start) + i]`` (a sliding-window
    layer to the last ``window`` of them). ``block_table`` holds the sequence's blocks (int64, at
    least ``ceil(context_len / block_size)`` entries; those no window reaches any more may be
    ``block_manager.FREED_BLOCK``, on a model whose every layer slides).
    """

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_cached(self) -> int:
        return self.context_len - (self.end - self.start)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step attention inputs; tensors live on the engine's device.

    ``decode_block_tables`` is ``[num_decodes, max_blocks]`` int64 (rows padded with any valid
    block id; released entries as in ``PrefillSpan``), ``decode_context_lens``
    ``[num_decodes]`` int64 (tokens in cache, the new one included). ``biases`` memoises the
    step's additive attention masks (filled by ``attention.py`` on the first layer's use,
    shared by every layer of the step).
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefills: tuple[PrefillSpan, ...]
    block_size: int
    biases: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)


class LayerHooks(Protocol):
    """Called by the model around each layer's attention (the connector's per-layer hooks).

    ``before_attention(i)`` runs after layer ``i`` wrote its new KV into the cache and before
    attention reads the cache; ``after_attention(i, kv_cache)`` right after attention.
    """

    def before_attention(self, layer: int) -> None: ...

    def after_attention(self, layer: int, kv_cache: torch.Tensor) -> None: ...


class NoHooks:
    """Hooks that do nothing (no connector)."""

    def before_attention(self, layer: int) -> None:
        pass

    def after_attention(self, layer: int, kv_cache: torch.Tensor) -> None:
        pass
