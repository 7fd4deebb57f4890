"""Tests of engine/triton_attention.py: the Triton decode kernel (run by Triton's interpreter, see
conftest.py) matches the engine's torch paged attention, computed in float32, with and without a
sliding window."""

from __future__ import annotations

import pytest
import torch

from kvlayer.engine.attention import paged_attention
from kvlayer.engine.attention_metadata import AttentionMetadata
from kvlayer.engine.triton_attention import decode_attention

TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
"""Max abs error against float32: the output's rounding to the input dtype dominates."""


def _reference(query, cache, tables, lens, block_size, scale, window=None) -> torch.Tensor:
    n = query.shape[0]
    meta = AttentionMetadata(torch.zeros(n, dtype=torch.long), n, tables, lens, (), block_size)
    return paged_attention(query.float(), query, query, cache.float(), meta, scale, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(4, 4, 64, 16), (8, 2, 128, 16), (4, 1, 80, 8)],  # GQA 1, 4, 4 with a head_dim not a power of two
)
def test_decode_matches_torch(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(heads * dim + block_size)
    lens = torch.tensor([1, block_size, block_size + 1, 77, 130])
    width = -(-int(lens.max()) // block_size) + 1  # rows padded past each context with valid block ids
    num_blocks = 2 * width
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(len(lens))])
    cache = torch.randn((2, num_blocks, block_size, kv_heads, dim), generator=gen).to(dtype)
    query = torch.randn((len(lens), heads, dim), generator=gen).to(dtype)
    scale = dim**-0.5
    got = decode_attention(query, cache, tables, lens, scale)
    want = _reference(query, cache, tables, lens, block_size, scale)
    assert got.dtype == dtype and got.shape == query.shape
    assert (got.float() - want).abs().max().item() <= TOLERANCE[dtype]


def test_decode_ignores_cache_past_the_context() -> None:
    """Poisoning every slot at or past a sequence's length changes nothing."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn((2, 6, 4, 2, 32), generator=gen)
    tables = torch.tensor([[5, 0, 3], [1, 2, 4]])
    lens = torch.tensor([6, 9])
    query = torch.randn((2, 4, 32), generator=gen)
    before = decode_attention(query, cache, tables, lens, 0.2)
    cache[:, 0, 2:] = float("nan")
    cache[:, 3] = float("inf")
    cache[:, 4, 1:] = float("nan")
    assert torch.equal(decode_attention(query, cache, tables, lens, 0.2), before)


@pytest.mark.parametrize("window", [1, 7, 16, 40, 500])
def test_decode_with_a_sliding_window_matches_torch(window: int) -> None:
    """Each query sees only the last ``window`` positions (transformers' ``p - W < j <= p``); the
    table entries wholly before them may be released blocks (negative ids) and are not read."""
    gen = torch.Generator().manual_seed(window)
    block_size, lens = 8, torch.tensor([1, 7, 8, 9, 41, 77])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(2 * width, generator=gen)[:width] for _ in range(len(lens))])
    cache = torch.randn((2, 2 * width, block_size, 2, 32), generator=gen)
    query = torch.randn((len(lens), 4, 32), generator=gen)
    want = _reference(query, cache, tables, lens, block_size, 0.2, window)
    assert (decode_attention(query, cache, tables, lens, 0.2, window) - want).abs().max().item() <= 1e-5
    released = (lens - window).clamp(min=0) // block_size
    tables[torch.arange(width)[None, :] < released[:, None]] = -1
    assert (decode_attention(query, cache, tables, lens, 0.2, window) - want).abs().max().item() <= 1e-5
    if window >= int(lens.max()):  # a window wider than every context is full attention
        assert torch.equal(decode_attention(query, cache, tables, lens, 0.2, window),
                           decode_attention(query, cache, tables, lens, 0.2))
    with pytest.raises(ValueError, match="window"):
        decode_attention(query, cache, tables, lens, 0.2, 0)


def test_decode_refuses_mismatched_shapes() -> None:
    cache = torch.zeros((2, 4, 4, 2, 32))
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(torch.zeros((1, 3, 32)), cache, torch.zeros((1, 1), dtype=torch.long),
                         torch.ones(1, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="block tables"):
        decode_attention(torch.zeros((2, 4, 32)), cache, torch.zeros((1, 1), dtype=torch.long),
                         torch.ones(2, dtype=torch.long), 1.0)
