"""The prefill attention paths (folded query groups, split prefix + causal calls, one biased call)
against plain attention math."""

from __future__ import annotations

import math

import pytest
import torch

from kvlayer.engine import attention
from kvlayer.engine.attention_metadata import AttentionMetadata, PrefillSpan


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    """Causal GQA attention of ``q`` [n, H, D] at positions num_cached.. over ``k``/``v`` [ctx, KVH, D]."""
    n, heads, dim = q.shape
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), k.double()) / math.sqrt(dim)
    allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(n)[:, None] + num_cached
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("heads,kv_heads,n,cached", [(12, 4, 5, 70), (12, 4, 100, 37), (8, 8, 6, 40),
                                                     (6, 2, 300, 20), (4, 1, 1, 63), (4, 2, 700, 900)])
@pytest.mark.parametrize("split", [True, False], ids=["split-on-cpu", "one-biased-call"])
def test_prefill_over_a_cached_prefix_matches_plain_attention(heads, kv_heads, n, cached, split, monkeypatch) -> None:
    if not split:
        monkeypatch.setattr(attention, "SPLIT_DEVICES", ())
    torch.manual_seed(heads * 1000 + n)
    dim, block_size, num_blocks = 16, 16, 128
    ctx = cached + n
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    table = torch.randperm(num_blocks)[: -(-ctx // block_size)]  # non-contiguous blocks
    flat = cache.view(2, -1, kv_heads, dim)
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
    q = torch.randn(n, heads, dim)
    meta = AttentionMetadata(slots[cached:], 0, torch.zeros((0, 1), dtype=torch.long),
                             torch.zeros((0,), dtype=torch.long), (PrefillSpan(0, n, ctx, table),), block_size)
    folds = kv_heads < heads and n * (heads // kv_heads) <= attention.FOLD_MAX_ROWS
    out = attention.paged_attention(q, flat[0, slots[cached:]], flat[1, slots[cached:]], cache, meta,
                                    1 / math.sqrt(dim))
    want = reference(q, flat[0, slots], flat[1, slots], cached)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    # a biased call's bias is built once per step and reused by the next layer's call, unchanged
    biases = list(meta.biases.values())
    assert len(biases) == (0 if split and not folds else 1)
    again = attention.paged_attention(q, flat[0, slots[cached:]], flat[1, slots[cached:]], cache, meta,
                                      1 / math.sqrt(dim))
    assert all(a is b for a, b in zip(meta.biases.values(), biases, strict=True))
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    assert folds == ((heads, n) in {(12, 5), (12, 100), (4, 1)})  # every path is covered above
