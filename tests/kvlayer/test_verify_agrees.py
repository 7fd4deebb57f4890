"""The comparison behind sampled hit verification (``kvlayer.verify.agrees``): a recompute in
another batch agrees with its stored chunk, the KV of other tokens never does, and a quantized
tier's copy agrees within its encoding's error. Run:
``.venv/bin/python -m pytest tests/kvlayer/test_verify_agrees.py``."""

from __future__ import annotations

import pytest
import torch

from kvlayer.quantize import QUANTIZERS
from kvlayer.verify import RTOL, agrees

SHAPE = (2, 2, 16, 2, 8)
"""[layers, K/V, tokens, kv_heads, head_dim]: a small chunk."""


def chunk(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_same_kv_agrees_and_last_bit_noise_too(dtype: torch.dtype) -> None:
    x = chunk(0, dtype)
    assert agrees(x, x.clone())
    ulps = x.float() * (1 + 2 * torch.finfo(dtype).eps)  # a recompute that rounds differently
    assert agrees(x, ulps.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kv_of_other_tokens_never_agrees(dtype: torch.dtype) -> None:
    x = chunk(0, dtype)
    for seed in range(1, 20):
        assert not agrees(x, chunk(seed, dtype))
    one_value = x.clone()
    one_value[1, 0, 5, 1, 3] += 50 * RTOL[dtype] * float(x.float().abs().amax())
    assert not agrees(x, one_value), "one wrong value is a mismatch"


def test_a_non_finite_stored_value_is_a_mismatch() -> None:
    x = chunk(0)
    for bad in (float("nan"), float("inf"), float("-inf")):
        stored = x.clone()
        stored[0, 1, 2, 0, 0] = bad
        assert not agrees(x, stored)


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_a_quantized_copy_agrees_within_its_encoding(name: str) -> None:
    q = QUANTIZERS[name]
    x = chunk(3)
    decoded = torch.empty_like(x)
    q.decode(q.encode(x), decoded)
    assert not torch.equal(decoded, x), "the encoding is lossy"
    assert not agrees(x, decoded), "without the encoding's bound the copy is out of tolerance"
    assert agrees(x, decoded, name)
    other = torch.empty_like(x)
    q.decode(q.encode(chunk(4)), other)
    assert not agrees(x, other, name), "the encoding's bound does not admit other tokens' KV"


def test_an_empty_or_zero_chunk_agrees_only_with_zeros() -> None:
    zeros = torch.zeros(SHAPE)
    assert agrees(zeros, zeros.clone())
    assert not agrees(zeros, chunk(0))
