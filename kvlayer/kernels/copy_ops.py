"""Launch wrappers of ``copy_rows_kernel``: Triton gather and scatter between paged caches and chunks.

Every tensor here lives on one device (CUDA, or the CPU under ``TRITON_INTERPRET=1``);
``kvlayer.transfer`` chooses this path and handles host chunk buffers. Caches are contiguous
``[planes, num_blocks, block_size, kv_heads, head_dim]`` (planes 2: keys and values; 1: MLA's
latent, ``kvlayer.layout.LATENT_CACHE_LAYOUT``), one per layer, all of one shape and dtype
(float32, float16 or bfloat16). Chunk tensors are ``[num_layers, planes, n, kv_heads, head_dim]``
(one layer: ``[planes, n, kv_heads, head_dim]``) of the caches' dtype with any strides over the
leading dims, but each token's ``kv_heads * head_dim`` row contiguous (``rows_contiguous``).
``slots`` is ``[n]`` int64 or int32, contiguous: the cache slot (``block * block_size +
offset``) of each chunk token, in any order; a gather may read a slot many times, a scatter
with a repeated slot leaves one of its rows there (which one is unspecified).

All layers go in one launch: the engine allocates one tensor per layer, so the kernel reads
the layers' base addresses from a small int64 device table (made once per set of caches and
remembered, see ``_layer_table``) rather than requiring one stacked allocation.
Grid: ``(ceil(n / BLOCK_T), planes * layers)``; a program copies ``BLOCK_T`` rows of one layer's
keys or values in ``BLOCK_R``-element column tiles, about ``_TILE_ELEMENTS`` elements per tile.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton

from kvlayer.kernels.copy_kernels import copy_rows_kernel

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE_ELEMENTS = 4096
_MAX_BLOCK_R = 1024


def rows_contiguous(chunk: torch.Tensor) -> bool:
    """True when each token's ``[kv_heads, head_dim]`` row of ``chunk`` is contiguous."""
    return chunk.stride(-1) == 1 and (chunk.shape[-2] == 1 or chunk.stride(-2) == chunk.shape[-1])


def gather_layer(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:, i] = cache slot slots[i]`` for one layer; ``out`` is ``[planes, n, kv_heads, head_dim]``."""
    _check_caches([cache], slots, out[None])
    _launch(cache, cache, out[None], slots, layer_table=False, to_cache=False)


def scatter_layer(chunk_layer: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``chunk_layer`` ``[planes, n, kv_heads, head_dim]`` into one layer's ``cache`` at ``slots``."""
    _check_caches([cache], slots, chunk_layer[None])
    _launch(cache, cache, chunk_layer[None], slots, layer_table=False, to_cache=True)


def gather(caches: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
    """All layers in one launch: ``out`` ``[num_layers, planes, n, kv_heads, head_dim]`` from ``caches``."""
    _check_caches(caches, slots, out)
    _launch(_layer_table(caches), caches[0], out, slots, layer_table=True, to_cache=False)


def scatter(chunk: torch.Tensor, caches: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
    """All layers in one launch: write ``chunk`` ``[num_layers, planes, n, kv_heads, head_dim]`` into ``caches``."""
    _check_caches(caches, slots, chunk)
    _launch(_layer_table(caches), caches[0], chunk, slots, layer_table=True, to_cache=True)


def tiles(row_len: int, num_tokens: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_R)``: powers of two with ``BLOCK_T * BLOCK_R`` near ``_TILE_ELEMENTS``
    (whole rows when they fit ``_MAX_BLOCK_R``), ``BLOCK_T`` no larger than needed for ``num_tokens``."""
    block_r = min(triton.next_power_of_2(row_len), _MAX_BLOCK_R)
    block_t = min(max(1, _TILE_ELEMENTS // block_r), triton.next_power_of_2(max(1, num_tokens)))
    return block_t, block_r


def _launch(cache_arg: torch.Tensor, cache: torch.Tensor, chunk: torch.Tensor, slots: torch.Tensor, *,
            layer_table: bool, to_cache: bool) -> None:
    """Launch over ``chunk`` (5-D); ``cache_arg`` is the one cache or the layer table, ``cache``
    a cache of the shape all share."""
    n = slots.shape[0]
    if n == 0:
        return
    row_len = cache.shape[3] * cache.shape[4]
    block_t, block_r = tiles(row_len, n)
    planes = cache.shape[0]
    grid = (triton.cdiv(n, block_t), planes * chunk.shape[0])
    copy_rows_kernel[grid](
        cache_arg, chunk, slots, n, row_len, cache.stride(0),
        chunk.stride(0), chunk.stride(1), chunk.stride(2),
        LAYER_TABLE=layer_table, TO_CACHE=to_cache, BLOCK_T=block_t, BLOCK_R=block_r, PLANES=planes,
    )


def _layer_table(caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """The int64 device table of ``caches``' base addresses (remembered per set of addresses)."""
    return _table_for(tuple(c.data_ptr() for c in caches), caches[0].device)


@functools.lru_cache(maxsize=16)
def _table_for(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # only the addresses matter: a cache freed and another allocated at the same address is
    # served correctly by the same table, and a lookup costs no host-to-device copy
    return torch.tensor(addresses, dtype=torch.int64, device=device)


def _check_caches(caches: Sequence[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor) -> None:
    """ValueError unless ``caches``, ``slots`` and ``chunk`` (5-D) fit the contract above."""
    if not caches:
        raise ValueError("no caches given")
    first = caches[0]
    if first.dim() != 5 or first.shape[0] not in (1, 2):
        raise ValueError(f"a cache is [planes (1 or 2), num_blocks, block_size, kv_heads, head_dim], "
                         f"got {tuple(first.shape)}")
    for cache in caches:
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise ValueError("all caches must share one shape, dtype and device")
        if not cache.is_contiguous() or cache.data_ptr() % 16:
            raise ValueError("caches must be contiguous and 16-byte aligned")
    if first.dtype not in _DTYPES:
        raise ValueError(f"unsupported cache dtype {first.dtype}; supported: {_DTYPES}")
    expected = (len(caches), first.shape[0], slots.shape[0], first.shape[3], first.shape[4])
    if chunk.dim() != 5 or tuple(chunk.shape) != expected:
        raise ValueError(f"chunk shape {tuple(chunk.shape)} does not match {expected}")
    if chunk.dtype != first.dtype or chunk.device != first.device:
        raise ValueError(f"chunk is {chunk.dtype} on {chunk.device}, caches {first.dtype} on {first.device}")
    if not rows_contiguous(chunk):
        raise ValueError("each token's [kv_heads, head_dim] row of the chunk must be contiguous")
    if slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32) or slots.device != first.device:
        raise ValueError(f"slots must be 1-D int64/int32 on {first.device}, got {slots.dtype} {tuple(slots.shape)} "
                         f"on {slots.device}")
    if not slots.is_contiguous():
        raise ValueError("slots must be contiguous")
