"""Tests of kvlayer/keys.py: the chain property, partial chunks, namespaces, cross-process keys."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys

import pytest
import torch

from kvlayer.keys import KEY_BYTES, TOKENS_DIGEST_BYTES, Namespace, chunk_keys, tokens_bytes
from kvlayer.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=16)
NS = Namespace("llama-test", "abc123", LAYOUT, chunk_size=8)
TOKENS = [random.Random(0).randrange(32000) for _ in range(8 * 5 + 3)]


def test_keys_of_full_chunks() -> None:
    keys = chunk_keys(NS, TOKENS)
    assert len(keys) == 5
    assert [(k.start, k.end) for k in keys] == [(i * 8, i * 8 + 8) for i in range(5)]
    assert all(len(k.digest) == KEY_BYTES and len(k.tokens_digest) == TOKENS_DIGEST_BYTES for k in keys)
    assert len({k.digest for k in keys}) == 5


def test_partial_chunk_only_when_asked() -> None:
    keys = chunk_keys(NS, TOKENS, include_partial=True)
    assert len(keys) == 6 and (keys[-1].start, keys[-1].end, keys[-1].num_tokens) == (40, 43, 3)
    assert keys[:5] == chunk_keys(NS, TOKENS)
    assert chunk_keys(NS, TOKENS[:7]) == []


def test_chain_property() -> None:
    keys = chunk_keys(NS, TOKENS)
    assert chunk_keys(NS, TOKENS[:24]) == keys[:3]  # a prefix has the prefix's keys
    changed = list(TOKENS)
    changed[9] += 1  # a token of chunk 1
    other = chunk_keys(NS, changed)
    assert other[0] == keys[0]
    assert all(a.digest != b.digest for a, b in zip(other[1:], keys[1:]))  # every later key changes
    assert other[2].tokens_digest == keys[2].tokens_digest  # same tokens, different history


def test_same_chunk_tokens_in_another_position_get_another_key() -> None:
    a = chunk_keys(NS, TOKENS[:8] * 2)
    assert a[0].tokens_digest == a[1].tokens_digest and a[0].digest != a[1].digest


@pytest.mark.parametrize("change", [
    {"salt": "tenant-b"}, {"model_name": "other"}, {"model_fingerprint": "def456"},
    {"layout": dataclasses.replace(LAYOUT, dtype=torch.bfloat16)},
    {"layout": dataclasses.replace(LAYOUT, num_layers=5)},
    {"layout": dataclasses.replace(LAYOUT, num_kv_heads=4)},
    {"layout": dataclasses.replace(LAYOUT, head_dim=16)},
    {"layout": dataclasses.replace(LAYOUT, cache_layout="blocks:vllm-cpu-vec")},
    {"tp_rank": 1, "tp_size": 2}, {"tp_size": 2}, {"format_version": 2},
])
def test_every_namespace_field_changes_every_key(change) -> None:
    base = chunk_keys(NS, TOKENS)
    other = chunk_keys(dataclasses.replace(NS, **change), TOKENS)
    assert all(a.digest != b.digest for a, b in zip(base, other))


def test_with_salt() -> None:
    assert NS.with_salt(None) is NS and NS.with_salt("") is NS
    salted = NS.with_salt("t1")
    assert salted.salt == "t1" and chunk_keys(salted, TOKENS)[0] != chunk_keys(NS, TOKENS)[0]


def test_prefix_reuse_gives_the_same_keys() -> None:
    full = chunk_keys(NS, TOKENS)
    assert chunk_keys(NS, TOKENS, prefix=full[:2]) == full
    assert chunk_keys(NS, TOKENS[:16], prefix=full) == full[:2]  # a longer prefix is cut


def test_prefix_reuse_ignores_a_partial_last_key() -> None:
    earlier = chunk_keys(NS, TOKENS[:20], include_partial=True)  # chunk 2 is partial (16..20)
    assert chunk_keys(NS, TOKENS, prefix=earlier) == chunk_keys(NS, TOKENS)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        tokens_bytes([-1])
    with pytest.raises(ValueError):
        tokens_bytes([2**31])
    assert tokens_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    with pytest.raises(ValueError, match="chunk_size"):
        Namespace("m", "f", LAYOUT, chunk_size=0)
    with pytest.raises(ValueError, match="tp_rank"):
        Namespace("m", "f", LAYOUT, chunk_size=8, tp_rank=2, tp_size=2)


_CHILD = """
import sys, torch
from kvlayer.keys import Namespace, chunk_keys
from kvlayer.layout import KVLayout
ns = Namespace("llama-test", "abc123", KVLayout(4, 2, 8, torch.float16, 16), chunk_size=8, salt="s")
print(",".join(k.hex for k in chunk_keys(ns, list(range(100, 140)), include_partial=True)))
"""


def test_keys_are_identical_across_processes() -> None:
    children = [subprocess.Popen([sys.executable, "-c", _CHILD], env={"PYTHONHASHSEED": seed},
                                 stdout=subprocess.PIPE, text=True) for seed in ("1", "2")]
    outs = [child.communicate(timeout=120)[0].strip() for child in children]
    assert [child.returncode for child in children] == [0, 0]
    ns = dataclasses.replace(NS, salt="s")
    mine = ",".join(k.hex for k in chunk_keys(ns, list(range(100, 140)), include_partial=True))
    assert outs[0] == outs[1] == mine
