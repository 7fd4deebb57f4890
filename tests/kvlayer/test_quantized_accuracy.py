"""Accuracy of hits from quantized NVMe chunks through the bundled engine (a tiny random Llama):
greedy tokens and logits against the same model without kvlayer (``benchmarks/tier_quality.py``
measures them), and exact hits still exact when quantization is off.

Measured here (6 prompts of 68 tokens, 4 chunks of 16 loaded, 12 greedy tokens): int8 100% of the
tokens before the first difference, 6 of 6 prompts identical, largest logit difference 0.11; fp8
89%, 3 of 6, 0.36; exact storage 100%, 6 of 6, 0.0; 137 bytes stored per token quantized, 519
exact. With 8 prompts and 16 tokens: int8 98%, 7 of 8; fp8 70%, 3 of 8. A random model's logits
are nearly flat, so a small perturbation flips its argmax far more often than a trained model's.
Run: ``.venv/bin/python -m pytest tests/kvlayer/test_quantized_accuracy.py``.
"""

from __future__ import annotations

import pytest
import torch

from kvlayer.benchmarks.tier_quality import Agreement, Generation, compare, measure_quality

PROMPTS = 6
CHUNK = 16


@pytest.fixture(scope="module")
def quality(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("quality")
    out = measure_quality(tiny_model_dir, ["none", "int8", "fp8"], str(folder), CHUNK, PROMPTS, 12, chunks=4)
    assert out["prompt_tokens"] == 4 * CHUNK + 4
    return {r["quantization"]: r for r in out["rows"]}


def test_exact_storage_hits_give_the_reference_tokens(quality: dict[str, dict]) -> None:
    exact = quality["none"]
    assert exact["hit_tokens"] == PROMPTS * 4 * CHUNK, "every prompt's 4 chunks came from NVMe"
    assert exact["identical"] == PROMPTS and exact["agreement"] == 1.0
    assert exact["max_logit_diff"] <= 1e-5


def test_int8_hits_agree_with_recompute_on_most_tokens(quality: dict[str, dict]) -> None:
    int8 = quality["int8"]
    assert int8["hit_tokens"] == PROMPTS * 4 * CHUNK
    assert int8["agreement"] >= 0.85 and int8["identical"] >= PROMPTS // 2
    assert 1e-4 < int8["max_logit_diff"] < 0.3, "lossy, but only just"
    assert int8["stored_bytes_per_token"] < 0.3 * quality["none"]["stored_bytes_per_token"]


def test_fp8_hits_are_lossier_than_int8_but_close(quality: dict[str, dict]) -> None:
    fp8 = quality["fp8"]
    assert fp8["hit_tokens"] == PROMPTS * 4 * CHUNK
    assert fp8["agreement"] >= 0.6
    assert quality["int8"]["max_logit_diff"] < fp8["max_logit_diff"] < 1.0
    assert fp8["stored_bytes_per_token"] == quality["int8"]["stored_bytes_per_token"]


def test_compare_counts_the_agreeing_prefix_and_its_logits() -> None:
    logits = torch.zeros(4, 3)
    ref = Generation((1, 2, 3, 4), logits, 0.0, 0)
    off = logits.clone()
    off[1, 0], off[3, 0] = 0.5, 9.0  # step 3 follows a differing token: its logits do not count
    got = Generation((1, 2, 7, 4), off, 0.0, 0)
    assert compare([ref, ref], [ref, got]) == Agreement(agreement=6 / 8, identical=1, prompts=2, max_logit_diff=0.5)

