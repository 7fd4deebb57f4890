"""Sampled hit verification in the bundled engine: a wrong KV under a right key, with a valid
checksum, is caught, removed from every tier and replaced; right KV is counted as verified."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvlayer.engine import LLM
from kvlayer.transfer import slot_mapping
from tests.connectors.test_kvlayer_connector import GREEDY, C, make

N = 4 * C  # prompt length: 4 chunks


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(N)]


def tokens(llm: LLM, ids: list[int]):
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    return out.outputs[0].token_ids, out.num_external_tokens


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = make(tiny_model_dir)
    yield {seed: tokens(llm, prompt(seed))[0] for seed in (1, 2)}
    llm.close()


def plant_wrong_kv(llm: LLM, right: list[int], other: list[int]) -> int:
    """Store ``other``'s KV under ``right``'s keys (valid checksums) through the engine's own
    ``KVCacheEngine``: ``other`` runs once (its chunks are saved), its KV is read back into a
    scratch paged cache and stored for ``right``'s tokens. Returns the chunks stored."""
    tokens(llm, other)
    kv = llm.engine.connector.kv
    lay = kv.layout
    blocks = -(-N // lay.block_size)
    scratch = [torch.zeros(2, blocks, lay.block_size, lay.num_kv_heads, lay.head_dim, dtype=lay.dtype)
               for _ in range(lay.num_layers)]
    slots = slot_mapping(list(range(blocks)), lay.block_size, 0, N, torch.device("cpu"))
    assert kv.retrieve(other, scratch, slots) == N
    stored = kv.store(right, scratch, slots)
    assert kv.flush()
    return stored


def test_a_wrong_kv_under_a_right_key_is_caught_removed_and_replaced(tiny_model_dir, reference, tmp_path):
    right, other = prompt(1), prompt(2)
    kv_config = {"chunk_size": C, "cpu_capacity": "4MiB", "nvme_path": str(tmp_path), "verify_fraction": 1.0}
    llm = make(tiny_model_dir, kv_config)
    assert plant_wrong_kv(llm, right, other) == N // C
    wrong_files = {f: f.read_bytes() for f in tmp_path.rglob("*.kvc")}

    # Without verification the planted chunks are a hit that gives wrong tokens (from disk).
    control = make(tiny_model_dir, {"chunk_size": C, "cpu_capacity": 0, "nvme_path": str(tmp_path)})
    got, hit = tokens(control, right)
    assert hit > 0 and got != reference[1], "the planted KV must be harmful, or this test proves nothing"
    control.close()

    # With verify_fraction 1.0 the hit is recomputed: right tokens, nothing loaded, a mismatch per chunk.
    got, hit = tokens(llm, right)
    assert (got, hit) == (reference[1], 0)
    kv = llm.engine.connector.kv
    assert kv.flush()
    stats = llm.kv_stats()
    wrong = N // C  # a hit stops before the prompt's last token, inside the last chunk
    assert stats["verify_mismatches"] >= wrong and stats["tiers"]["cpu"]["verify_mismatches"] >= wrong
    assert stats["verified_hits"] == 0
    # The wrong objects are gone from every tier: no file holds the planted bytes any more.
    now = {f: f.read_bytes() for f in tmp_path.rglob("*.kvc")}
    planted = [f for f in wrong_files if f.name in _planted(kv, right)]
    assert len(planted) == N // C and all(now.get(f) not in (None, wrong_files[f]) for f in planted)
    text = _metrics_text(kv)
    assert 'kvlayer_verify_mismatches_total{instance=' in text

    # Later requests hit the recomputed KV that replaced it, from disk, and give the right tokens.
    llm.close()
    later = make(tiny_model_dir, {"chunk_size": C, "cpu_capacity": 0, "nvme_path": str(tmp_path)})
    got, hit = tokens(later, right)
    assert got == reference[1] and hit == N - 1
    later.close()


def test_right_kv_is_counted_as_verified_and_never_loaded(tiny_model_dir, reference):
    llm = make(tiny_model_dir, {"chunk_size": C, "cpu_capacity": "4MiB", "verify_fraction": 1.0})
    ids = prompt(2)
    assert tokens(llm, ids) == (reference[2], 0)
    assert tokens(llm, ids) == (reference[2], 0), "a sampled hit is recomputed, not loaded"
    stats = llm.kv_stats()
    assert stats["verified_hits"] == N // C and stats["verify_mismatches"] == 0
    assert stats["tiers"]["cpu"]["hit_tokens"] == 0
    llm.close()


def test_verify_fraction_zero_loads_every_hit(tiny_model_dir, reference):
    llm = make(tiny_model_dir, {"chunk_size": C, "cpu_capacity": "4MiB"})
    ids = prompt(2)
    tokens(llm, ids)
    assert tokens(llm, ids) == (reference[2], N - 1)
    assert llm.kv_stats()["verified_hits"] == 0
    llm.close()


def _planted(kv, right: list[int]) -> set[str]:
    """File names of ``right``'s chunks (the NVMe tier names a file by its key's digest and start)."""
    return {f"{k.digest.hex()}-{k.start}.kvc" for k in kv.keys(right)}


def _metrics_text(kv) -> str:
    registry = CollectorRegistry()
    kv.metrics.register(registry)
    return generate_latest(registry).decode()
