"""The KV block pool: capacity from a memory budget, prefix-cache hashing, LRU reuse, reference counts.

Run: ``.venv/bin/python -m pytest tests/engine/test_block_manager.py``. Pool-level tests drive a
``BlockManager`` directly; engine-level ones use the tiny random model on the CPU in float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvlayer.engine import LLM, SamplingParams
from kvlayer.engine import block_manager as bm_module
from kvlayer.engine.block_manager import FREED_BLOCK, BlockManager, block_hash, root_hash
from kvlayer.engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def bytes_per_block(model_dir, block_size: int) -> int:
    """K and V of ``block_size`` float32 tokens in every layer, from config.json alone."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


def committed(bm: BlockManager, request_id: str, tokens: list[int]) -> Sequence:
    """A sequence holding blocks for ``tokens``, all computed and committed to the prefix cache."""
    seq = Sequence(request_id, tokens, SamplingParams())
    assert bm.grow(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.commit(seq)
    return seq


def lookup(bm: BlockManager, tokens: list[int]) -> list[int]:
    """The cached blocks a new request ``tokens + [99]`` would hit (the extra token is left to compute)."""
    return bm.match_prefix(Sequence("probe", [*tokens, 99], SamplingParams()))


A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]


# ----- capacity from kv_cache_memory ------------------------------------------------------
@pytest.mark.parametrize("budget, budget_bytes, block_size", [("1MiB", 1024**2, 16), (100_000, 100_000, 8)])
def test_kv_cache_memory_gives_whole_blocks_in_budget(tiny_model_dir, budget, budget_bytes, block_size):
    expected = budget_bytes // bytes_per_block(tiny_model_dir, block_size)
    llm = LLM(tiny_model_dir, kv_cache_memory=budget, block_size=block_size)
    assert llm.engine.num_blocks == expected
    cfg = llm.engine.model_config
    assert [tuple(c.shape) for c in llm.engine.runner.kv_caches] == \
        [(2, expected, block_size, cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers


def test_kv_cache_memory_below_one_block_is_an_error(tiny_model_dir):
    per_block = bytes_per_block(tiny_model_dir, 16)
    assert LLM(tiny_model_dir, kv_cache_memory=per_block).engine.num_blocks == 1
    for budget in (0, per_block - 1):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            LLM(tiny_model_dir, kv_cache_memory=budget)


# ----- LRU reuse of free cached blocks ------------------------------------------------------
def test_least_recently_freed_cached_block_is_evicted_first():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = committed(bm, "a", A), committed(bm, "b", B)
    bm.free_seq(a)
    bm.free_seq(b)
    new = committed(bm, "new", C)
    assert new.block_table == [2, 0]  # the never-used block, then a's (freed before b's)
    assert lookup(bm, A) == []
    assert lookup(bm, B) == [1]


def test_a_hit_makes_a_freed_block_recently_used():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = committed(bm, "a", A), committed(bm, "b", B)
    bm.free_seq(a)
    bm.free_seq(b)
    again = Sequence("a-again", [*A, 99], SamplingParams())
    bm.take_hits(again, bm.match_prefix(again))
    bm.free_seq(again)
    new = committed(bm, "new", C)
    assert new.block_table == [2, 1]
    assert lookup(bm, A) == [0]
    assert lookup(bm, B) == []


def test_a_prefix_head_outlives_its_tail():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = committed(bm, "s", A + B)
    bm.free_seq(seq)
    assert committed(bm, "new", [20, 21, 22, 23]).block_table == [1]
    assert lookup(bm, A + B) == [0]


# ----- releasing blocks out of a sliding window's reach -------------------------------------
def test_released_blocks_keep_the_table_length_and_their_hashes():
    bm = BlockManager(num_blocks=5, block_size=4)
    seq = committed(bm, "s", A + B + C)  # blocks 0-3
    bm.release_before(seq, 9)  # positions 0-7 are out of reach: blocks 0 and 1
    assert seq.block_table == [FREED_BLOCK, FREED_BLOCK, 2, 3] and seq.num_freed_blocks == 2
    assert (bm.num_free_blocks, bm.num_used_blocks) == (3, 2)
    bm.release_before(seq, 5)  # never taken back
    assert seq.num_freed_blocks == 2
    assert lookup(bm, A + B) == [0, 1]  # a released block is a cached block like a freed one
    seq.token_ids += [17, 18, 19, 20]
    assert bm.grow(seq, 20)
    seq.num_computed_tokens = 20
    bm.commit(seq)  # the chain goes on past the released blocks (the new block is the unused 4)
    assert lookup(bm, A + B + C + [17, 18, 19, 20]) == [0, 1, 2, 3, 4]
    bm.free_seq(seq)
    assert (bm.num_free_blocks, seq.block_table, seq.num_freed_blocks) == (5, [], 0)


def test_a_released_block_shared_with_another_sequence_stays_held():
    bm = BlockManager(num_blocks=4, block_size=4)
    first = committed(bm, "a", A + B)
    second = Sequence("b", [*A, *B, 99], SamplingParams())
    bm.take_hits(second, bm.match_prefix(second))
    bm.release_before(first, 8)
    assert first.block_table == [FREED_BLOCK, FREED_BLOCK]
    assert (bm.num_used_blocks, second.block_table) == (2, [0, 1])
    bm.free_seq(first)
    assert bm.num_used_blocks == 2


# ----- hashing --------------------------------------------------------------------------------
def test_hash_collision_is_a_miss_in_the_pool(monkeypatch):
    monkeypatch.setattr(bm_module, "block_hash", lambda prev, token_ids: b"\0" * 16)
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.free_seq(committed(bm, "a", A))
    assert lookup(bm, B) == []
    assert lookup(bm, A) == [0]


def test_hash_collision_is_a_miss_in_the_engine(tiny_model_dir, monkeypatch):
    def first_token_only(prev: bytes, token_ids: list[int]) -> bytes:
        return block_hash(prev, token_ids[:1])

    monkeypatch.setattr(bm_module, "block_hash", first_token_only)
    original = list(range(100, 140))
    changed = original.copy()
    changed[5] = 7  # every block still hashes like the original's
    llm = LLM(tiny_model_dir, num_gpu_blocks=32)
    llm.generate([{"prompt_token_ids": original}], GREEDY)
    out = llm.generate([{"prompt_token_ids": changed}], GREEDY)[0]
    assert out.num_cached_tokens == 0
    assert llm.generate([{"prompt_token_ids": original}], GREEDY)[0].num_cached_tokens == 32
    alone = LLM(tiny_model_dir, num_gpu_blocks=32, enable_prefix_caching=False)
    assert out.outputs[0].token_ids == alone.generate([{"prompt_token_ids": changed}], GREEDY)[0].outputs[0].token_ids


CHAIN = """
from kvlayer.engine.block_manager import block_hash, root_hash
h = root_hash("tenant-a")
for i in range(3):
    h = block_hash(h, list(range(16 * i, 16 * i + 16)))
    print(h.hex())
print(hash("kvlayer"))
"""


def test_block_hashes_are_identical_across_processes():
    h, here = root_hash("tenant-a"), []
    for i in range(3):
        h = block_hash(h, list(range(16 * i, 16 * i + 16)))
        here.append(h.hex())
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    child = subprocess.run([sys.executable, "-c", CHAIN], env={**os.environ, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout.split()
    assert child[3] != str(hash("kvlayer")), "the child must hash str differently for this test to mean anything"
    assert child[:3] == here
    assert len(set(here)) == 3


# ----- reference counts -------------------------------------------------------------------------
def test_shared_prefix_blocks_are_held_by_both_requests(tiny_model_dir):
    prefix = list(range(200, 232))  # two full blocks
    first, second = prefix + list(range(10, 18)), prefix + list(range(40, 50))
    llm = LLM(tiny_model_dir, num_gpu_blocks=16)
    engine, bm = llm.engine, llm.engine.block_manager
    outs = {}
    engine.add_request({"prompt_token_ids": first}, GREEDY, request_id="first")
    outs.update((o.request_id, o) for o in engine.step())
    engine.add_request({"prompt_token_ids": second}, GREEDY, request_id="second")
    outs.update((o.request_id, o) for o in engine.step())
    a, b = engine.scheduler.running
    assert (a.request_id, b.request_id, b.num_cached_tokens) == ("first", "second", 32)
    assert a.block_table[:2] == b.block_table[:2]
    refs = {bid: bm.blocks[bid].ref_count for bid in a.block_table + b.block_table}
    assert refs == {a.block_table[0]: 2, a.block_table[1]: 2, a.block_table[2]: 1, b.block_table[2]: 1}
    while not outs["first"].finished:
        outs.update((o.request_id, o) for o in engine.step())
    assert engine.scheduler.running == [b]
    assert [bm.blocks[bid].ref_count for bid in b.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 16 - 3  # the shared blocks stay out of the pool while second holds them
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert bm.num_free_blocks == 16
    assert all(block.ref_count == 0 for block in bm.blocks)
    alone = LLM(tiny_model_dir, num_gpu_blocks=16, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for p in (first, second)
                for o in alone.generate([{"prompt_token_ids": p}], GREEDY)]
    assert [outs["first"].outputs[0].token_ids, outs["second"].outputs[0].token_ids] == expected
