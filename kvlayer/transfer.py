"""Copies between the engine's paged KV cache and kvlayer chunks: one gather, one scatter.

A paged cache is one tensor per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``;
``slots`` (int64, on the caches' device) names the cache slot of each chunk token. These
torch versions run on any device; faster kernels replace them here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Slots of token positions ``[start, end)`` of a sequence with block table ``block_ids``."""
    pos = torch.arange(start, end, dtype=torch.long)
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    return (table[pos // block_size] * block_size + pos % block_size).to(device)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    two, blocks, bs, heads, dim = cache.shape
    return cache.view(two, blocks * bs, heads, dim)


def gather_layer(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:, i] = cache slot slots[i]`` for one layer; ``out`` is ``[2, n, kv_heads, head_dim]``."""
    flat = _flat(cache)
    if out.device == flat.device and out.is_contiguous():
        torch.index_select(flat, 1, slots, out=out)
    else:
        out.copy_(flat.index_select(1, slots), non_blocking=True)


def scatter_layer(chunk_layer: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``chunk_layer`` ``[2, n, kv_heads, head_dim]`` into one layer's cache at ``slots``."""
    src = chunk_layer.to(cache.device, non_blocking=True)
    _flat(cache).index_copy_(1, slots, src)


def gather(caches: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
    """All layers: ``out`` ``[num_layers, 2, n, kv_heads, head_dim]`` from ``caches`` at ``slots``."""
    for layer, cache in enumerate(caches):
        gather_layer(cache, slots, out[layer])


def scatter(chunk: torch.Tensor, caches: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
    """All layers: write ``chunk`` ``[num_layers, 2, n, kv_heads, head_dim]`` into ``caches`` at ``slots``."""
    for layer, cache in enumerate(caches):
        scatter_layer(chunk[layer], cache, slots)
