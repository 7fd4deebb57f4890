"""Paged attention in torch (Triton decodes on CUDA): writing new keys/values into the paged cache and attending.

Runs on any device. The step's flat batch is laid out as ``AttentionMetadata`` describes: the
first ``num_decodes`` tokens are single-token decodes, batched into one gather and one attention
call (on CUDA with triton installed, one kernel of ``triton_attention`` instead); each prefill
span then runs one ``scaled_dot_product_attention`` call (over its own new keys when nothing of
it is cached, else over its context gathered from the cache).

Masks are additive float biases built once per step and shared by the layers
(``AttentionMetadata.biases``): the CPU kernel turns a boolean mask into one on every call,
which cost 40% of a 32-token span's attention over 8k cached tokens.

A sliding-window layer (``window`` W) lets a query at position ``p`` see keys at positions
``j`` with ``p - W < j <= p``, as transformers' ``sliding_window_overlay`` does. It gathers only
the blocks its window reaches, so it never touches a sequence's leading blocks that fell out of
every window (the block manager may have released them, ``block_manager.FREED_BLOCK``).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from kvlayer.engine.attention_metadata import AttentionMetadata

FOLD_MAX_ROWS = 512
"""Query tokens x query heads per KV head up to which a span over cached tokens folds its query
groups (``_folded_attention``); longer spans repeat the keys instead (it stops paying off)."""

SPLIT_DEVICES = ("cpu",)
"""Devices where a longer span over a cached prefix runs as two attention calls merged by their
log-sum-exps (``_split_attention``); elsewhere one call with the span's causal bias."""


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` ``[T, KVH, D]`` at slots ``slot_mapping`` ``[T]`` (int64) of one
    layer's contiguous cache ``[2, num_blocks, block_size, KVH, D]`` of the same dtype, in place."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, H, D]`` for the step ``meta`` describes -> ``[T, H, D]``.

    ``key``/``value`` ``[T, KVH, D]`` are the step's new keys/values, already written into
    ``kv_cache`` (same dtype and device) by ``write_kv``; ``H`` must be a multiple of ``KVH``
    (grouped-query attention). ``window``: the layer's sliding window (None: full attention).
    Tokens outside every decode and span are left uninitialised in the result.
    """
    out = torch.empty_like(query)
    if meta.num_decodes:
        decode = _triton_decode if query.is_cuda and _triton_installed() else _decode_attention
        out[: meta.num_decodes] = decode(query[: meta.num_decodes], kv_cache, meta, scale, window)
    for i, span in enumerate(meta.prefills):
        out[span.start : span.end] = _prefill_attention(query, key, value, kv_cache, meta, i, scale, window)
    return out


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_decode(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None
) -> torch.Tensor:
    """``_decode_attention`` by the Triton kernel (CUDA); imported here, where it is needed."""
    from kvlayer.engine.triton_attention import decode_attention

    return decode_attention(query, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale, window)


def _decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None
) -> torch.Tensor:
    """One query token per sequence ``[N, H, D]`` over its cached context -> ``[N, H, D]``."""
    n, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    columns = _decode_columns(meta, kv_cache.shape[2], window)
    tables = meta.decode_block_tables
    blocks = (tables if columns is None else tables.gather(1, columns.clamp(max=tables.shape[1] - 1))).flatten()
    # index_select of whole blocks: [N * blocks per row, block_size, KVH, D] -> [N, KVH, L, D]
    keys = kv_cache[0].index_select(0, blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = kv_cache[1].index_select(0, blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
    bias = meta.biases.get(("decode", window))
    if bias is None:
        bias = _decode_bias(meta, columns, keys.shape[2], kv_cache.shape[2], window, query.dtype)
        meta.biases[("decode", window)] = bias
    # each KV head's query group acts as a short query sequence: no repeated keys, one fused call
    grouped = query.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    result = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias, scale=scale)
    return result.reshape(n, num_heads, head_dim)


def _decode_columns(meta: AttentionMetadata, block_size: int, window: int | None) -> torch.Tensor | None:
    """For a window layer, the block-table columns ``[N, k]`` each decode's window reaches: from
    the block of its first visible position on, ``k`` the most blocks a window can touch
    (columns past a row's table hold no visible position); None for full attention."""
    if window is None:
        return None
    k = min(meta.decode_block_tables.shape[1], -(-(window - 1) // block_size) + 1)
    first = (meta.decode_context_lens - window).clamp(min=0) // block_size
    return first[:, None] + torch.arange(k, device=first.device)


def _decode_bias(meta: AttentionMetadata, columns: torch.Tensor | None, length: int, block_size: int,
                 window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The decodes' bias ``[N, 1, 1, length]``: -inf at gathered positions past a sequence's
    context or, for a window layer, at or before ``context_len - 1 - window``."""
    lens = meta.decode_context_lens[:, None]
    if columns is None:
        return _bias(torch.arange(length, device=lens.device) >= lens, dtype)[:, None, None, :]
    slots = torch.arange(block_size, device=lens.device)
    positions = (columns[:, :, None] * block_size + slots).flatten(1)
    return _bias((positions >= lens) | (positions < lens - window), dtype)[:, None, None, :]


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    index: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Span ``meta.prefills[index]``'s query tokens over its context -> ``[span.num_tokens, H, D]``."""
    span = meta.prefills[index]
    q = query[span.start : span.end]
    groups = q.shape[1] // key.shape[1]
    if window is not None and span.context_len > window:  # else the window hides nothing
        return _windowed_prefill(q, key[span.start : span.end], value[span.start : span.end], kv_cache, meta,
                                 index, scale, window)
    if span.num_cached == 0:
        k, v, mask = key[span.start : span.end], value[span.start : span.end], None
    else:
        fold = groups if groups > 1 and span.num_tokens * groups <= FOLD_MAX_ROWS else 1
        if fold == 1 and q.device.type in SPLIT_DEVICES:  # only the cached prefix is gathered
            k, v = _gathered(kv_cache, span.block_table, span.num_cached)
            return _split_attention(q, k, v, key[span.start : span.end], value[span.start : span.end], groups, scale)
        k, v = _gathered(kv_cache, span.block_table, span.context_len)
        mask = _span_bias(meta, index, fold, q.dtype, None, 0)
        if fold > 1:
            return _folded_attention(q, k, v, mask, groups, scale)
    # 4-D [1, heads, tokens, D] operands with equal head counts reach the fused CPU kernel; 3-D
    # ones or enable_gqa fall back to slower paths (2-10x at 2k tokens)
    result = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        _heads_first(k, groups),
        _heads_first(v, groups),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return result[0].transpose(0, 1)


def _windowed_prefill(q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, index: int, scale: float, window: int) -> torch.Tensor:
    """A span of a window layer whose window hides part of its context: one biased call over the
    keys from the block of its first query's first visible position on (only its own new keys
    when nothing of it is cached)."""
    span = meta.prefills[index]
    groups = q.shape[1] // new_k.shape[1]
    block_size = kv_cache.shape[2]
    first_block = max(0, span.num_cached - window + 1) // block_size
    if span.num_cached == 0:
        k, v = new_k, new_v
    else:
        k, v = _gathered(kv_cache, span.block_table[first_block:], span.context_len - first_block * block_size)
    fold = groups if groups > 1 and span.num_tokens * groups <= FOLD_MAX_ROWS else 1
    mask = _span_bias(meta, index, fold, q.dtype, window, first_block * block_size)
    if fold > 1:
        return _folded_attention(q, k, v, mask, groups, scale)
    result = F.scaled_dot_product_attention(q.transpose(0, 1)[None], _heads_first(k, groups),
                                            _heads_first(v, groups), attn_mask=mask, scale=scale)
    return result[0].transpose(0, 1)


def _gathered(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[length, KVH, D]`` of a sequence's first ``length`` cached positions."""
    blocks = block_table[: -(-length // kv_cache.shape[2])]
    return (kv_cache[0].index_select(0, blocks).flatten(0, 1)[:length],
            kv_cache[1].index_select(0, blocks).flatten(0, 1)[:length])


def _split_attention(q: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor, new_k: torch.Tensor,
                     new_v: torch.Tensor, groups: int, scale: float) -> torch.Tensor:
    """A span ``q`` ``[n, H, D]`` over its cached prefix ``cached_k``/``cached_v`` ``[c, KVH, D]``
    and its own new keys ``new_k``/``new_v`` ``[n, KVH, D]``, on the CPU: two fused attention
    calls, all of the prefix (no mask) and the new keys causally (the kernel skips the masked
    half), merged by their log-sum-exps. One call with a mask over the whole context would
    compute every masked score too: 1.6x slower for 4096 tokens over 4096 cached."""
    heads_first = q.transpose(0, 1)[None]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    old, old_lse = flash(heads_first, _heads_first(cached_k, groups), _heads_first(cached_v, groups), 0.0, False,
                         scale=scale)
    new, new_lse = flash(heads_first, _heads_first(new_k, groups), _heads_first(new_v, groups), 0.0, True,
                         scale=scale)
    top = torch.maximum(old_lse, new_lse)
    old_w, new_w = (old_lse - top).exp_(), (new_lse - top).exp_()
    total = old_w + new_w
    merged = old.float() * (old_w / total)[..., None] + new.float() * (new_w / total)[..., None]
    return merged.to(q.dtype)[0].transpose(0, 1)


def _span_bias(meta: AttentionMetadata, index: int, fold: int, dtype: torch.dtype, window: int | None,
               base: int) -> torch.Tensor:
    """The bias ``[fold * n, context_len - base]`` of span ``index`` over context positions
    ``[base, context_len)``: query i, at position p = num_cached + i, sees positions j <= p (and
    p - window < j for a window layer); repeated ``fold`` times for ``_folded_attention``. Built
    on the first layer's call, then shared."""
    key = ("prefill", index, fold, window)
    bias = meta.biases.get(key)
    if bias is None:
        span = meta.prefills[index]
        device = span.block_table.device
        queries = torch.arange(span.num_cached, span.context_len, device=device)[:, None]
        keys = torch.arange(base, span.context_len, device=device)[None, :]
        hidden = keys > queries
        if window is not None:
            hidden |= keys <= queries - window
        bias = _bias(hidden, dtype).repeat(fold, 1)
        meta.biases[key] = bias
    return bias


def _bias(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask of ``dtype``: -inf where ``hidden`` is true, 0 elsewhere."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))


def _folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, groups: int,
                      scale: float) -> torch.Tensor:
    """A few query tokens over a long context with GQA: each KV head's query group is folded
    into its query rows (row g * n + i is token i of the group's head g), so the keys and values
    are used as they are instead of repeated per query head (3x faster for 32 tokens over 8k).
    ``bias`` is the span's causal bias already repeated for the ``groups`` folds."""
    n, heads, dim = q.shape
    kv_heads = heads // groups
    rows = q.view(n, kv_heads, groups, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, groups * n, dim)
    out = F.scaled_dot_product_attention(rows, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=bias, scale=scale)
    return out.view(kv_heads, groups, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)


def _heads_first(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[tokens, KVH, D]`` -> ``[1, KVH * groups, tokens, D]``, each KV head repeated for its query group."""
    x = x.transpose(0, 1)[None]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)
