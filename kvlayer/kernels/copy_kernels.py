"""The Triton kernel that moves token rows between a paged KV cache and a chunk buffer.

A *row* is one token's keys (or values, or MLA latent) of one layer: ``kv_heads * head_dim``
contiguous elements, both in a cache ``[PLANES, num_blocks, block_size, kv_heads, head_dim]``
(row of slot ``s`` at ``kv * kv_stride + s * row_len``; ``PLANES`` 2 for keys and values, 1 for a
latent layout) and in a chunk ``[num_layers, PLANES, tokens, kv_heads, head_dim]`` (row of token
``t`` at ``layer * layer_stride + kv * kv_stride + t * token_stride``).
One kernel serves gather (``TO_CACHE=False``) and scatter (``TO_CACHE=True``), for one layer
(``cache_ptr`` is that layer's cache) or all layers (``cache_ptr`` is an int64 table of the
layers' base addresses, ``LAYER_TABLE=True``). Launched by ``copy_ops``; see there for the grid.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_rows_kernel(
    cache_ptr,
    chunk_ptr,
    slots_ptr,
    num_tokens,
    row_len,
    cache_kv_stride,
    chunk_layer_stride,
    chunk_kv_stride,
    chunk_token_stride,
    LAYER_TABLE: tl.constexpr,
    TO_CACHE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PLANES: tl.constexpr = 2,
):
    """Program ``(i, PLANES * layer + kv)`` copies tokens ``[i * BLOCK_T, (i + 1) * BLOCK_T)`` of one
    layer's keys or values, ``BLOCK_R`` row elements at a time."""
    tile = tl.program_id(0)
    layer = tl.program_id(1) // PLANES
    kv = tl.program_id(1) % PLANES
    if LAYER_TABLE:
        address = tl.load(cache_ptr + layer)
        # the wrapper checks every layer's base is 16-byte aligned; the hint lets the compiler
        # vectorise accesses through a pointer it cannot see the origin of
        base = tl.multiple_of(address.to(tl.pointer_type(chunk_ptr.dtype.element_ty)), 16)
    else:
        base = cache_ptr
    tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    slots = tl.load(slots_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    cache_rows = base + kv * cache_kv_stride + slots * row_len
    chunk_rows = (chunk_ptr + layer.to(tl.int64) * chunk_layer_stride + kv * chunk_kv_stride
                  + tokens.to(tl.int64) * chunk_token_stride)
    for start in range(0, row_len, BLOCK_R):
        cols = start + tl.arange(0, BLOCK_R)
        mask = token_ok[:, None] & (cols < row_len)[None, :]
        if TO_CACHE:
            rows = tl.load(chunk_rows[:, None] + cols[None, :], mask=mask)
            tl.store(cache_rows[:, None] + cols[None, :], rows, mask=mask)
        else:
            rows = tl.load(cache_rows[:, None] + cols[None, :], mask=mask)
            tl.store(chunk_rows[:, None] + cols[None, :], rows, mask=mask)
