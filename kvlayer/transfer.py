"""Copies between the engine's paged KV cache and kvlayer chunks: one gather, one scatter.

A paged cache is one tensor per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``;
``slots`` (int64, on the caches' device) names the cache slot of each chunk token. Each call
runs the Triton kernels of ``kvlayer.kernels.copy_ops`` when ``use_triton`` says so (default:
the caches are on CUDA and triton is installed), else the torch code below, which runs on any
device. A chunk in host memory while the caches are on the GPU goes through a device staging
buffer and one bulk ``copy_(non_blocking=True)``: from pinned memory that copy is asynchronous
on the current stream, so the caller must synchronise before reading a gathered host chunk
or reusing a scattered one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvlayer.kernels import triton_available


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Slots of token positions ``[start, end)`` of a sequence with block table ``block_ids``."""
    pos = torch.arange(start, end, dtype=torch.long)
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    return (table[pos // block_size] * block_size + pos % block_size).to(device)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    two, blocks, bs, heads, dim = cache.shape
    return cache.view(two, blocks * bs, heads, dim)


def _use_triton(use_triton: bool | None, cache: torch.Tensor) -> bool:
    """The explicit choice, else whether ``cache`` is on CUDA with triton installed."""
    if use_triton is not None:
        return use_triton
    return cache.is_cuda and triton_available()


def _direct(chunk: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the kernels can address ``chunk`` in place (same device, contiguous token rows)."""
    from kvlayer.kernels.copy_ops import rows_contiguous

    return chunk.device == cache.device and rows_contiguous(chunk)


def gather_layer(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                 use_triton: bool | None = None) -> None:
    """``out[:, i] = cache slot slots[i]`` for one layer; ``out`` is ``[2, n, kv_heads, head_dim]``."""
    if _use_triton(use_triton, cache):
        from kvlayer.kernels import copy_ops

        _gather_staged(copy_ops.gather_layer, cache, cache, slots, out)
        return
    flat = _flat(cache)
    if out.device == flat.device and out.is_contiguous():
        torch.index_select(flat, 1, slots, out=out)
    else:
        out.copy_(flat.index_select(1, slots), non_blocking=True)


def scatter_layer(chunk_layer: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                  use_triton: bool | None = None) -> None:
    """Write ``chunk_layer`` ``[2, n, kv_heads, head_dim]`` into one layer's cache at ``slots``."""
    src = chunk_layer.to(cache.device, non_blocking=True)
    if _use_triton(use_triton, cache):
        from kvlayer.kernels import copy_ops

        copy_ops.scatter_layer(src if _direct(src, cache) else src.contiguous(), cache, slots)
        return
    _flat(cache).index_copy_(1, slots, src)


def gather(caches: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor,
           use_triton: bool | None = None) -> None:
    """All layers: ``out`` ``[num_layers, 2, n, kv_heads, head_dim]`` from ``caches`` at ``slots``."""
    if caches and _use_triton(use_triton, caches[0]):
        from kvlayer.kernels import copy_ops

        _gather_staged(copy_ops.gather, caches, caches[0], slots, out)
        return
    for layer, cache in enumerate(caches):
        gather_layer(cache, slots, out[layer])


def scatter(chunk: torch.Tensor, caches: Sequence[torch.Tensor], slots: torch.Tensor,
            use_triton: bool | None = None) -> None:
    """All layers: write ``chunk`` ``[num_layers, 2, n, kv_heads, head_dim]`` into ``caches`` at ``slots``."""
    if caches and _use_triton(use_triton, caches[0]):
        from kvlayer.kernels import copy_ops

        src = chunk.to(caches[0].device, non_blocking=True)
        copy_ops.scatter(src if _direct(src, caches[0]) else src.contiguous(), caches, slots)
        return
    for layer, cache in enumerate(caches):
        scatter_layer(chunk[layer], cache, slots)


def wait_for_copies(device: torch.device) -> None:
    """Block until the copies queued on ``device``'s current stream are done (a no-op off CUDA):
    call it before reading a host chunk ``gather`` filled or reusing one ``scatter`` read."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


_Gather = Callable[[torch.Tensor | Sequence[torch.Tensor], torch.Tensor, torch.Tensor], None]


def _gather_staged(kernel: _Gather, caches: torch.Tensor | Sequence[torch.Tensor], cache: torch.Tensor,
                   slots: torch.Tensor, out: torch.Tensor) -> None:
    """Run ``kernel(caches, slots, dst)`` into ``out`` itself when it can, else into a device
    buffer moved to ``out`` by one bulk copy."""
    if _direct(out, cache):
        kernel(caches, slots, out)
        return
    staging = torch.empty(out.shape, dtype=out.dtype, device=cache.device)
    kernel(caches, slots, staging)
    out.copy_(staging, non_blocking=True)
