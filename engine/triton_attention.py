"""Triton paged-attention decode: one query token per sequence over its cached context.

``engine.attention`` calls ``decode_attention`` for the step's decode batch when the tensors
are on CUDA; its torch ``_decode_attention`` stays the reference (and the CPU path). This
module imports triton, so it is imported only where a kernel is launched; under
``TRITON_INTERPRET=1`` (set before the import) it also runs on CPU tensors, for tests.

Design: grid ``(num_seqs, num_kv_heads)``; a program holds the query heads of one KV head's
group (``GROUP`` rows, padded to a power of two) and walks the context ``BLOCK_N`` tokens at
a time, finding each token's cache row through the block table (so any ``block_size`` works),
masking tokens at or past the context length, with an online softmax and float32
accumulation. With a sliding window W the walk starts at the first visible position
``context_len - W`` (transformers' ``p - W < j``), so table entries before it (blocks the
engine may have released) are never read. Scores come from broadcast products rather than
``tl.dot``: decode is bound by reading K/V, groups are small (``tl.dot`` wants 16 rows), and
bf16 ``tl.dot`` is wrong under the interpreter.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_TILE_ELEMENTS = 8192
_NO_WINDOW = 2**31 - 1
"""The window passed for full attention: wider than any context, and an int32 kernel argument."""


@triton.jit
def decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
    scale_log2,
    q_seq_stride, q_head_stride,
    cache_block_stride, cache_slot_stride,
    table_stride,
    out_seq_stride, out_head_stride,
    block_size, window,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(lens_ptr + seq)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, DIM_P)
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq.to(tl.int64) * q_seq_stride + heads[:, None] * q_head_stride + d[None, :],
                mask=q_mask, other=0.0).to(tl.float32)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, DIM_P], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * table_stride
    first = tl.maximum(context_len - window, 0)
    for start in range(first, context_len, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < context_len
        blocks = tl.load(table + t // block_size, mask=t_ok, other=0).to(tl.int64)
        rows = blocks * cache_block_stride + (t % block_size) * cache_slot_stride + kv_head * HEAD_DIM
        kv_mask = t_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale_log2  # [GROUP_P, BLOCK_N], log2 units
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + seq.to(tl.int64) * out_seq_stride + heads[:, None] * out_head_stride + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of ``query`` ``[N, H, D]`` over each sequence's cached context -> ``[N, H, D]``
    in ``query``'s dtype.

    ``kv_cache`` is one layer's contiguous ``[2, num_blocks, block_size, KVH, D]`` (float32,
    float16 or bfloat16; ``H`` a multiple of ``KVH``); ``block_tables`` ``[N, max_blocks]`` and
    ``context_lens`` ``[N]`` (int64 or int32, every length >= 1 and covered by its row of the
    table) live on ``query``'s device. Query row ``i`` attends to cache positions
    ``[0, context_lens[i])``, or with a sliding ``window`` only the last ``window`` of them
    (entries of the table before the first visible position are not read). ValueError for
    mismatched shapes or devices or a window below 1.
    """
    n, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads or not kv_cache.is_contiguous():
        raise ValueError(f"query {tuple(query.shape)} does not fit contiguous cache {tuple(kv_cache.shape)}")
    if block_tables.shape[0] != n or context_lens.shape != (n,):
        raise ValueError(f"{n} queries, block tables {tuple(block_tables.shape)}, lens {tuple(context_lens.shape)}")
    if len({query.device, kv_cache.device, block_tables.device, context_lens.device}) != 1:
        raise ValueError("query, kv_cache, block_tables and context_lens must share one device")
    if window is not None and window < 1:
        raise ValueError(f"window must be positive or None, got {window}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if n == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    group = num_heads // num_kv_heads
    group_p, dim_p = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    block_n = max(16, min(128, _TILE_ELEMENTS // (group_p * dim_p)))
    decode_attention_kernel[(n, num_kv_heads)](
        query, kv_cache[0], kv_cache[1], tables, context_lens.contiguous(), out,
        scale * math.log2(math.e),
        query.stride(0), query.stride(1),
        kv_cache.stride(1), kv_cache.stride(2),
        tables.stride(0),
        out.stride(0), out.stride(1),
        block_size, _NO_WINDOW if window is None else min(window, _NO_WINDOW),
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, DIM_P=dim_p, BLOCK_N=block_n,
    )
    return out
